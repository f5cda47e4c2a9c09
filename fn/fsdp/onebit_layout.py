"""The layout of an FSDP2 module's compressed vector ``X`` under the 1-bit optimizers.

``X`` has ``W`` rows, row ``j`` rank ``j``'s reduce-scatter shard: each param's slot in every
row (FSDP2's dim-0 padding included), then zeros up to a multiple of ``lcm(W, 8)`` values, so
that chunk ``j`` of ``fn.collectives.compressed_allreduce`` is rank ``j``'s shard. Here too: the
FSDP2 modules of a model in FSDP2's order, and the moves between ``X``, full params and shards
(docs/algorithms.md, "1-bit Adam and 1-bit LAMB on FSDP2").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from fn.collectives import PackedSigns, as_sharded_like, local_shard
from fn.fsdp._fsdp2 import group_members
from fn.fsdp.loco import ROOT

__all__ = [
    "ModuleLayout",
    "ParamSlot",
    "canonical_name",
    "names_problem",
    "fsdp_groups",
    "fsdp_modules",
    "fsdp_order",
    "layout_at",
    "module_layout",
    "momentum_from_signs",
    "one_dim",
    "params_of_x",
    "row_multiple",
    "row_of",
    "shard_of",
]


# The segments that module wrappers add to FQNs: activation checkpointing's (torch's
# checkpoint_wrapper, which torchtitan's selective and full modes apply) and torch.compile's.
# The 1-bit optimizers' state names params and modules without them, so that a job resumed with
# activation checkpointing or compilation turned on or off reads its checkpoint.
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def canonical_name(fqn: str) -> str:
    """``fqn`` without the segments that module wrappers add (activation checkpointing's
    ``_checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod``).

    Example:
        >>> canonical_name("layers.0._checkpoint_wrapped_module.attention.wq.weight")
        'layers.0.attention.wq.weight'
    """
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_SEGMENTS)


def names_problem(found: list[tuple[str, list[tuple[str, DTensor]]]]) -> tuple[type, str] | None:
    """Two FSDP2 modules, or two params, whose names differ only by wrappers' segments (they
    would share one key of the optimizer's state), as ``(ValueError, message)``; or ``None``.

    Args:
        found: the FSDP2 modules and their params (:func:`fsdp_modules`).

    Returns:
        The problem, or ``None``.

    Example:
        >>> names_problem([("a", []), ("_orig_mod.a", [])])
        (<class 'ValueError'>, "the names 'a' and '_orig_mod.a' are one name ...")
    """
    modules, params = [m for m, _ in found], [fqn for _, ps in found for fqn, _ in ps]
    for names in (modules, params):
        first: dict[str, str] = {}
        for name in names:
            other = first.setdefault(canonical_name(name), name)
            if other != name:
                return ValueError, (
                    f"the names {other!r} and {name!r} are one name once wrappers' segments "
                    f"({', '.join(sorted(_WRAPPER_SEGMENTS))}) are left out, the key the "
                    "optimizer's state is saved under: rename one of the modules"
                )
    return None


class ParamSlot(NamedTuple):
    """Where one param sits in its module's compressed vector ``X`` (``[W, S']``)."""

    name: str  # the param's FQN in the model, without wrappers' segments (canonical_name)
    param: DTensor
    offset: int  # its first value in every row
    width: int  # its values per row, padding included (numel / W after dim-0 padding)
    real: tuple[int, ...]  # per rank j: how many of row j's ``width`` values are its elements


class ModuleLayout(NamedTuple):
    """One FSDP2 module's compressed vector: ``W`` rows of ``padded_row`` values, of which the
    first ``row`` are FSDP2's reduce-scatter row and the rest zeros."""

    name: str  # the module's FQN ("<root>" for the model itself), as ParamSlot.name
    slots: tuple[ParamSlot, ...]  # its params in FSDP2's order
    row: int  # S: FSDP2's row
    padded_row: int  # S': S rounded up to a multiple of lcm(W, 8) (on HSDP: of N lcm(N, 8))
    world_size: int  # W: the ranks of the shard group, one row each
    # (name, FQN in the model) of the module and params whose FQN has wrappers' segments: how
    # checkpoints before canonical names named them
    wrapped: tuple[tuple[str, str], ...] = ()

    def row_padding(self, j: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges of row ``j`` that hold no element of a param."""
        ranges = []
        for slot in self.slots:
            if slot.real[j] < slot.width:
                ranges.append((slot.offset + slot.real[j], slot.offset + slot.width))
        if self.padded_row > self.row:
            ranges.append((self.row, self.padded_row))
        return ranges


def module_layout(
    name: str, params: list[tuple[str, DTensor]], world_size: int, multiple: int | None = None
) -> ModuleLayout:
    """The layout of ``X`` for a module's params (FQN and sharded param, in FSDP2's order), its
    rows padded to a multiple of ``multiple`` values (default ``lcm(W, 8)``, the 1-bit
    allreduce over the ``W`` ranks of the shard group; on HSDP ``N lcm(N, 8)``, that over the
    ``N`` replicas of a row: :func:`row_multiple`)."""
    slots, offset = [], 0
    wrapped = [(canonical_name(n), n) for n in (name, *(fqn for fqn, _ in params))]
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
        slots.append(ParamSlot(canonical_name(fqn), p, offset, width, real))
        offset += width
    unit = math.lcm(world_size, 8) if multiple is None else multiple
    padded = -(-offset // unit) * unit
    wrapped = tuple((short, full) for short, full in wrapped if short != full)
    return ModuleLayout(canonical_name(name), tuple(slots), offset, padded, world_size, wrapped)


def layout_at(layout: ModuleLayout, world_size: int, replicas: int = 1) -> ModuleLayout:
    """``layout``'s module laid out for a shard group of ``world_size`` ranks and ``replicas``
    nodes (``1``: a 1-D mesh), as a checkpoint saved on that mesh holds it."""
    params = [(slot.name, slot.param) for slot in layout.slots]
    multiple = row_multiple(replicas) if replicas > 1 else None
    return module_layout(layout.name, params, world_size, multiple)._replace(wrapped=layout.wrapped)


def row_multiple(replicas: int) -> int:
    """What a row of ``X`` is padded to on HSDP with ``replicas`` nodes (``N``): ``N lcm(N,
    8)``, so that the flat 1-bit allreduce among the ``N`` ranks of the replicate group adds no
    padding of its own (``fn.collectives.padded_numel(S', N) == S'``) and cuts the row into
    ``N`` byte-aligned chunks."""
    return replicas * math.lcm(replicas, 8)


def shard_of(local: torch.Tensor, param: DTensor) -> DTensor:
    """``local`` (this rank's shard of a tensor like ``param``; empty: zeros) as a DTensor
    sharded as ``param``."""
    if local.numel() == 0:
        local = torch.zeros_like(local_shard(param), dtype=torch.float32)
    return as_sharded_like(local, param)


def row_of(
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


def params_of_x(layout: ModuleLayout, rows: torch.Tensor) -> list[torch.Tensor]:
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


def momentum_from_signs(
    layout: ModuleLayout, signs: PackedSigns, world_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """Every param's shard, at ``world_size`` and ``rank``, of a module's momentum packed in
    ``layout`` (that of the mesh it was saved on: one chunk per rank, or on HSDP ``N`` per
    row, each with its scale), read exactly."""
    rows = signs.values(layout.world_size * layout.padded_row).view(layout.world_size, -1)
    shards = {}
    for slot, full in zip(layout.slots, params_of_x(layout, rows), strict=True):
        dim = next(pl.dim for pl in slot.param.placements if isinstance(pl, Shard))
        mine = full.chunk(world_size, dim)
        shard = mine[rank] if rank < len(mine) else full.narrow(dim, 0, 0)
        shards[slot.name] = shard.contiguous()
    return shards


def fsdp_modules(model: nn.Module) -> list[tuple[str, list[tuple[str, DTensor]]]]:
    """The FSDP2 groups under ``model`` with trainable params: ``(name, [(param fqn, param)])``
    in FSDP2's order (:func:`fsdp_groups`)."""
    return [(name, params) for name, _, params in fsdp_groups(model)]


def fsdp_groups(model: nn.Module) -> list[tuple[str, nn.Module, list[tuple[str, DTensor]]]]:
    """The FSDP2 groups under ``model`` with trainable params, in ``named_modules()`` order:
    ``(name, member, [(param fqn, param)])``. A group is what one ``fully_shard`` call made,
    one module or several (``fully_shard([a, b])``, whose members share one reduce-scatter);
    its name is its module's FQN (``"<root>"`` for the model itself), for several the members'
    FQNs joined by ``"+"``; ``member`` is its first member (its settings are the group's);
    the params are in the order of its reduce-scatter."""
    names = {id(p): n for n, p in model.named_parameters()}
    module_names = {id(m): n or ROOT for n, m in model.named_modules()}
    found, seen = [], set()
    for child in model.modules():
        if not isinstance(child, FSDPModule):
            continue
        members = group_members(child)
        if id(members[0]) in seen:
            continue
        seen.add(id(members[0]))
        params = fsdp_order(members)
        if params:
            name = "+".join(module_names[id(m)] for m in members)
            found.append((name, members[0], [(names[id(p)], p) for p in params]))
    return found


def fsdp_order(members: tuple[nn.Module, ...]) -> list[nn.Parameter]:
    """The trainable params of an FSDP2 group (its ``members``) in the order of its
    reduce-scatter: FSDP2 visits each member in turn depth first, a module after its children
    (nested FSDP2 modules and modules visited already left out), each module's own params in
    registration order, each param once."""
    order: list[nn.Parameter] = []
    seen: set[int] = set()
    visited: set[int] = set()

    def visit(m: nn.Module) -> None:
        if m not in members and isinstance(m, FSDPModule):
            return
        visited.add(id(m))
        for child in m.children():
            if id(child) not in visited:
                visit(child)
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                order.append(p)

    for member in members:
        visit(member)
    return [p for p in order if p.requires_grad]


def one_dim(found: list[tuple[str, list[tuple[str, DTensor]]]]) -> bool:
    return all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 for _, ps in found for _, p in ps)
