"""1-bit Adam and 1-bit LAMB on a model sharded by FSDP2, the 1-bit allreduce of the momentum
inside the reduce-scatter of every FSDP2 module: :class:`ShardedOnebitOptimizer` (the
machinery) and :class:`OnebitAdam` (``fn.fsdp.onebit_lamb`` has :class:`~fn.fsdp.OnebitLamb`).

Each FSDP2 module's gradients are one vector ``X`` in FSDP2's layout (``W`` rows, row ``j`` rank
``j``'s shard, each padded to a multiple of ``lcm(W, 8)``), so that chunk ``j`` of
``fn.collectives.compressed_allreduce`` is rank ``j``'s shard. Warmup updates reduce-scatter
densely; compressed ones run the collective's phases on the momentum inside the reduce-scatter
and keep it, full size, as its packed signs. ``step()`` then runs the per-leaf rule of
``fn.onebit_adam`` (or ``fn.onebit_lamb``) on every shard
(``fn.transforms.onebit_adam_sharded``, ``onebit_lamb_sharded``). The rule, the
buffers each rank holds and the bytes it sends are in docs/algorithms.md, "1-bit Adam and 1-bit
LAMB on FSDP2".
"""

from __future__ import annotations

import math
import sys
import warnings
import weakref
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import (
    ReduceScatter,
)  # torch exports no public name
from torch.distributed.tensor import DTensor, Shard

from fn import kernels
from fn.base import CompressedOptimizer, apply_updates, set_hyperparams
from fn.collectives import (
    Local,
    PackedSigns,
    ProcessGroup,
    check_error_dtype,
    init_error_feedback,
)
from fn.collectives.onebit import (
    compressed_allreduce,
    compressed_allreduce_exchange,
    write_errors,
)
from fn.errors import NonFiniteError
from fn.fsdp._agreement import agree
from fn.fsdp.loco import ROOT
from fn.fsdp.reduce_scatter import CommCache, reduce_scale
from fn.transforms import AutoFreeze, gradient_energy, onebit_adam, onebit_adam_sharded

__all__ = ["OnebitAdam", "ShardedOnebitOptimizer", "ZeroOneAdam"]

_FORMAT = 1  # the layout of ShardedOnebitOptimizer.state_dict()
_TORCH_STATE_DICT_API = "torch.distributed.checkpoint.state_dict"
_AUTO_MASK_KEYS = ("always_zero", "exp_avg_mask")  # and with exp_avg_mask="auto"

# The FSDP2 modules that carry an fn.fsdp optimizer's reduce-scatter, and that optimizer.
_INSTALLED: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


class ParamSlot(NamedTuple):
    """Where one param sits in its module's compressed vector ``X`` (``[W, S']``)."""

    name: str  # the param's FQN in the model
    param: DTensor
    offset: int  # its first value in every row
    width: int  # its values per row, padding included (numel / W after dim-0 padding)
    real: tuple[int, ...]  # per rank j: how many of row j's ``width`` values are its elements


class ModuleLayout(NamedTuple):
    """One FSDP2 module's compressed vector: ``W`` rows of ``padded_row`` values, of which the
    first ``row`` are FSDP2's reduce-scatter row and the rest zeros."""

    name: str  # the module's FQN ("<root>" for the model itself)
    slots: tuple[ParamSlot, ...]  # its params in FSDP2's order
    row: int  # S: FSDP2's row
    padded_row: int  # S': S rounded up to a multiple of lcm(W, 8)

    def padding(self, world_size: int) -> list[tuple[int, int]]:
        """The flat ``[start, stop)`` ranges of ``X`` that hold no element of a param."""
        ranges = []
        for j in range(world_size):
            base = j * self.padded_row
            for slot in self.slots:
                if slot.real[j] < slot.width:
                    start = base + slot.offset
                    ranges.append((start + slot.real[j], start + slot.width))
            if self.padded_row > self.row:
                ranges.append((base + self.row, base + self.padded_row))
        return ranges


def module_layout(name: str, params: list[tuple[str, DTensor]], world_size: int) -> ModuleLayout:
    """The layout of ``X`` for a module's params (FQN and sharded param, in FSDP2's order)."""
    slots, offset = [], 0
    for fqn, p in params:
        dim = next(pl.dim for pl in p.placements if isinstance(pl, Shard))
        if dim == 0 and p.dim() > 0:
            rows = -(-p.shape[0] // world_size)  # FSDP2 pads dim 0 to a multiple of W
            per_row = math.prod(p.shape[1:])
            width = rows * per_row
            real = tuple(
                max(0, min(rows, p.shape[0] - j * rows)) * per_row for j in range(world_size)
            )
        else:  # Shard(d > 0): even chunks, FSDP2 checks it
            width = p.numel() // world_size
            real = (width,) * world_size
        slots.append(ParamSlot(fqn, p, offset, width, real))
        offset += width
    unit = math.lcm(world_size, 8)
    return ModuleLayout(name, tuple(slots), offset, -(-offset // unit) * unit)


class _Compressed:
    """One module's compressed state on this rank: the momentum (all ``W`` chunks' packed signs
    and scales, ``None`` before the freeze), the worker and server errors, and whether its
    reduce-scatter has run for the coming update."""

    def __init__(self) -> None:
        self.signs: PackedSigns | None = None
        self.errors: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pending = False  # its momentum holds this backward's gradient; step() consumes it


class OnebitReduceScatter(ReduceScatter):
    """The reduce-scatter of one FSDP2 module under a :class:`ShardedOnebitOptimizer`
    (installed by it): dense in the warmup, the 1-bit allreduce of the momentum once
    compressed."""

    def __init__(self, optimizer: ShardedOnebitOptimizer, layout: ModuleLayout) -> None:
        self.optimizer = optimizer
        self.layout = layout

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new uninitialized buffer (FSDP2 asks for the input and the output)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        """Writes this rank's shard into ``output_tensor`` (see :class:`OnebitAdam`).

        It never raises (FSDP2 stops reduce-scattering after an exception in its backward): a
        problem is recorded, the output filled with NaN, and the next ``step()`` raises it.
        """
        try:
            if async_op:
                raise NotImplementedError(f"{self.optimizer.name} reduce-scatters synchronously")
            self.optimizer._reduce_scatter(self.layout, output_tensor, input_tensor, group, op)
        except Exception as problem:  # noqa: BLE001 (every problem goes to step())
            self.optimizer._problems.append(problem)
            output_tensor.fill_(torch.nan)


class ShardedOnebitOptimizer(torch.optim.Optimizer):
    """What the 1-bit optimizers on FSDP2 share (:class:`OnebitAdam`,
    :class:`~fn.fsdp.OnebitLamb`): the model's FSDP2 modules and their layouts, the
    reduce-scatter installed on each (dense in the warmup, the 1-bit allreduce of the momentum
    once compressed), ``step()`` on the shards, the checks across ranks and the DCP state dict.

    A subclass gives the rule (``fn.transforms``' sharded rule, and the rule with one rank),
    what each module's compressed vector is (:meth:`_exchange`) and its further state fields.
    It is constructed through a subclass, whose arguments are those of :class:`OnebitAdam`.
    """

    # The compressed phase keeps the momentum's fp32 shards in the state (the rule reads the
    # momentum before the update); else only the packed signs hold it.
    keeps_momentum_shards = False
    scalar_fields: tuple[str, ...] = ()  # the rule's per-param 0-dim fields (same on all ranks)
    optional_fields: tuple[str, ...] = ()  # the rule's further per-param shards, maybe None

    def __init__(
        self,
        model: nn.Module,
        settings: dict[str, Any],
        *,
        non_freeze: bool,
        exp_avg_mask: Any,
        nonfinite: str,
        local_world_size: int | None,
        error_dtype: torch.dtype,
    ) -> None:
        self.name = f"fn.fsdp.{type(self).__name__}"
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{self.name}: model must be the nn.Module that fully_shard sharded (the "
                "optimizer installs its reduce-scatter on the model's FSDP2 modules), got "
                f"{type(model).__name__}: pass the model itself, not model.parameters()"
            )
        found = _modules(model)
        group = found[0][1][0][1].device_mesh.get_group(0) if found and _one_dim(found) else None
        problem = _problem(model, found, non_freeze, exp_avg_mask, nonfinite, local_world_size)
        if problem is None:
            problem = self._bad_settings(settings, error_dtype)
        masks = None if problem else exp_avg_mask
        self._auto_mask = isinstance(masks, str)  # exp_avg_mask="auto"
        order = [p for _, ps in found for _, p in ps]
        # in the ranks' agreement and the checkpoints' settings: "auto", or the masks' checksum
        self._mask_setting = "auto" if self._auto_mask else _mask_checksum(masks, order)
        fingerprint = repr(
            (settings, non_freeze, self._mask_setting, nonfinite, local_world_size,
             str(error_dtype), [(m, [(n, tuple(p.shape)) for n, p in ps]) for m, ps in found])
        )  # fmt: skip
        device = found[0][1][0][1].device if found else "cpu"
        agree(self.name, group, problem, fingerprint, device=device)
        self._comms = CommCache(None)
        self.comm = self._comms(group)
        world_size = self.comm.world_size
        self.error_dtype = error_dtype
        self.rank = dist.get_rank(group)
        self._layouts = [module_layout(name, params, world_size) for name, params in found]
        self._compressed = {layout.name: _Compressed() for layout in self._layouts}
        self._masks = {  # by module: its exp_avg_mask as bits in the layout of X, or None
            x.name: None if masks is None or self._auto_mask else _module_mask(x, masks, world_size)
            for x in self._layouts
        }
        # exp_avg_mask="auto" until the freeze: by module, this rank's row of X as bits, 1 where
        # the mean gradient was exactly 0 at every warmup update so far (padding positions 1);
        # None otherwise
        self._zero_records = None
        if self._auto_mask:
            self._zero_records = {
                x.name: torch.full(
                    (x.padded_row // 8,), 255, dtype=torch.uint8, device=x.slots[0].param.device
                )
                for x in self._layouts
            }
        self._b1 = float(settings["betas"][0])
        self._settings = settings
        self._setting_names = sorted(k for k in settings if k != "lr")
        params = [slot.param for layout in self._layouts for slot in layout.slots]
        super().__init__(params, dict(settings))
        if world_size > 1:
            self._rule = self._make_rule(settings, self.comm)
        else:
            self._rule = self._single_rank_rule(settings, error_dtype, self._momentum_masks())
        self._state = self._rule.init(self._shards())
        self._automatic = self._state.auto is not None  # freeze_step="auto": decided in the state
        self._problems: list[Exception] = []  # what the reduce-scatters found, for step()
        self._delivered = False  # whether a backward delivered gradients since the last step()
        self._fsdp_modules: list[nn.Module] = []
        for name, module in model.named_modules():
            layout = next((x for x in self._layouts if x.name == (name or ROOT)), None)
            if layout is not None:
                self._fsdp_modules.append(module)
                module.set_custom_reduce_scatter(OnebitReduceScatter(self, layout))
                # every trainable param in every reduce-scatter: a missing gradient is a zero
                module.set_reduce_scatter_unused_params(True, recurse=False)
                _INSTALLED[module] = self
        for param in params:  # FSDP2 runs these once it has written a gradient shard
            param.register_post_accumulate_grad_hook(self._gradient_delivered)

    @property
    def count(self) -> int:
        """The number of updates made."""
        return int(self._state.count)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent through fn's communicators (reduce-scatters, the freeze's
        all-gathers and the checks; FSDP2's parameter all-gathers are not counted)."""
        return self._comms.bytes_sent

    def warn_if_never_compressed(self, updates: int, source: str = "this run") -> bool:
        """Warns (``UserWarning``) when none of the first ``updates`` updates would be
        compressed (a ``freeze_step`` beyond the run; with ``freeze_step="auto"``, a
        ``max_updates`` not below it while the switch is undecided): every update would be a
        dense reduce-scatter, as plain Adam's. ``fn.integrations`` calls it with the run's
        length.

        Args:
            updates: the number of updates the run makes.
            source: where ``updates`` comes from, for the message.

        Returns:
            Whether it warned.
        """
        if self._rule.first_compressed_update(updates, self._state) is not None:
            return False
        warnings.warn(
            f"{self.name} makes no compressed update within {source} ({updates} updates), or "
            'with freeze_step="auto" none is certain: until one is, every update is a dense '
            "reduce-scatter, as plain Adam's, and saves no bandwidth; "
            "set freeze_step, or freeze_step=fn.AutoFreeze(max_updates=...), below "
            f"{updates}",
            stacklevel=2,
        )
        return True

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as a ``torch.distributed.checkpoint`` (DCP) state dict, in one
        layout at every update (DCP loads in place into a layout fixed before it reads).

        ``{"header", "lr", "signed", "exp_avg", "exp_avg_sq", "momentum", "rank<r>"}``:
        ``header`` (int64: format, world size, updates made, checksums of the model's layout
        and of the settings); ``lr`` (``param_groups[0]["lr"]``); ``signed`` (int8 per module:
        whether its momentum is kept as packed signs); ``exp_avg`` and ``exp_avg_sq`` by param
        FQN, DTensors of the shards (``exp_avg``: zeros where the momentum is packed);
        ``momentum`` by module, the packed signs and scales of its full momentum (zeros before
        the freeze; the same on every rank, so DCP saves them once); and under ``rank<r>``, a
        name of this rank's own, by module its worker and server errors (zeros before the
        first compressed update; DCP would keep one rank's copy of a name every rank saves).
        With ``freeze_step="auto"``, ``auto`` holds the decision and its statistics (0-dim,
        the same on every rank). With ``exp_avg_mask="auto"``, by module and as bits in the
        layout of ``X``, ``always_zero`` holds the warmup's records of zero gradients (a
        DTensor of the ranks' rows, each rank's its own; zeros after the freeze) and
        ``exp_avg_mask`` the mask (the same on every rank; zeros before the freeze). A
        subclass's further per-param fields come by field name: its ``scalar_fields`` (0-dim,
        the same on every rank) and its ``optional_fields`` (DTensors of the shards, zeros
        where ``None``, with ``"<field>_held"``: int8 per param, whether it holds a tensor).
        :class:`~fn.fsdp.TrainingCheckpoint` saves it, and loads it at any world size, checked
        before anything changes; ``dcp.load`` straight into it works at the same world size.

        Returns:
            A dict of tensors: the state's own where it holds them, zeros where it does not.

        Raises:
            NotImplementedError: called by ``torch.distributed.checkpoint.state_dict``
                (``get_state_dict``, ``get_optimizer_state_dict``), which keeps only
                ``torch.optim``'s per-param form; nothing was changed.
            RuntimeError: called between a compressed update's backward and its ``step()``
                (the momentum already holds that backward's gradient, the update count not
                yet); nothing was changed.
        """
        # torch's API would drop every key of this form and fail on the missing "state"
        if sys._getframe(1).f_globals.get("__name__") == _TORCH_STATE_DICT_API:
            raise NotImplementedError(_not_torch_format(self.name))
        if any(held.pending for held in self._compressed.values()):
            raise RuntimeError(
                f"{self.name}: state_dict() between a backward and its step() in the "
                "compressed phase: the packed momentum already holds this backward's "
                "gradient, and a resumed run would apply it twice; save after step() (or "
                "after zero_grad() and a step() that raised)"
            )
        world_size = self.comm.world_size
        signed = [self._compressed[x.name].signs is not None for x in self._layouts]
        mine: dict[str, dict[str, torch.Tensor]] = {}
        state: dict[str, Any] = {
            "header": self._header(),
            "lr": torch.tensor(float(self.param_groups[0]["lr"]), dtype=torch.float64),
            "signed": torch.tensor(signed, dtype=torch.int8),
            "exp_avg": {},
            "exp_avg_sq": {},
            "momentum": {},
            f"rank{self.rank}": mine,
        }
        for layout in self._layouts:
            for slot in layout.slots:
                m = self._state.exp_avg[slot.name]
                m = m if isinstance(m, torch.Tensor) else torch.zeros(0)
                state["exp_avg"][slot.name] = _shard_of(m, slot.param)
                v = self._state.exp_avg_sq[slot.name]
                state["exp_avg_sq"][slot.name] = _shard_of(v, slot.param)
            held = self._compressed[layout.name]
            signs = held.signs or PackedSigns(
                torch.zeros(world_size, layout.padded_row // 8, dtype=torch.uint8),
                torch.zeros(world_size),
            )
            state["momentum"][layout.name] = {"packed": signs.packed, "scales": signs.scales}
            errors = held.errors or init_error_feedback(
                world_size * layout.padded_row, comm=self.comm, dtype=self.error_dtype
            )
            mine[layout.name] = {"worker": errors[0], "server": errors[1]}
        slots = [slot for layout in self._layouts for slot in layout.slots]
        if self._automatic:
            state["auto"] = _auto_scalars(self._state.auto)
        if self._auto_mask:
            state.update(self._auto_mask_state())
        for field in self.scalar_fields:
            state[field] = {slot.name: getattr(self._state, field)[slot.name] for slot in slots}
        for field in self.optional_fields:
            values = [getattr(self._state, field)[slot.name] for slot in slots]
            state[f"{field}_held"] = torch.tensor([x is not None for x in values], dtype=torch.int8)
            state[field] = {
                slot.name: _shard_of(torch.zeros(0) if x is None else x, slot.param)
                for slot, x in zip(slots, values, strict=True)
            }
        return state

    def checkpoint_template(
        self, header: torch.Tensor, saved: dict[str, torch.Size]
    ) -> dict[str, Any]:
        """The state dict that DCP loads a checkpoint of :meth:`state_dict` into: new tensors
        laid out as saved (this rank's errors only if the world size is the same).

        Args:
            header: the checkpoint's ``header`` (loaded first).
            saved: the checkpoint's optimizer keys, flat (``"exp_avg.block.weight"``), and
                their sizes (from the checkpoint's metadata).

        Returns:
            A dict of the form of :meth:`state_dict`, to pass to ``dcp.load``.

        Raises:
            ValueError: the header does not match this model or these settings, or a key is
                missing (nothing was loaded).
        """
        auto_saved = any(key.startswith("always_zero.") for key in saved)
        world_size, _ = self._checked_header(header, auto_saved)
        own = f"rank{self.rank}"
        needed = ["lr", "signed"]
        for layout in self._layouts:
            needed += [f"momentum.{layout.name}.{k}" for k in ("packed", "scales")]
            if world_size == self.comm.world_size:
                needed += [f"{own}.{layout.name}.{k}" for k in ("worker", "server")]
            fields = ("exp_avg", "exp_avg_sq", *self.scalar_fields, *self.optional_fields)
            needed += [f"{f}.{s.name}" for s in layout.slots for f in fields]
        needed += [f"{field}_held" for field in self.optional_fields]
        if self._automatic:
            needed += [f"auto.{k}" for k in _auto_scalars(self._state.auto)]
        if self._auto_mask:
            needed += [f"{f}.{x.name}" for f in _AUTO_MASK_KEYS for x in self._layouts]
        missing = [key for key in needed if key not in saved]
        if missing:
            raise ValueError(
                f"{self.name}: the checkpoint has no {missing[:4]}; nothing was loaded"
            )

        def new(key: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(saved[key], dtype=dtype)

        template: dict[str, Any] = {
            "header": header.clone(),
            "lr": new("lr", torch.float64),
            "signed": new("signed", torch.int8),
            "exp_avg": {},
            "exp_avg_sq": {},
            "momentum": {},
        }
        for layout in self._layouts:
            template["momentum"][layout.name] = {
                k: new(f"momentum.{layout.name}.{k}", dtype)
                for k, dtype in (("packed", torch.uint8), ("scales", torch.float32))
            }
            for slot in layout.slots:
                for field in ("exp_avg", "exp_avg_sq", *self.optional_fields):
                    shard = _shard_of(torch.zeros(0), slot.param)
                    template.setdefault(field, {})[slot.name] = shard
                for field in self.scalar_fields:
                    key = f"{field}.{slot.name}"
                    template.setdefault(field, {})[slot.name] = new(key, torch.float32)
        for field in self.optional_fields:
            template[f"{field}_held"] = new(f"{field}_held", torch.int8)
        if self._automatic:
            template["auto"] = {k: v.clone() for k, v in _auto_scalars(self._state.auto).items()}
        if self._auto_mask:  # the records as a whole (at another world size too)
            for f in _AUTO_MASK_KEYS:
                template[f] = {x.name: new(f"{f}.{x.name}", torch.uint8) for x in self._layouts}
        if world_size == self.comm.world_size:
            template[own] = {
                x.name: {
                    k: new(f"{own}.{x.name}.{k}", self.error_dtype) for k in ("worker", "server")
                }
                for x in self._layouts
            }
        return template

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` (as :meth:`state_dict` or :meth:`checkpoint_template`
        lays it out).

        Saved at this world size, the state continues bit for bit. Saved at another one, the
        momentum is read back exactly into this world size's layout, and the error feedback
        (which compensated the old layout's compression) restarts from zero with a warning.

        Raises:
            ValueError: the checkpoint is of another model or other settings; nothing was
                changed.
            NotImplementedError: ``state_dict`` is in ``torch.optim``'s per-param form (as
                ``torch.distributed.checkpoint.state_dict.set_state_dict`` passes it); nothing
                was changed.
        """
        if "header" not in state_dict:
            raise NotImplementedError(_not_torch_format(self.name))
        auto_saved = "always_zero" in state_dict
        world_size, count = self._checked_header(state_dict["header"], auto_saved)
        same = world_size == self.comm.world_size
        signed = [bool(x) for x in state_dict["signed"].tolist()]
        if len(signed) != len(self._layouts):
            raise ValueError(f"{self.name}: corrupt checkpoint: signed = {signed}")
        auto = self._state.auto
        if self._automatic:
            loaded = {k: state_dict["auto"][k].clone() for k in _auto_scalars(auto)}
            auto = auto._replace(**loaded)
        masks, records = self._masks, self._zero_records
        if self._auto_mask:
            frozen = self._rule.is_compressed(count, self._state._replace(auto=auto))
            masks, records = self._loaded_auto_masks(state_dict, world_size, frozen)
        own = state_dict.get(f"rank{self.rank}", {}) if same else {}
        exp_avg, exp_avg_sq, compressed = {}, {}, {}
        for layout, packed in zip(self._layouts, signed, strict=True):
            held = _Compressed()
            for slot in layout.slots:
                exp_avg_sq[slot.name] = _local(state_dict["exp_avg_sq"][slot.name]).clone()
                m = _local(state_dict["exp_avg"][slot.name]).clone()
                exp_avg[slot.name] = None if packed and not self.keeps_momentum_shards else m
            if packed:
                signs = state_dict["momentum"][layout.name]
                held.signs = PackedSigns(signs["packed"].clone(), signs["scales"].clone())
                if same:
                    errors = own[layout.name]
                    held.errors = (errors["worker"].clone(), errors["server"].clone())
                else:  # the shards' momentum, in this world size's layout
                    if not self.keeps_momentum_shards:  # (else DCP resharded exp_avg)
                        slots = [(s.name, s.param) for s in layout.slots]
                        old = module_layout(layout.name, slots, world_size)
                        world, rank = self.comm.world_size, self.rank
                        shards = _momentum_from_signs(old, held.signs, world, rank)
                        exp_avg.update(self._masked_shards(layout, shards, masks[layout.name]))
                    held.signs = None
            compressed[layout.name] = held
        if not same and any(signed):
            warnings.warn(
                f"{self.name}: checkpoint saved at world size {world_size}, loaded at "
                f"{self.comm.world_size}: the error feedback restarts from zero (the momentum "
                "is kept)",
                stacklevel=2,
            )
        names = [slot.name for layout in self._layouts for slot in layout.slots]
        extra = {
            field: {k: state_dict[field][k].clone() for k in names} for field in self.scalar_fields
        }
        for field in self.optional_fields:
            held_by = [bool(x) for x in state_dict[f"{field}_held"].tolist()]
            values = [_local(state_dict[field][k]).clone() for k in names]
            extra[field] = {
                k: x if kept else None for k, x, kept in zip(names, values, held_by, strict=True)
            }
        if self._automatic:
            extra["auto"] = auto
        self.param_groups[0]["lr"] = float(state_dict["lr"])
        self._state = self._state._replace(
            count=torch.tensor(count, dtype=torch.int64),
            lr=torch.tensor(float(state_dict["lr"]), dtype=torch.float32),
            exp_avg=exp_avg,
            exp_avg_sq=exp_avg_sq,
            **extra,
        )
        self._compressed = compressed
        self._set_masks(masks, records)

    def _auto_mask_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """``exp_avg_mask="auto"``'s part of :meth:`state_dict`, by module: ``always_zero``,
        the records (a DTensor of the ranks' rows: each rank saves its own; zeros after the
        freeze), and ``exp_avg_mask``, the masks (the same on every rank; zeros before the
        freeze), both bits in the layout of ``X``."""
        world_size = self.comm.world_size
        records, masks = {}, {}
        for layout in self._layouts:
            param = layout.slots[0].param
            size = layout.padded_row // 8
            record = torch.zeros(size, dtype=torch.uint8, device=param.device)
            if self._zero_records is not None:
                record = self._zero_records[layout.name]
            records[layout.name] = DTensor.from_local(
                record, param.device_mesh, [Shard(0)], shape=(world_size * size,), stride=(1,)
            )
            mask = self._masks[layout.name]
            if mask is None:
                mask = torch.zeros(world_size * size, dtype=torch.uint8, device=param.device)
            masks[layout.name] = mask
        return {"always_zero": records, "exp_avg_mask": masks}

    def _loaded_auto_masks(
        self, state_dict: dict[str, Any], world_size: int, frozen: bool
    ) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor] | None]:
        """``exp_avg_mask="auto"``'s masks and records (the optimizer's ``_masks`` and
        ``_zero_records``) from a :meth:`state_dict` saved at ``world_size``, in this world
        size's layout: after the freeze (``frozen``) the masks, before it the records."""
        masks: dict[str, torch.Tensor | None] = {x.name: None for x in self._layouts}
        records = {}
        for layout in self._layouts:
            if frozen:
                saved = state_dict["exp_avg_mask"][layout.name]
                masks[layout.name] = _relaid_mask(layout, saved, world_size, self.comm.world_size)
                continue
            saved = state_dict["always_zero"][layout.name]
            if isinstance(saved, DTensor):  # dcp.load into state_dict(): this rank's own row
                records[layout.name] = saved.to_local().clone()
                continue
            seen = _relaid_mask(layout, saved.bitwise_not(), world_size, self.comm.world_size)
            size = layout.padded_row // 8
            records[layout.name] = seen[self.rank * size : (self.rank + 1) * size].bitwise_not()
        return masks, None if frozen else records

    def _header(self) -> torch.Tensor:
        """``[format, world size, updates made, crc of the layout, crc of the settings]``."""
        return torch.tensor(
            [_FORMAT, self.comm.world_size, self.count, *self._fingerprints()], dtype=torch.int64
        )

    def _fingerprints(self) -> tuple[int, int]:
        layout = repr(
            [(x.name, [(s.name, tuple(s.param.shape)) for s in x.slots]) for x in self._layouts]
        )
        group = self.param_groups[0]  # the rule's settings (not lr, nor a scheduler's keys)
        fixed = {k: group[k] for k in self._setting_names}
        masks = (self._mask_setting,) if self._mask_setting else ()  # (older ones had none)
        settings = repr((fixed, str(self.error_dtype), *masks))
        return zlib.crc32(layout.encode()), zlib.crc32(settings.encode())

    def _checked_header(self, header: torch.Tensor, auto_saved: bool) -> tuple[int, int]:
        """The checkpoint's world size and update count, or ``ValueError`` if it is not a
        checkpoint of this model and these settings (``auto_saved``: whether it holds
        ``exp_avg_mask="auto"``'s records)."""
        values = header.tolist()
        if len(values) != 5 or values[0] != _FORMAT:
            raise ValueError(
                f"{self.name}: not a checkpoint of this format (header {values}); "
                "nothing was loaded"
            )
        _, world_size, count, layout, settings = values
        layout_now, settings_now = self._fingerprints()
        if layout != layout_now:
            raise ValueError(
                f"{self.name}: the checkpoint is of another model (its FSDP2 modules, "
                "params or shapes differ); nothing was loaded"
            )
        if auto_saved != self._auto_mask:
            made, here = ("", "not ") if auto_saved else ("not ", "")
            raise ValueError(
                f'{self.name}: the checkpoint was saved with exp_avg_mask {made}"auto", this '
                f"optimizer's is {here}\"auto\" (the records of the warmup's zero gradients "
                "are in the state); build the optimizer as the checkpoint's was; nothing was "
                "loaded"
            )
        if settings != settings_now:
            raise ValueError(
                f"{self.name}: the checkpoint was saved with other settings (its "
                "hyperparameters, exp_avg_mask or error_dtype); nothing was loaded"
            )
        if world_size < 1 or count < 0:
            raise ValueError(f"{self.name}: corrupt checkpoint header {values}")
        return world_size, count

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every param shard (see the class docstring), from the gradients that
        FSDP2's backward delivered since the last ``step()``.

        Without such gradients (``step()`` before any backward, a second ``step()`` after one,
        gradients set by hand, the zero-gradient step that
        ``torch.distributed.checkpoint.state_dict`` takes) it is a no-op: nothing changes,
        ``count`` included. A problem that a reduce-scatter of that backward found is raised
        here, on every rank, with no param changed; the next backward and ``step()`` train
        normally.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            fn.NonFiniteError: on every rank, if a gradient on some rank is not finite;
                no param and no ``v`` changed.
            RuntimeError: FSDP2 stopped reduce-scattering after an exception inside an earlier
                backward (not fn's: fn raises none there), or, on every rank, a module was
                reduce-scattered twice in the compressed phase without a ``step()`` between
                (accumulate with ``set_requires_gradient_sync(False)``); nothing changed.
            Exception: what else a reduce-scatter of the last backward raised (a collective's
                timeout, say), the same on every rank.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(_fsdp2_stopped(module) for module in self._fsdp_modules):
            raise RuntimeError(
                f"{self.name}: FSDP2 no longer reduce-scatters this model: an exception was "
                "raised inside an earlier backward (FSDP2 then never runs its end-of-backward "
                "callback again), so gradients no longer reach the optimizer; nothing was "
                "updated. Build the model and the optimizer anew (fully_shard, then this "
                "optimizer) and reload the last checkpoint (fn.fsdp.TrainingCheckpoint.load)"
            )
        reduced = {x.name: self._compressed[x.name].pending for x in self._layouts}
        problems, delivered = self._problems, self._delivered
        self._problems, self._delivered = [], False
        for held in self._compressed.values():
            held.pending = False
        if problems:
            raise problems[0]
        if not delivered:
            return loss
        t = self.count + 1
        warmup = not self._rule.is_compressed(t, self._state)
        freezes_mask = not warmup and self._zero_records is not None  # exp_avg_mask="auto"
        if freezes_mask:  # the records go once the update is made (a failed one is retried)
            self._set_masks(self._frozen_masks(), self._zero_records)
        compressed = self.comm.world_size > 1 and not warmup
        params = self._shards()
        records = None
        if compressed:
            inputs = self._momentum_shards(reduced)
        else:
            inputs = {
                slot.name: None if slot.param.grad is None else _local(slot.param.grad)
                for layout in self._layouts
                for slot in layout.slots
            }
            energy = self._checked_energy(inputs)
            if warmup and self._zero_records is not None:
                records = self._observed_zeros(inputs)
        state = set_hyperparams(self._state, lr=self.param_groups[0]["lr"])
        extra = {} if compressed or energy is None else {"gradient_energy": energy}
        if compressed and self._rule.first_compressed_update(t, self._state) == t:
            extra["momentum_mask"] = self._momentum_masks()  # for the frozen variance's report
        updates, state = self._rule.update(inputs, state, params, step=t, **extra)
        apply_updates(params, updates, donate=True)
        if compressed and not self.keeps_momentum_shards:  # it lives in the packed signs
            exp_avg = {k: None if inputs[k] is not None else m for k, m in state.exp_avg.items()}
            state = state._replace(exp_avg=exp_avg)
        self._state = state
        if records is not None or freezes_mask:
            self._zero_records = records
        return loss

    def _shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every param, by FQN."""
        return {slot.name: _local(slot.param) for x in self._layouts for slot in x.slots}

    def _gradient_delivered(self, param: torch.Tensor) -> None:
        del param
        self._delivered = True

    def _momentum_shards(self, reduced: Mapping[str, bool]) -> dict[str, torch.Tensor | None]:
        """Every param's shard of its module's new momentum, read exactly from the packed signs
        (``None`` for the params of a module whose reduce-scatter did not run for this update:
        ``reduced``, by module)."""
        shards: dict[str, torch.Tensor | None] = {}
        for layout in self._layouts:
            held = self._compressed[layout.name]
            row = None
            if reduced[layout.name]:
                rank = slice(self.rank, self.rank + 1)
                signs = PackedSigns(held.signs.packed[rank], held.signs.scales[rank])
                row = signs.values(layout.padded_row)
                row = self._masked_row(layout, row)
            for slot in layout.slots:
                local = _local(slot.param)
                piece = None if row is None else row[slot.offset : slot.offset + local.numel()]
                shards[slot.name] = None if piece is None else piece.view(local.shape)
        return shards

    def _observed_zeros(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """``exp_avg_mask="auto"``'s records after a warmup update whose mean gradient shards
        are ``grads``: each ANDed with the bits of this rank's row of ``X`` where the mean
        gradient is exactly 0 (``-|g| >= 0``, ``-0.0`` included, as ``fn.onebit_adam``'s
        record). Padding positions hold 0, so they stay 1; a param without a gradient keeps
        its bits (as a leaf without one keeps its record)."""
        records = {}
        for layout in self._layouts:
            record = self._zero_records[layout.name]
            row = _row(layout, grads, record.device)
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

    def _set_masks(
        self, masks: dict[str, torch.Tensor | None], records: dict[str, torch.Tensor] | None
    ) -> None:
        """Sets the masks and ``exp_avg_mask="auto"``'s records. With one rank, where no
        reduce-scatter runs, the rule itself multiplies the momentum by the masks, so it is
        built anew with them."""
        self._masks, self._zero_records = masks, records
        if self.comm.world_size == 1:
            self._rule = self._single_rank_rule(
                self._settings, self.error_dtype, self._momentum_masks()
            )

    def _momentum_masks(self) -> dict[str, torch.Tensor | None] | None:
        """Every param's shard of its mask (0. or 1., shaped like the shard; ``None`` for a
        module without a mask), by FQN; ``None`` when no module has a mask."""
        if all(mask is None for mask in self._masks.values()):
            return None
        masks = {}
        for layout in self._layouts:
            shards = {slot.name: _local(slot.param) for slot in layout.slots}
            mask = self._masks[layout.name]
            masks.update(
                dict.fromkeys(shards) if mask is None else self._shard_masks(layout, shards, mask)
            )
        return masks

    def _shard_masks(
        self, layout: ModuleLayout, shards: dict[str, torch.Tensor], mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """This rank's values (0. or 1.) of a module's mask (bits in the layout of ``X``),
        shaped like its ``shards``, by param."""
        values = {}
        for slot in layout.slots:
            shard = shards[slot.name]
            start = self.rank * layout.padded_row + slot.offset
            values[slot.name] = _mask_values(mask, start, shard.numel()).view(shard.shape)
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
        return row * _mask_values(mask, self.rank * layout.padded_row, layout.padded_row)

    def _checked_energy(self, grads: dict[str, torch.Tensor | None]) -> torch.Tensor | None:
        """Raises ``NonFiniteError`` on every rank if some rank's gradient shard is not
        finite; with ``freeze_step="auto"`` (and several ranks) returns the gradient energy of
        the mean gradient, the sum of the shards' (``fn.transforms.gradient_energy``), else
        ``None``. One all-gather of two fp64 values, summed in rank order (the same bits on
        every rank)."""
        bad = sum(int(not bool(g.isfinite().all())) for g in grads.values() if g is not None)
        measure = self._automatic and self.comm.world_size > 1
        energy = (
            gradient_energy(grads) if measure and not bad else torch.zeros((), dtype=torch.float64)
        )
        mine = torch.stack([torch.tensor(float(bad), dtype=torch.float64), energy])
        if self.comm.world_size > 1:
            mine = self.comm.all_gather(mine).view(-1, 2).sum(0)
        if mine[0] > 0:
            raise NonFiniteError(
                f"{self.name}: non-finite values in the averaged gradient (on some rank); "
                "nothing was updated"
            )
        return mine[1] if measure else None

    def _reduce_scatter(
        self,
        layout: ModuleLayout,
        output: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
    ) -> None:
        """The reduce-scatter of one module (:class:`OnebitReduceScatter`)."""
        comm = self._comms(group)
        world_size = comm.world_size
        if input_tensor.numel() != world_size * layout.row:  # FSDP2 left a param out
            raise RuntimeError(
                f"{self.name}: module {layout.name} reduce-scatters "
                f"{input_tensor.numel()} values, not the {world_size * layout.row} of all its "
                "trainable params, though every one is asked for "
                "(set_reduce_scatter_unused_params); nothing was updated"
            )
        rows = input_tensor.view(world_size, layout.row)
        if not self._rule.is_compressed(self.count + 1, self._state):
            output.copy_(_dense_reduce_scatter(comm, rows, op))
            return
        held = self._compressed[layout.name]
        if held.pending:
            raise RuntimeError(
                f"{self.name}: module {layout.name} was reduce-scattered twice before "
                "step() in the compressed phase (its momentum takes one gradient an update); "
                "accumulate gradients with set_requires_gradient_sync(False); nothing was "
                "updated"
            )
        momentum = self._previous_momentum(layout, held, comm, input_tensor.device)
        if layout.padded_row == layout.row and input_tensor.dtype == torch.float32:
            grad = input_tensor.view(-1)
        else:
            grad = torch.zeros_like(momentum)
            grad.view(world_size, layout.padded_row)[:, : layout.row] = rows
        if held.errors is None:
            held.errors = tuple(
                init_error_feedback(
                    momentum.numel(), comm=comm, device=momentum.device, dtype=self.error_dtype
                )
            )
        x, grad, beta = self._momentum_input(layout, held, comm, momentum, grad)
        try:
            held.signs = self._compressed_mean(held, comm, x, grad, beta)
        except NonFiniteError:  # raised on every rank, before anything was written
            raise NonFiniteError(
                f"{self.name}: non-finite values in the momentum of some rank (its local "
                f"gradient) in module {layout.name}; no param changed (the modules "
                "reduce-scattered before it in this backward have advanced their momentum "
                "and errors)"
            ) from None
        held.pending = True
        rank = slice(self.rank, self.rank + 1)
        mine = PackedSigns(held.signs.packed[rank], held.signs.scales[rank])
        shard = mine.values(layout.row).mul_(reduce_scale(op, world_size))
        output.copy_(shard)

    def _previous_momentum(
        self, layout: ModuleLayout, held: _Compressed, comm: ProcessGroup, device: torch.device
    ) -> torch.Tensor:
        """The module's momentum before this update, flat in the layout of ``X``, zero at its
        padding positions: unpacked from its signs, or at the freeze all-gathered from the
        shards' warmup momentum."""
        world_size = comm.world_size
        if held.signs is None:
            return comm.all_gather(_row(layout, self._state.exp_avg, device)).view(-1)
        momentum = held.signs.values(world_size * layout.padded_row).clone()
        for start, stop in layout.padding(world_size):
            momentum[start:stop] = 0.0
        mask = self._masks[layout.name]
        if mask is not None:  # the rule's momentum: the allreduce's result times the mask
            momentum.mul_(_mask_values(mask, 0, momentum.numel()))
        return momentum

    def _compressed_mean(
        self,
        held: _Compressed,
        comm: ProcessGroup,
        x: torch.Tensor,
        grad: torch.Tensor | None,
        beta: float,
    ) -> PackedSigns:
        """The 1-bit allreduce of a module's compressed vector (``beta x + (1 - beta) grad``
        with ``grad``, else ``x``), its errors written into ``held`` after every rank's check:
        the in-place exchange for fp32 and bf16 errors, the allocating collective (which
        rounds the fp16 errors once) for fp16 ones.

        Raises:
            fn.NonFiniteError: on every rank, with nothing written.
        """
        if self.error_dtype == torch.float16:
            if grad is not None:  # rounded as the rule's moving average
                x = (beta * x).add_((1 - beta) * grad)
            mean, *errors = compressed_allreduce(x, *held.errors, comm=comm, packed=True)
            held.errors = tuple(errors)
            return mean
        exchange = compressed_allreduce_exchange(x, *held.errors, comm=comm, grad=grad, beta=beta)
        if exchange is None:  # not on this path's tensors (e.g. under torch.compile)
            raise NotImplementedError(
                f"{self.name}: the 1-bit exchange runs eagerly on contiguous fp32 tensors"
            )
        write_errors(exchange, *held.errors)
        return PackedSigns(exchange.packed, exchange.scales)

    def _momentum_input(
        self,
        layout: ModuleLayout,
        held: _Compressed,
        comm: ProcessGroup,
        momentum: torch.Tensor,
        grad: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """What a module compresses, from its momentum before this update
        (:meth:`_previous_momentum`) and this rank's gradient, both flat in the layout of
        ``X``: ``(x, grad, beta)`` for :meth:`_compressed_mean`."""
        raise NotImplementedError

    def _make_rule(self, settings: dict[str, Any], comm: Any) -> CompressedOptimizer:
        """The rule on the shards, its norms (if any) over ``comm``."""
        raise NotImplementedError

    def _single_rank_rule(
        self,
        settings: dict[str, Any],
        error_dtype: torch.dtype,
        masks: dict[str, torch.Tensor | None] | None,
    ) -> CompressedOptimizer:
        """The rule with one rank (FSDP2 calls no reduce-scatter: nothing to compress), with
        ``masks`` (by FQN, shaped like the params) as its ``exp_avg_mask``."""
        raise NotImplementedError

    def _bad_settings(
        self, settings: dict[str, Any], error_dtype: torch.dtype
    ) -> tuple[type[Exception], str] | None:
        """The rule's own checks of the hyperparameters, as a problem."""
        try:
            check_error_dtype(self.name, error_dtype)
            self._make_rule(settings, Local())
        except (ValueError, TypeError, NotImplementedError) as error:
            return type(error), str(error)
        return None


class OnebitAdam(ShardedOnebitOptimizer):
    """1-bit Adam (``fn.onebit_adam``) over a model sharded by FSDP2 (``fully_shard``).

    A ``torch.optim.Optimizer`` over the model's trainable params (DTensor shards, one param
    group): it installs its own reduce-scatter on every FSDP2 module of ``model``
    (``set_custom_reduce_scatter``). Warmup updates (``t < freeze_step``) reduce-scatter the
    gradients densely and run Adam's warmup rule on the shards (``m`` and ``v`` sharded). At the
    freeze each module all-gathers its momentum shards once; from then on the reduce-scatter
    compresses the momentum ``b1 m + (1 - b1) g_r`` of this rank's local gradient with the
    error-compensated 1-bit allreduce (chunk ``j`` is rank ``j``'s shard), keeps the new
    momentum full size as packed signs (``n / 8`` bytes) and its errors (worker: full size,
    server: shard size), and ``step()`` applies the frozen-variance rule on the shards:

    .. math::
        u = \\mathrm{clip}(m / (\\sqrt{v} + \\epsilon), -B, B) + \\lambda p,\\quad
        p \\leftarrow p - \\eta u

    (``fn.transforms.onebit_adam_sharded``, the rule of ``fn.onebit_adam``). Where each buffer
    lives and the bytes sent: docs/algorithms.md, "1-bit Adam and 1-bit LAMB on FSDP2". The
    ranks' params stay identical (each rank steps its own shard).

    Construct it on every rank, after ``fully_shard``: it checks on every rank together that
    the model and the settings agree (a collective call). Checkpoints: its ``state_dict()``
    through :class:`~fn.fsdp.TrainingCheckpoint` (DCP), resumed bit for bit after any update.

    Args:
        model: the model, with ``fully_shard`` applied to it or its submodules, on one 1-D mesh;
            every trainable param must be in an FSDP2 module.
        lr, freeze_step, betas, eps, weight_decay, safeguard: as ``fn.onebit_adam``
            (``freeze_step="auto"`` too: each rank sends its shards' gradient energy with the
            finite check of every warmup update, and the ranks switch together). ``lr``
            is read from ``param_groups[0]["lr"]`` at every step (LR schedulers work); the
            others are fixed here.
        non_freeze: must be ``False`` (``NotImplementedError`` otherwise).
        exp_avg_mask: ``{param: mask}`` for some of the model's params (the DTensors), each a
            plain tensor of 0s and 1s broadcastable to the param's full shape, multiplied into
            the momentum after every compressed allreduce (as ``fn.onebit_adam``'s); kept as
            bits in each module's layout (``n / 8`` bytes per rank). Or ``"auto"``, as
            ``fn.onebit_adam``'s: the mask is 0 where the mean gradient was exactly 0 at every
            warmup update, 1 elsewhere, the same bits as that mask passed by hand. Each rank
            records its shard's zeros (``n / (8 W)`` bytes), and at the freeze every module
            all-gathers the records once (``(W - 1) n / (8 W)`` bytes sent per rank) into the
            mask. Other values and DTensor masks: ``NotImplementedError`` / ``TypeError``.
        nonfinite: ``"raise"`` (``"skip"``: ``NotImplementedError``).
        local_world_size: must be ``None`` (``NotImplementedError`` otherwise).
        error_dtype: the storage of the errors, ``torch.float32``, ``torch.bfloat16`` or
            ``torch.float16`` (as ``fn.onebit_adam``'s; fp16 errors take the allocating 1-bit
            allreduce, the others the in-place exchange).

    Raises:
        ValueError: on every rank: no FSDP2 module with trainable params, a trainable param
            outside every FSDP2 module, a module already driven by another fn.fsdp optimizer,
            settings that differ between ranks, or a bad hyperparameter.
        NotImplementedError: on every rank: HSDP or a 2-D mesh, or an option not built yet.

    Policies (README.md, "Policies"): nothing is raised inside FSDP2's backward; what a
    reduce-scatter finds is raised by the next ``step()``, on every rank, with no param
    changed, and the next backward and ``step()`` train normally. A non-finite gradient makes
    ``step()`` raise ``fn.NonFiniteError`` before any param or ``v`` changes (in the
    compressed phase the collective found it, and the module whose gradient held it kept its
    momentum and errors; the modules reduce-scattered before it in the same backward have
    advanced theirs). A param without a gradient, on one rank or all, counts as a zero
    gradient, as in ``fn.optim`` (FSDP2 reduce-scatters zeros for it:
    ``set_reduce_scatter_unused_params``), in both phases. A ``step()`` without a backward
    since the last one is a no-op. Gradient accumulation over several backwards of one
    compressed update must go through ``set_requires_gradient_sync(False)`` (a second
    reduce-scatter before ``step()`` makes it raise ``RuntimeError``). torch's
    ``get_state_dict`` / ``set_state_dict`` are refused (``NotImplementedError``) with nothing
    changed: checkpoints go through :class:`~fn.fsdp.TrainingCheckpoint`.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> import fn.fsdp
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(2, 1), mesh=init_device_mesh("cpu", (1,)))
        >>> opt = fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=2)
        >>> for _ in range(3):
        ...     opt.zero_grad()
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     opt.step()
        >>> opt.count
        3
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        freeze_step: int | str | AutoFreeze = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        non_freeze: bool = False,
        *,
        exp_avg_mask: Any = None,
        nonfinite: str = "raise",
        safeguard: bool = True,
        local_world_size: int | None = None,
        error_dtype: torch.dtype = torch.float32,
    ) -> None:
        settings = dict(
            lr=lr, freeze_step=freeze_step, betas=as_pair(betas), eps=eps,
            weight_decay=weight_decay, safeguard=safeguard,
        )  # fmt: skip
        super().__init__(
            model,
            settings,
            non_freeze=non_freeze,
            exp_avg_mask=exp_avg_mask,
            nonfinite=nonfinite,
            local_world_size=local_world_size,
            error_dtype=error_dtype,
        )

    def _make_rule(self, settings: dict[str, Any], comm: Any) -> CompressedOptimizer:
        del comm  # elementwise: nothing to sum over the shards
        return onebit_adam_sharded(**settings)

    def _single_rank_rule(
        self,
        settings: dict[str, Any],
        error_dtype: torch.dtype,
        masks: dict[str, torch.Tensor | None] | None,
    ) -> CompressedOptimizer:
        return onebit_adam(**settings, comm=Local(), error_dtype=error_dtype, exp_avg_mask=masks)

    def _momentum_input(
        self,
        layout: ModuleLayout,
        held: _Compressed,
        comm: ProcessGroup,
        momentum: torch.Tensor,
        grad: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """The momentum ``b1 m + (1 - b1) g_r`` (formed inside the exchange)."""
        return momentum, grad, self._b1


class ZeroOneAdam:
    """0/1 Adam on FSDP2: not offered (docs/algorithms.md, "1-bit Adam and 1-bit LAMB on
    FSDP2").

    Raises:
        NotImplementedError: always, with the reason.
    """

    def __init__(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        del model, args, kwargs
        raise NotImplementedError(
            "fn.fsdp.ZeroOneAdam: 0/1 Adam's local steps update every rank's full params from "
            "its own momentum between synchronizations, so the ranks' params differ by "
            "design, while FSDP2 keeps one copy of each element (a shard) and all-gathers it: "
            "there is no replica to step locally; use fn.optim.ZeroOneAdam with DDP, or "
            "fn.fsdp.OnebitAdam"
        )


def _not_torch_format(name: str) -> str:
    return (
        f"{name}: its state is not torch.optim's per-param form (the packed momentum and "
        "the error feedback belong to FSDP2 modules and ranks, not params), so "
        "torch.distributed.checkpoint.state_dict's get_state_dict / set_state_dict (and "
        "get_/set_optimizer_state_dict) cannot carry it; nothing was changed. Save and load "
        "with fn.fsdp.TrainingCheckpoint(model, optimizer).save(path) / .load(path), or "
        "dcp.save({'optim': optimizer.state_dict()}) and fn.fsdp.read_onebit_state"
    )


def _auto_scalars(auto: Any) -> dict[str, torch.Tensor]:
    """The 0-dim fields of a state's ``auto`` (``freeze_step="auto"``'s decision and
    statistics, the same on every rank), by name."""
    return {k: v for k, v in auto._asdict().items() if isinstance(v, torch.Tensor)}


def _fsdp2_stopped(module: nn.Module) -> bool:
    """Whether FSDP2's end-of-backward callback of ``module``'s root stayed queued after a
    backward, as after an exception inside one: FSDP2 then never queues it again, and stops
    reduce-scattering. torch has no public name for it; without the attribute: ``False``."""
    state = getattr(module, "_get_fsdp_state", lambda: None)()
    context = getattr(state, "_state_ctx", None)
    return bool(getattr(context, "post_backward_final_callback_queued", False))


def as_pair(betas: Any) -> Any:
    """``betas`` as a tuple when it is a sequence (a list and a tuple are the same setting);
    anything else as it is, for the rule's check to name."""
    is_sequence = isinstance(betas, Sequence) and not isinstance(betas, str)
    return tuple(betas) if is_sequence else betas


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def _shard_of(local: torch.Tensor, param: DTensor) -> DTensor:
    """``local`` (this rank's shard of a tensor like ``param``; empty: zeros) as a DTensor
    sharded as ``param``."""
    if local.numel() == 0:
        local = torch.zeros_like(_local(param), dtype=torch.float32)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


def _momentum_from_signs(
    layout: ModuleLayout, signs: PackedSigns, world_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """Every param's shard, at ``world_size`` and ``rank``, of a module's momentum packed in
    ``layout`` (that of the world size it was saved at), read exactly."""
    saved_world_size = signs.scales.numel()
    rows = signs.values(saved_world_size * layout.padded_row).view(saved_world_size, -1)
    shards = {}
    for slot, full in zip(layout.slots, _params_of_x(layout, rows), strict=True):
        dim = next(pl.dim for pl in slot.param.placements if isinstance(pl, Shard))
        mine = full.chunk(world_size, dim)
        shard = mine[rank] if rank < len(mine) else full.narrow(dim, 0, 0)
        shards[slot.name] = shard.contiguous()
    return shards


def _params_of_x(layout: ModuleLayout, rows: torch.Tensor) -> list[torch.Tensor]:
    """Every param of a module, full size, from ``rows``, its ``X`` (``[W, S']``) in
    ``layout`` (that of ``W`` ranks)."""
    params = []
    for slot in layout.slots:
        dim = next(pl.dim for pl in slot.param.placements if isinstance(pl, Shard))
        chunks = torch.empty(slot.param.shape, device="meta").chunk(rows.shape[0], dim)
        pieces = [
            rows[j, slot.offset : slot.offset + chunk.numel()].view(chunk.shape)
            for j, chunk in enumerate(chunks)
        ]
        params.append(torch.cat(pieces, dim))
    return params


def _relaid_mask(
    layout: ModuleLayout, bits: torch.Tensor, saved_world_size: int, world_size: int
) -> torch.Tensor:
    """``bits``, a module's mask (1: kept) in the layout of ``X`` for ``saved_world_size``
    ranks, in ``layout`` (for ``world_size`` ranks; padding positions 0). At the same world
    size it is ``bits``."""
    slots = [(s.name, s.param) for s in layout.slots]
    old = module_layout(layout.name, slots, saved_world_size)
    rows = kernels.unpackbits(bits, saved_world_size * old.padded_row)
    full = _params_of_x(old, rows.view(saved_world_size, -1))
    masks = {slot.param: x > 0 for slot, x in zip(layout.slots, full, strict=True)}
    return _module_mask(layout, masks, world_size)


def _row(
    layout: ModuleLayout, shards: Mapping[str, torch.Tensor | None], device: torch.device
) -> torch.Tensor:
    """This rank's row of ``X`` (fp32) holding its ``shards`` of the module's params (by
    FQN; ``None``: zeros), zero at the padding positions."""
    row = torch.zeros(layout.padded_row, device=device)
    for slot in layout.slots:
        x = shards[slot.name]
        if x is not None:
            row[slot.offset : slot.offset + x.numel()] = x.reshape(-1)
    return row


def _dense_reduce_scatter(comm: ProcessGroup, rows: torch.Tensor, op: Any) -> torch.Tensor:
    """``dist.reduce_scatter_tensor``'s result for ``op``: the sum of the ranks' rows (fn's
    ``ProcessGroup``), divided by ``W`` for ``AVG``, times ``f`` for ``PREMUL_SUM(f)``."""
    total = comm.reduce_scatter(rows, "sum")
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return total / comm.world_size
    if kind == dist.ReduceOp.PREMUL_SUM:
        return total * op.factor
    if kind == dist.ReduceOp.SUM:
        return total
    raise ValueError(f"op must be ReduceOp.AVG, SUM or PREMUL_SUM, got {kind}")


def _modules(model: nn.Module) -> list[tuple[str, list[tuple[str, DTensor]]]]:
    """The FSDP2 modules under ``model`` with trainable params: ``(fqn, [(param fqn, param)])``
    in FSDP2's order."""
    names = {id(p): n for n, p in model.named_parameters()}
    found = []
    for name, child in model.named_modules():
        if isinstance(child, FSDPModule):
            params = _fsdp_order(child)
            if params:
                found.append((name or ROOT, [(names[id(p)], p) for p in params]))
    return found


def _fsdp_order(module: FSDPModule) -> list[nn.Parameter]:
    """The trainable params of ``module``'s FSDP2 group in the order of its reduce-scatter:
    FSDP2 visits the modules depth first, a module after its children (nested FSDP2 modules
    left out), each module's own params in registration order."""
    order: list[nn.Parameter] = []
    seen: set[int] = set()

    def visit(m: nn.Module) -> None:
        if m is not module and isinstance(m, FSDPModule):
            return
        for child in m.children():
            visit(child)
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                order.append(p)

    visit(module)
    return [p for p in order if p.requires_grad]


def _one_dim(found: list[tuple[str, list[tuple[str, DTensor]]]]) -> bool:
    return all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 for _, ps in found for _, p in ps)


def _problem(
    model: nn.Module,
    found: list[tuple[str, list[tuple[str, DTensor]]]],
    non_freeze: bool,
    exp_avg_mask: Any,
    nonfinite: str,
    local_world_size: int | None,
) -> tuple[type[Exception], str] | None:
    """What this rank finds wrong with the model or the options, or ``None``."""
    if not found:
        return ValueError, "model has no FSDP2 module (fully_shard) with trainable params"
    inside = {id(p) for _, ps in found for _, p in ps}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        return ValueError, f"trainable params outside every FSDP2 module: {outside}"
    if not _one_dim(found):
        return NotImplementedError, (
            "HSDP and 2-D meshes are not supported: the 1-bit allreduce runs over one group, "
            "the params' 1-D shard mesh"
        )
    groups = {ps[0][1].device_mesh for _, ps in found}
    if len(groups) > 1:
        return NotImplementedError, "FSDP2 modules on different meshes are not supported"
    taken = [name for name, module in model.named_modules() if module in _INSTALLED]
    if taken:
        return ValueError, f"the FSDP2 modules {taken} already have an fn.fsdp optimizer"
    unsupported = {
        "non_freeze": (non_freeze, "one module's vector would mix dense and compressed params"),
        "nonfinite='skip'": (
            nonfinite == "skip",
            "the modules reduce-scattered before a non-finite one have already advanced",
        ),
        "local_world_size": (
            local_world_size is not None,
            "the hierarchical collective hands a rank another chunk than its FSDP2 shard",
        ),
    }
    for name, (used, why) in unsupported.items():
        if used:
            return NotImplementedError, f"{name} is not supported yet on FSDP2: {why}"
    if nonfinite != "raise":
        return ValueError, f"nonfinite must be 'raise', got {nonfinite!r}"
    return _mask_problem(found, exp_avg_mask)


def _mask_problem(
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


def _mask_checksum(exp_avg_mask: Mapping[Any, torch.Tensor] | None, order: list[Any]) -> int:
    """CRC-32 of the masks' values, broadcast to their params' shapes, in ``order`` (0: none)."""
    if not exp_avg_mask:
        return 0
    crc = 0
    for param in order:
        mask = exp_avg_mask.get(param)
        if mask is not None:
            full = mask.to("cpu", torch.float32).broadcast_to(param.shape).contiguous()
            crc = zlib.crc32(
                full.numpy().tobytes(), zlib.crc32(repr(tuple(param.shape)).encode(), crc)
            )
    return crc


def _module_mask(
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


def _mask_values(bits: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """``count`` values (0. or 1.) of a mask in bits, from position ``start``."""
    skip = start % 8
    piece = bits[start // 8 : (start + count + 7) // 8]
    return (kernels.unpackbits(piece, skip + count)[skip:] > 0).to(torch.float32)
