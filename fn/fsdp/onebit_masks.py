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
from fn.fsdp.onebit_layout import ModuleLayout, params_of_x

__all__ = [
    "mask_checksum",
    "mask_problem",
    "mask_values",
    "masked_shards",
    "module_mask",
    "relaid_mask",
    "shard_masks",
]


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


def shard_masks(
    layout: ModuleLayout, rank: int, shards: Mapping[str, torch.Tensor], mask: torch.Tensor | None
) -> dict[str, torch.Tensor | None]:
    """Rank ``rank``'s values (0. or 1.) of a module's ``mask`` (bits in the layout of ``X``),
    shaped like its params' ``shards`` (by FQN); ``None`` for each without a mask."""
    if mask is None:
        return dict.fromkeys(slot.name for slot in layout.slots)
    values = {}
    for slot in layout.slots:
        shard = shards[slot.name]
        start = rank * layout.padded_row + slot.offset
        values[slot.name] = mask_values(mask, start, shard.numel()).view(shard.shape)
    return values


def masked_shards(
    layout: ModuleLayout, rank: int, shards: dict[str, torch.Tensor], mask: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """A module's momentum ``shards`` (rank ``rank``'s, by param) times its ``mask``."""
    if mask is None:
        return shards
    values = shard_masks(layout, rank, shards, mask)
    return {name: shards[name] * value for name, value in values.items()}


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
