"""``exp_avg_mask`` on FSDP2: a module's mask as bits in the layout of ``X`` (1: kept; padding
positions 0), hand-given (checked, checksummed) or ``"auto"`` (each rank's records of its
shard's zero gradients in the warmup, all-gathered at the freeze), and its values on a rank's
shards (docs/algorithms.md, "1-bit Adam and 1-bit LAMB on FSDP2")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from fn import kernels
from fn.collectives.agreement import digest
from fn.fsdp.onebit_layout import ModuleLayout, params_of_x, row_of, to_local

__all__ = [
    "MomentumMasks",
    "mask_checksum",
    "mask_problem",
    "mask_values",
    "module_mask",
    "relaid_mask",
]


class MomentumMasks:
    """The masks of a :class:`~fn.fsdp.ShardedOnebitOptimizer` (a part of it: it reads the
    optimizer's ``_layouts``, ``_masks`` (by module: bits in the layout of ``X``, or ``None``),
    ``_zero_records`` (``exp_avg_mask="auto"``'s, until the freeze), ``rank`` and ``comm``)."""

    def _momentum_masks(self) -> dict[str, torch.Tensor | None] | None:
        """Every param's shard of its mask (0. or 1., shaped like the shard; ``None`` for a
        module without a mask), by FQN; ``None`` when no module has a mask."""
        if all(mask is None for mask in self._masks.values()):
            return None
        masks = {}
        for layout in self._layouts:
            shards = {slot.name: to_local(slot.param) for slot in layout.slots}
            mask = self._masks[layout.name]
            masks.update(
                dict.fromkeys(shards) if mask is None else self._shard_masks(layout, shards, mask)
            )
        return masks

    def _set_masks(
        self, masks: dict[str, torch.Tensor | None], records: dict[str, torch.Tensor] | None
    ) -> None:
        """Sets the masks and ``exp_avg_mask="auto"``'s records. With one rank and no
        replicas, where no collective runs, the rule itself multiplies the momentum by the
        masks, so it is built anew with them."""
        self._masks, self._zero_records = masks, records
        if not self._communicates:
            self._rule = self._single_rank_rule(
                self._settings, self.error_dtype, self._momentum_masks()
            )

    def _shard_masks(
        self, layout: ModuleLayout, shards: dict[str, torch.Tensor], mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """This rank's values (0. or 1.) of a module's mask (bits in the layout of ``X``),
        shaped like its ``shards``, by param."""
        values = {}
        for slot in layout.slots:
            shard = shards[slot.name]
            start = self.rank * layout.padded_row + slot.offset
            values[slot.name] = mask_values(mask, start, shard.numel()).view(shard.shape)
        return values

    def _masked_shards(
        self, layout: ModuleLayout, shards: dict[str, torch.Tensor], mask: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """A module's momentum shards (this rank's, by param) times its mask (bits in the
        layout of ``X``)."""
        if mask is None:
            return shards
        values = self._shard_masks(layout, shards, mask)
        return {name: shards[name] * value for name, value in values.items()}

    def _masked_row(self, layout: ModuleLayout, row: torch.Tensor) -> torch.Tensor:
        """This rank's row of a module's momentum in the layout of ``X``, times the module's
        mask (``row`` itself without one): a 0/1 mask's product is exact, so the rule gets
        the values it would compute itself."""
        mask = self._masks[layout.name]
        if mask is None:
            return row
        return row * mask_values(mask, self.rank * layout.padded_row, layout.padded_row)

    def _observed_zeros(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """``exp_avg_mask="auto"``'s records after a warmup update whose mean gradient shards
        are ``grads``: each ANDed with the bits of this rank's row of ``X`` where the mean
        gradient is exactly 0 (``-|g| >= 0``, ``-0.0`` included, as ``fn.onebit_adam``'s
        record). Padding positions hold 0, so they stay 1; a param without a gradient keeps
        its bits (as a leaf without one keeps its record)."""
        records = {}
        for layout in self._layouts:
            record = self._zero_records[layout.name]
            row = row_of(layout, grads, record.device)
            records[layout.name] = record & kernels.packbits(row.abs_().neg_())
        return records

    def _frozen_masks(self) -> dict[str, torch.Tensor]:
        """``exp_avg_mask="auto"``'s masks at the freeze, as bits in the layout of ``X`` (1:
        kept): each module's records all-gathered (``n / (8 W)`` bytes per rank, once) and
        inverted, 1 where the mean gradient was non-zero at some warmup update, 0 where it was
        exactly 0 at every one and at the padding positions."""
        return {
            name: self.comm.all_gather(record).view(-1).bitwise_not_()
            for name, record in self._zero_records.items()
        }


def mask_problem(
    found: list[tuple[str, list[tuple[str, DTensor]]]], exp_avg_mask: Any
) -> tuple[type[Exception], str] | None:
    """What is wrong with ``exp_avg_mask`` (``"auto"``, or ``{param: mask}``, full-shape plain
    tensors of 0 and 1, broadcastable to their param's shape), or ``None``."""
    if exp_avg_mask is None or isinstance(exp_avg_mask, str) and exp_avg_mask == "auto":
        return None
    if isinstance(exp_avg_mask, str):
        return ValueError, (
            f'exp_avg_mask must be {{param: mask}}, None or "auto", got {exp_avg_mask!r}'
        )
    if not isinstance(exp_avg_mask, Mapping):
        return TypeError, (
            f"exp_avg_mask must be a mapping {{param: mask}}, got {type(exp_avg_mask).__name__}"
        )
    names = {id(p): n for _, ps in found for n, p in ps}
    for param, mask in exp_avg_mask.items():
        if id(param) not in names:
            return ValueError, "exp_avg_mask has a key that is not a trainable param of the model"
        name = names[id(param)]
        if not isinstance(mask, torch.Tensor) or isinstance(mask, DTensor):
            return TypeError, (
                f"exp_avg_mask[{name}] must be a plain tensor of the param's full shape (for a "
                "DTensor pass mask.full_tensor())"
            )
        try:
            torch.broadcast_shapes(mask.shape, param.shape)
        except RuntimeError:
            return ValueError, (
                f"exp_avg_mask[{name}] of shape {tuple(mask.shape)} does not broadcast to the "
                f"param's shape {tuple(param.shape)}"
            )
        if not bool(((mask == 0) | (mask == 1)).all()):
            return NotImplementedError, (
                f"exp_avg_mask[{name}] holds values other than 0 and 1: on FSDP2 a mask is kept "
                "as bits in each module's layout"
            )
    return None


def mask_checksum(exp_avg_mask: Mapping[Any, torch.Tensor] | None, order: list[Any]) -> int:
    """CRC-32 of the masks' values, broadcast to their params' shapes, in ``order`` (0: none)."""
    if not exp_avg_mask:
        return 0
    crc = 0
    for param in order:
        mask = exp_avg_mask.get(param)
        if mask is not None:
            full = mask.to("cpu", torch.float32).broadcast_to(param.shape).contiguous()
            crc = digest(full.numpy().tobytes(), digest(repr(tuple(param.shape)), crc))
    return crc


def module_mask(
    layout: ModuleLayout, exp_avg_mask: Mapping[Any, torch.Tensor], world_size: int
) -> torch.Tensor | None:
    """A module's masks in the layout of ``X`` as bits (1: kept; padding positions 0), or
    ``None`` when none of its params has a mask."""
    masks = [exp_avg_mask.get(slot.param) for slot in layout.slots]
    if all(m is None for m in masks):
        return None
    x = torch.zeros(world_size, layout.padded_row)
    for slot, mask in zip(layout.slots, masks, strict=True):
        shape = slot.param.shape
        full = torch.ones(shape) if mask is None else mask.to("cpu").float().broadcast_to(shape)
        dim = next(pl.dim for pl in slot.param.placements if isinstance(pl, Shard))
        for j, chunk in enumerate(full.chunk(world_size, dim)):
            x[j, slot.offset : slot.offset + chunk.numel()] = chunk.reshape(-1)
    return kernels.packbits((x - 0.5).view(-1)).to(layout.slots[0].param.device)


def mask_values(bits: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``count`` values (0. or 1.) of a mask in bits, from position ``start``."""
    skip = start % 8
    piece = bits[start // 8 : (start + count + 7) // 8]
    return (kernels.unpackbits(piece, skip + count)[skip:] > 0).to(torch.float32)


def relaid_mask(layout: ModuleLayout, bits: torch.Tensor, saved: ModuleLayout) -> torch.Tensor:
    """``bits``, a module's mask (1: kept) in ``saved``, the layout of ``X`` on the mesh it was
    saved on, in ``layout`` (padding positions 0). In the same layout it is ``bits``."""
    rows = kernels.unpackbits(bits, saved.world_size * saved.padded_row)
    full = params_of_x(saved, rows.view(saved.world_size, -1))
    masks = {slot.param: x > 0 for slot, x in zip(layout.slots, full, strict=True)}
    return module_mask(layout, masks, layout.world_size)
