"""The DCP state format of the 1-bit optimizers on FSDP2, as functions of what they read
(:class:`StateFormat`: the modules, the mesh, the rule's fields) and the rule's state: one layout
at every update (DCP loads in place into a layout fixed before it reads), a header of the format,
world size, update count and checksums of the model's layout and the settings, checked before
anything changes; loaded on the same mesh shape bit for bit, on another with the momentum laid
out anew and the error feedback reset (docs/algorithms.md, "1-bit Adam and 1-bit LAMB on
FSDP2"). :func:`onebit_state_dict` writes it, :func:`checkpoint_template` lays out what DCP
reads it into, :func:`restored` reads it back and :func:`adam_started` starts from Adam's."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from fn.collectives import PackedSigns, local_shard
from fn.collectives.agreement import digest
from fn.collectives.dcp import PER_RANK, own_entries, rank_key
from fn.collectives.dtensor import rows_of_ranks
from fn.fsdp.onebit_layout import (
    ModuleLayout,
    canonical_name,
    layout_at,
    momentum_from_signs,
    shard_of,
)
from fn.fsdp.onebit_masks import masked_shards, relaid_mask
from fn.fsdp.onebit_mesh import ShardMesh
from fn.fsdp.onebit_module import OnebitModule

__all__ = [
    "Restored",
    "StateFormat",
    "adam_started",
    "auto_scalars",
    "checkpoint_template",
    "fingerprints",
    "not_torch_format",
    "onebit_state_dict",
    "restored",
]

_FORMAT = 2  # the layout of ShardedOnebitOptimizer.state_dict() (1: errors under "rank<r>")
_AUTO_MASK_KEYS = ("always_zero", "exp_avg_mask")  # and with exp_avg_mask="auto"


class StateFormat(NamedTuple):
    """What the state format reads of a :class:`~fn.fsdp.ShardedOnebitOptimizer`.

    Attributes:
        name: the optimizer, which starts the messages.
        modules: its FSDP2 modules' state, in FSDP2's order.
        mesh: its mesh (``fn/fsdp/onebit_mesh.py``).
        error_dtype: the errors' dtype.
        auto_mask: whether ``exp_avg_mask="auto"``.
        fingerprints: the checksums of the model's layout and of the settings
            (:func:`fingerprints`).
        rank: this rank in the optimizer's world, which names its own entries (its errors:
            ``per_rank["rank<r>"]``, fn/collectives/dcp.py).
        scalar_fields: the rule's further per-param 0-dim fields (the same on every rank).
        optional_fields: the rule's further per-param shards, maybe ``None``.
        keeps_momentum_shards: whether the compressed phase keeps the momentum's shards in the
            rule's state (else only the packed signs hold it).
    """

    name: str
    modules: Sequence[OnebitModule]
    mesh: ShardMesh
    error_dtype: torch.dtype
    auto_mask: bool
    fingerprints: tuple[int, int]
    rank: int
    scalar_fields: tuple[str, ...]
    optional_fields: tuple[str, ...]
    keeps_momentum_shards: bool


class Restored(NamedTuple):
    """A state read back by :func:`restored`, in this mesh's layout.

    Attributes:
        state: the rule's state.
        momenta: by module, its packed signs and errors (``None``: before the freeze, or
            restarted).
        masks: by module, its mask and ``exp_avg_mask="auto"``'s record.
        warning: what the load restarted, to warn of, or ``None``.
    """

    state: Any
    momenta: list[tuple[PackedSigns | None, tuple[torch.Tensor, torch.Tensor] | None]]
    masks: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    warning: str | None


def fingerprints(
    layouts: Sequence[ModuleLayout], settings: Mapping[str, Any], error_dtype: torch.dtype,
    mask_setting: Any,
) -> tuple[int, int]:  # fmt: skip
    """The digests of the model's layout (its modules, params and shapes) and of the settings
    (``settings``: the rule's, not ``lr``; ``mask_setting``: ``"auto"``, the masks' checksum,
    or ``0``), which a checkpoint's header holds."""
    masks = (mask_setting,) if mask_setting else ()  # (older ones had none)
    return layout_digest(layouts), digest(repr((dict(settings), str(error_dtype), *masks)))


def layout_digest(layouts: Sequence[ModuleLayout], as_wrapped: bool = False) -> int:
    """The digest of the model's modules, params and shapes, by their names (``as_wrapped``:
    by their FQNs in the model, wrappers' segments included, as checkpoints before canonical
    names held it)."""

    def named(layout: ModuleLayout, name: str) -> str:
        return dict(layout.wrapped).get(name, name) if as_wrapped else name

    return digest(
        repr([
            (named(x, x.name), [(named(x, s.name), tuple(s.param.shape)) for s in x.slots])
            for x in layouts
        ])
    )  # fmt: skip


def _renamed(tree: Any, rename: Callable[[str], str]) -> Any:
    """A nest of dicts with every key renamed (the leaves kept)."""
    if not isinstance(tree, Mapping):
        return tree
    return {rename(k) if isinstance(k, str) else k: _renamed(v, rename) for k, v in tree.items()}


def onebit_state_dict(fmt: StateFormat, state: Any, lr: float) -> dict[str, Any]:
    """The state dict of :meth:`~fn.fsdp.ShardedOnebitOptimizer.state_dict` (its docstring
    lays it out), of the rule's ``state`` and the learning rate ``lr``."""
    slots = [slot for module in fmt.modules for slot in module.layout.slots]
    out: dict[str, Any] = {
        "header": torch.tensor(
            [_FORMAT, fmt.mesh.shape[0], int(state.count), *fmt.fingerprints, *fmt.mesh.header],
            dtype=torch.int64,
        ),  # fmt: skip
        "lr": torch.tensor(float(lr), dtype=torch.float64),
        "signed": torch.tensor([m.signed for m in fmt.modules], dtype=torch.int8),
        "exp_avg": {},
        "exp_avg_sq": {},
        "momentum": {
            m.layout.name: fmt.mesh.momentum_state(m.layout, m.signs) for m in fmt.modules
        },
        PER_RANK: {
            rank_key(fmt.rank): {m.layout.name: _errors(m, fmt.error_dtype) for m in fmt.modules}
        },
    }
    for slot in slots:
        m = state.exp_avg[slot.name]
        out["exp_avg"][slot.name] = shard_of(m if m is not None else torch.zeros(0), slot.param)
        out["exp_avg_sq"][slot.name] = shard_of(state.exp_avg_sq[slot.name], slot.param)
    if state.auto is not None:
        out["auto"] = auto_scalars(state.auto)
    if fmt.auto_mask:
        out.update(_auto_mask_state(fmt))
    for field in fmt.scalar_fields:
        out[field] = {slot.name: getattr(state, field)[slot.name] for slot in slots}
    for field in fmt.optional_fields:
        values = [getattr(state, field)[slot.name] for slot in slots]
        out[f"{field}_held"] = torch.tensor([x is not None for x in values], dtype=torch.int8)
        out[field] = {
            slot.name: shard_of(torch.zeros(0) if x is None else x, slot.param)
            for slot, x in zip(slots, values, strict=True)
        }
    return out


def _errors(module: OnebitModule, error_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A module's errors as a checkpoint holds them (zeros before its first compressed update)."""
    worker, server = module.errors or module.zero_errors(error_dtype)
    return {"worker": worker, "server": server}


def checkpoint_template(
    fmt: StateFormat, state: Any, header: torch.Tensor, saved: Mapping[str, torch.Size]
) -> dict[str, Any]:
    """The state dict that DCP loads a checkpoint of :func:`onebit_state_dict` into: new
    tensors laid out as saved (this rank's errors only if the mesh shape is the same).

    Args:
        fmt: what the format reads of the optimizer.
        state: the rule's state.
        header: the checkpoint's ``header`` (loaded first).
        saved: the checkpoint's optimizer keys, flat (``"exp_avg.block.weight"``), and their
            sizes (from the checkpoint's metadata).

    Returns:
        A dict of the form of :func:`onebit_state_dict`, to pass to ``dcp.load``.

    Raises:
        ValueError: the header does not match this model or these settings, or a key is
            missing (nothing was loaded).
    """
    saved = {canonical_name(key): size for key, size in saved.items()}
    auto_saved = any(key.startswith("always_zero.") for key in saved)
    *mesh, _, as_wrapped = _checked_header(fmt, header, auto_saved)
    same = fmt.mesh.shape == tuple(mesh)

    def new(key: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(saved.get(key, ()), dtype=dtype)

    fields = ("exp_avg", "exp_avg_sq", *fmt.optional_fields)
    template: dict[str, Any] = {
        "header": header.clone(),
        "lr": new("lr", torch.float64),
        "signed": new("signed", torch.int8),
        **{f: {} for f in (*fields, *fmt.scalar_fields)},
        "momentum": {},
    }
    for module in fmt.modules:
        name = module.layout.name
        mine = fmt.mesh.momentum_template(module.layout) if same else None
        template["momentum"][name] = mine or {
            k: new(f"momentum.{name}.{k}", dtype)
            for k, dtype in (("packed", torch.uint8), ("scales", torch.float32))
        }  # all of it: saved whole on every rank, or the rows of another mesh
        for slot in module.layout.slots:
            for field in fields:
                template[field][slot.name] = shard_of(torch.zeros(0), slot.param)
            for field in fmt.scalar_fields:
                template[field][slot.name] = new(f"{field}.{slot.name}", torch.float32)
    for field in fmt.optional_fields:
        template[f"{field}_held"] = new(f"{field}_held", torch.int8)
    if state.auto is not None:
        template["auto"] = {k: v.clone() for k, v in auto_scalars(state.auto).items()}
    names = [m.layout.name for m in fmt.modules]
    if fmt.auto_mask:  # the records as a whole (on another mesh too)
        for f in _AUTO_MASK_KEYS:
            template[f] = {x: new(f"{f}.{x}", torch.uint8) for x in names}
    if same:
        own = f"{PER_RANK}.{rank_key(fmt.rank)}"
        template[PER_RANK] = {
            rank_key(fmt.rank): {
                x: {k: new(f"{own}.{x}.{k}", fmt.error_dtype) for k in ("worker", "server")}
                for x in names
            }
        }
    missing = [key for key in _keys(template) if key not in saved]
    if missing:
        raise ValueError(f"{fmt.name}: the checkpoint has no {missing[:4]}; nothing was loaded")
    if as_wrapped:
        wrapped = dict(pair for module in fmt.modules for pair in module.layout.wrapped)
        return _renamed(template, lambda key: wrapped.get(key, key))
    return template


def _keys(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of the tensors of a nest of dicts, as DCP names them."""
    keys = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        keys += _keys(value, f"{name}.") if isinstance(value, Mapping) else [name]
    return keys


def restored(fmt: StateFormat, state_dict: Mapping[str, Any], state: Any, rule: Any) -> Restored:
    """A state dict of :func:`onebit_state_dict` (as it or :func:`checkpoint_template` lays it
    out) read back into this mesh's layout: saved on this mesh shape, exactly; saved on another
    one, ``v`` and the shards' momentum read back exactly, the error feedback restarted from
    zero (with a warning: :attr:`Restored.warning`).

    Args:
        fmt: what the format reads of the optimizer.
        state_dict: the state dict.
        state: the rule's current state (its form).
        rule: the rule (its ``is_compressed``).

    Returns:
        The state, the modules' momenta and masks.

    Raises:
        ValueError: the checkpoint is of another model or other settings.
        NotImplementedError: ``state_dict`` is in ``torch.optim``'s per-param form (as
            ``torch.distributed.checkpoint.state_dict.set_state_dict`` passes it).
    """
    if "header" not in state_dict:
        raise NotImplementedError(not_torch_format(fmt.name))
    state_dict = _renamed(state_dict, canonical_name)  # (older checkpoints: wrappers' names)
    auto_saved = "always_zero" in state_dict
    world_size, replicas, count, _ = _checked_header(fmt, state_dict["header"], auto_saved)
    same = fmt.mesh.shape == (world_size, replicas)
    signed = [bool(x) for x in state_dict["signed"].tolist()]
    if len(signed) != len(fmt.modules):
        raise ValueError(f"{fmt.name}: corrupt checkpoint: signed = {signed}")
    auto = state.auto
    if auto is not None:
        auto = auto._replace(**{k: state_dict["auto"][k].clone() for k in auto_scalars(auto)})
    saved_layouts = [layout_at(m.layout, world_size, replicas) for m in fmt.modules]
    masks = [(m.mask, m.record) for m in fmt.modules]
    if fmt.auto_mask:
        frozen = rule.is_compressed(count, state._replace(auto=auto))
        masks = _loaded_auto_masks(fmt, state_dict, saved_layouts, frozen)
    own = _own_errors(fmt, state_dict) if same else {}
    exp_avg, exp_avg_sq, momenta = {}, {}, []
    for module, old, packed, (mask, _) in zip(fmt.modules, saved_layouts, signed, masks,
                                               strict=True):  # fmt: skip
        name, signs, errors = module.layout.name, None, None
        for slot in module.layout.slots:
            exp_avg_sq[slot.name] = local_shard(state_dict["exp_avg_sq"][slot.name]).clone()
            m = local_shard(state_dict["exp_avg"][slot.name]).clone()
            exp_avg[slot.name] = None if packed and not fmt.keeps_momentum_shards else m
        if packed:
            signs = _loaded_signs(state_dict["momentum"][name])
            if same:
                errors = (own[name]["worker"].clone(), own[name]["server"].clone())
            else:  # the shards' momentum, in this mesh's layout
                if not fmt.keeps_momentum_shards:  # (else DCP resharded exp_avg)
                    world = module.mesh.shard.world_size
                    shards = momentum_from_signs(old, signs, world, module.rank)
                    exp_avg.update(masked_shards(module.layout, module.rank, shards, mask))
                signs = None
        momenta.append((signs, errors))
    warning = None
    if not same and any(signed):
        warning = (
            f"{fmt.name}: checkpoint saved on {_mesh(world_size, replicas)}, loaded on "
            f"{_mesh(*fmt.mesh.shape)}: the error feedback restarts from zero (the momentum is "
            "kept)"
        )
    new = state._replace(
        count=torch.tensor(count, dtype=torch.int64),
        lr=torch.tensor(float(state_dict["lr"]), dtype=torch.float32),
        exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq,
        auto=auto,
        **_loaded_fields(fmt, state_dict),
    )
    return Restored(new, momenta, masks, warning)


def _own_errors(fmt: StateFormat, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """This rank's entries of a state dict saved on this mesh shape (its errors, by module).

    Raises:
        ValueError: the state dict holds another rank's entries, not this rank's: a
            ``state_dict()`` saved on one rank and loaded on all (its shards and errors are that
            rank's).
    """
    own = own_entries(state_dict, fmt.rank)
    if own is None:
        held = sorted(state_dict.get(PER_RANK, {}))
        raise ValueError(
            f"{fmt.name}: the state dict holds the entries of {held or 'no rank'}, not of this "
            f"rank ({rank_key(fmt.rank)}): a state_dict() is its rank's shards and error "
            "feedback, so every rank loads the one it saved itself (or save and load with DCP: "
            "fn.fsdp.TrainingCheckpoint); nothing was loaded"
        )
    return own


def adam_started(
    fmt: StateFormat,
    state: Any,
    count: int,
    exp_avg: Mapping[torch.Tensor, torch.Tensor],
    exp_avg_sq: Mapping[torch.Tensor, torch.Tensor],
) -> Any:
    """The rule's ``state`` with Adam's moments (by param) and update count: see
    :meth:`~fn.fsdp.ShardedOnebitOptimizer.load_adam_state`.

    Raises:
        ValueError, NotImplementedError: as ``load_adam_state``; nothing was changed.
    """
    if fmt.auto_mask:
        raise NotImplementedError(
            f'{fmt.name}: a start from Adam\'s state with exp_avg_mask="auto" is not built: the '
            "mask is decided from the warmup's zero gradients, which Adam did not record; pass "
            "the mask by hand, or none; nothing was changed"
        )
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"{fmt.name}: count must be an int >= 0, got {count!r}")
    moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for field, given in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        current = getattr(state, field)
        for slot in (slot for module in fmt.modules for slot in module.layout.slots):
            local = _adam_moment(fmt.name, field, slot, given.get(slot.param))
            moments[field][slot.name] = local.to(dtype=current[slot.name].dtype, copy=True)
    return state._replace(count=torch.tensor(count, dtype=torch.int64), **moments)


def _adam_moment(name: str, field: str, slot: Any, value: torch.Tensor | None) -> torch.Tensor:
    """This rank's shard of Adam's ``field`` of a param, checked."""
    if value is None:
        raise ValueError(f"{name}: no {field} for param {slot.name}; nothing was changed")
    local, shard = local_shard(value), local_shard(slot.param)
    if local.shape != shard.shape:
        raise ValueError(
            f"{name}: {field} of {slot.name} has the shard shape {tuple(local.shape)}, the "
            f"param's is {tuple(shard.shape)}; nothing was changed"
        )
    negative = field == "exp_avg_sq" and bool((local < 0).any())
    if not bool(local.isfinite().all()) or negative:
        bad = "negative or non-finite" if field == "exp_avg_sq" else "non-finite"
        raise ValueError(f"{name}: {bad} values in {field} of {slot.name}; nothing was changed")
    return local


def _loaded_fields(fmt: StateFormat, state_dict: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The rule's further per-param fields from a state dict, by field and FQN (its
    ``scalar_fields``, and its ``optional_fields`` with ``None`` where not held)."""
    names = [slot.name for module in fmt.modules for slot in module.layout.slots]
    extra = {f: {k: state_dict[f][k].clone() for k in names} for f in fmt.scalar_fields}
    for field in fmt.optional_fields:
        held_by = [bool(x) for x in state_dict[f"{field}_held"].tolist()]
        values = [local_shard(state_dict[field][k]).clone() for k in names]
        extra[field] = {
            k: x if kept else None for k, x, kept in zip(names, values, held_by, strict=True)
        }
    return extra


def _loaded_signs(saved: Mapping[str, torch.Tensor]) -> PackedSigns:
    """A module's packed momentum from its checkpoint form (or, from another mesh, all of it:
    one chunk per scale)."""
    packed, scales = local_shard(saved["packed"]).clone(), local_shard(saved["scales"]).clone()
    return PackedSigns(packed.view(scales.numel(), -1), scales)


def _auto_mask_state(fmt: StateFormat) -> dict[str, dict[str, Any]]:
    """``exp_avg_mask="auto"``'s part of the state dict, by module: ``always_zero``, the
    records (a DTensor of the ranks' rows: each rank saves its own; zeros after the freeze),
    and ``exp_avg_mask``, the masks (the same on every rank; zeros before the freeze), both
    bits in the layout of ``X``."""
    world_size = fmt.mesh.shape[0]
    records, masks = {}, {}
    for module in fmt.modules:
        layout = module.layout
        param, size = layout.slots[0].param, layout.padded_row // 8
        record = module.record
        if record is None:
            record = torch.zeros(size, dtype=torch.uint8, device=param.device)
        records[layout.name] = rows_of_ranks(record, param)
        mask = module.mask
        if mask is None:
            mask = torch.zeros(world_size * size, dtype=torch.uint8, device=param.device)
        masks[layout.name] = mask
    return {"always_zero": records, "exp_avg_mask": masks}


def _loaded_auto_masks(
    fmt: StateFormat,
    state_dict: Mapping[str, Any],
    saved_layouts: Sequence[ModuleLayout],
    frozen: bool,
) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """``exp_avg_mask="auto"``'s mask and record of every module from a state dict saved in
    ``saved_layouts`` (the modules' layouts on the mesh it was saved on), in this mesh's
    layout: after the freeze (``frozen``) the masks, before it the records."""
    out = []
    for module, old in zip(fmt.modules, saved_layouts, strict=True):
        layout = module.layout
        if frozen:
            out.append((relaid_mask(layout, state_dict["exp_avg_mask"][old.name], old), None))
            continue
        saved = state_dict["always_zero"][layout.name]
        if isinstance(saved, DTensor):  # dcp.load into state_dict(): this rank's own row
            out.append((None, saved.to_local().clone()))
            continue
        seen = relaid_mask(layout, saved.bitwise_not(), old)
        size = layout.padded_row // 8
        out.append((None, seen[module.rank * size : (module.rank + 1) * size].bitwise_not()))
    return out


def _checked_header(
    fmt: StateFormat, header: torch.Tensor, auto_saved: bool
) -> tuple[int, int, int, bool]:
    """The checkpoint's shard world size, replicas (``N``; ``1`` for a 1-D mesh), update count
    and whether it names the params as the model does, wrappers' segments included (saved
    before canonical names), or ``ValueError`` if it is not a checkpoint of this model and these
    settings (``auto_saved``: whether it holds ``exp_avg_mask="auto"``'s records)."""
    values = header.tolist()
    if len(values) not in (5, 6) or values[0] != _FORMAT:
        raise ValueError(
            f"{fmt.name}: not a checkpoint of this format (header {values}: format "
            f"{values[0] if values else None}, this fn reads {_FORMAT}); nothing was loaded"
        )
    _, world_size, count, layout, settings, *hsdp = values
    replicas = hsdp[0] if hsdp else 1
    layouts = [module.layout for module in fmt.modules]
    as_wrapped = (
        layout != fmt.fingerprints[0]
        and any(x.wrapped for x in layouts)
        and layout == layout_digest(layouts, as_wrapped=True)
    )
    if layout != fmt.fingerprints[0] and not as_wrapped:
        raise ValueError(
            f"{fmt.name}: the checkpoint is of another model (its FSDP2 modules, params or "
            "shapes differ); nothing was loaded"
        )
    if auto_saved != fmt.auto_mask:
        made, here = ("", "not ") if auto_saved else ("not ", "")
        raise ValueError(
            f'{fmt.name}: the checkpoint was saved with exp_avg_mask {made}"auto", this '
            f"optimizer's is {here}\"auto\" (the records of the warmup's zero gradients are in "
            "the state); build the optimizer as the checkpoint's was; nothing was loaded"
        )
    if settings != fmt.fingerprints[1]:
        raise ValueError(
            f"{fmt.name}: the checkpoint was saved with other settings (its hyperparameters, "
            "exp_avg_mask or error_dtype); nothing was loaded"
        )
    if world_size < 1 or replicas < 1 or count < 0:
        raise ValueError(f"{fmt.name}: corrupt checkpoint header {values}")
    return world_size, replicas, count, as_wrapped


def _mesh(world_size: int, replicas: int) -> str:
    if replicas == 1:
        return f"world size {world_size}"
    return f"an HSDP mesh of {replicas} x {world_size} ranks (replicate x shard)"


def not_torch_format(name: str) -> str:
    """Why the optimizer ``name`` refuses ``torch.distributed.checkpoint.state_dict``'s API."""
    return (
        f"{name}: its state is not torch.optim's per-param form (the packed momentum and "
        "the error feedback belong to FSDP2 modules and ranks, not params), so "
        "torch.distributed.checkpoint.state_dict's get_state_dict / set_state_dict (and "
        "get_/set_optimizer_state_dict) cannot carry it; nothing was changed. Save and load "
        "with fn.fsdp.TrainingCheckpoint(model, optimizer).save(path) / .load(path), or "
        "dcp.save({'optim': optimizer.state_dict()}) and fn.fsdp.read_onebit_state"
    )


def auto_scalars(auto: Any) -> dict[str, torch.Tensor]:
    """The 0-dim fields of a state's ``auto`` (``freeze_step="auto"``'s decision and
    statistics, the same on every rank), by name."""
    return {k: v for k, v in auto._asdict().items() if isinstance(v, torch.Tensor)}
