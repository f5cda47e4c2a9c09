"""The ``Simulated`` collectives as ``torch.library`` custom ops with cross-rank vmap rules.

Every op takes the per-rank payload ``x``, ``rank`` (a tensor that ``simulate`` batches over the
rank axis; it holds ``arange(W)``) and the group layout: ``hop`` is ``WORLD`` (all ``W`` ranks),
``INTRA`` (the ``local_size`` consecutive ranks of a node) or ``INTER`` (the ranks with the same
local index on every node), ``group_size`` the ranks per group. The vmap rule runs once per vmap
level the op sees:

- at the rank level (``rank`` is batched there) the rule sees every rank's ``x`` stacked on
  dim 0, views it as ``[groups, group_size, ...]`` and performs the collective across dim 1;
- at any other level (a user ``vmap`` inside ``simulate``; ``rank`` is not batched there) the
  rule moves that batch dim into the payload and calls the op again, so each element of the
  inner batch is communicated independently, as one larger message would be by a real backend.

Called without the rank level (outside ``simulate``) the ops raise. Bytes are counted by the
calling comm method (plain Python, so ``torch.compile`` replays the count on every call).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fn.collectives.comm import HOPS

# the hop codes are the byte counter's level indices (``ByteCounter._count``)
WORLD, INTRA, INTER = (HOPS.index(hop) for hop in ("world", "intra", "inter"))


def outside_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"Simulated.{name} was called outside fn.collectives.simulate(f, comm): a simulated "
        "collective only exists across the rank axis that simulate() adds"
    )


def stack_ranks(x: torch.Tensor, x_dim: int | None, world_size: int) -> torch.Tensor:
    """``x`` batched at ``x_dim`` (``None``: unbatched) with its batch dim first, ``[W, ...]``."""
    if x_dim is None:  # every rank holds the same value
        return x.unsqueeze(0).expand(world_size, *x.shape)
    return x.movedim(x_dim, 0)


def _to_groups(stacked: torch.Tensor, local_size: int, hop: int) -> torch.Tensor:
    """``[W, ...]`` in rank order -> ``[groups, group_size, ...]``."""
    if hop == WORLD:
        return stacked.unsqueeze(0)
    grouped = stacked.reshape(-1, local_size, *stacked.shape[1:])  # [node, local, ...]
    return grouped if hop == INTRA else grouped.transpose(0, 1)


def _from_groups(grouped: torch.Tensor, hop: int) -> torch.Tensor:
    """Inverse of :func:`_to_groups`."""
    if hop == WORLD:
        return grouped[0]
    if hop == INTER:
        grouped = grouped.transpose(0, 1)
    return grouped.reshape(-1, *grouped.shape[2:])


def _reduce(grouped: torch.Tensor, op: str) -> torch.Tensor:
    total = grouped.sum(1)
    return total / grouped.shape[1] if op == "mean" else total


def _vmap_rule(
    op: torch.library.CustomOpDef, moved_to: int, out_dim: int
) -> Callable[[Callable[..., tuple[torch.Tensor, int | None]]], None]:
    """Registers ``op``'s vmap rule around ``across(grouped, hop, *options)``, the collective
    on every rank's payload as ``[groups, group_size, ...]`` (``options``: ``op``'s arguments
    before the group layout). At another level than the rank's, the rule moves that batch dim
    to dim ``moved_to`` of the payload and calls ``op`` again; its result has the batch dim at
    ``out_dim``."""

    def register(across: Callable[..., tuple[torch.Tensor, int | None]]) -> None:
        @op.register_vmap
        def _(info, in_dims, x, rank, *args):
            x_dim, rank_dim = in_dims[0], in_dims[1]
            if rank_dim is None:
                return op(x.movedim(x_dim, moved_to), rank, *args), out_dim
            *options, local_size, hop, _group_size = args
            grouped = _to_groups(stack_ranks(x, x_dim, info.batch_size), local_size, hop)
            return across(grouped, hop, *options)

    return register


def _simulated_op(
    kind: str, reduces: bool, fake: Callable[..., torch.Tensor]
) -> torch.library.CustomOpDef:
    """The op ``fn::sim_<kind>(x, rank[, op], local_size, hop, group_size)``, which exists only
    through its vmap rule (called without the rank level, it raises); ``fake(x, group_size)``
    gives its output's shape."""

    def outside(*args: object) -> torch.Tensor:
        raise outside_error(kind)

    payload = "Tensor x, Tensor rank, str op" if reduces else "Tensor x, Tensor rank"
    schema = f"({payload}, SymInt local_size, SymInt hop, SymInt group_size) -> Tensor"
    op = torch.library.custom_op(f"fn::sim_{kind}", outside, mutates_args=(), schema=schema)
    op.register_fake(lambda x, *args: fake(x, args[-1]))
    return op


sim_all_reduce = _simulated_op("all_reduce", True, lambda x, size: torch.empty_like(x))
sim_all_gather = _simulated_op("all_gather", False, lambda x, size: x.new_empty(size, *x.shape))
sim_all_to_all = _simulated_op("all_to_all", False, lambda x, size: torch.empty_like(x))
sim_reduce_scatter = _simulated_op("reduce_scatter", True, lambda x, size: x.new_empty(x.shape[1:]))


@_vmap_rule(sim_all_reduce, moved_to=0, out_dim=0)
def _(grouped, hop, op):
    if hop == WORLD:  # the same value on every rank
        return _reduce(grouped, op)[0], None
    reduced = _reduce(grouped, op).unsqueeze(1).expand_as(grouped)
    return _from_groups(reduced, hop), 0


@_vmap_rule(sim_all_gather, moved_to=0, out_dim=1)
def _(grouped, hop):
    if hop == WORLD:  # the same value on every rank
        return grouped[0].contiguous(), None
    groups, size = grouped.shape[:2]
    gathered = grouped.unsqueeze(1).expand(groups, size, *grouped.shape[1:])
    return _from_groups(gathered, hop), 0


@_vmap_rule(sim_all_to_all, moved_to=1, out_dim=1)
def _(grouped, hop):
    # [groups, source, destination, *chunk]
    return _from_groups(grouped.transpose(1, 2), hop).contiguous(), 0


@_vmap_rule(sim_reduce_scatter, moved_to=1, out_dim=0)
def _(grouped, hop, op):
    # [groups, source, destination, *chunk]
    return _from_groups(_reduce(grouped, op), hop), 0
