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

import torch

WORLD, INTRA, INTER = 0, 1, 2


def outside_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"Simulated.{name} was called outside fn.collectives.simulate(f, comm): a simulated "
        "collective only exists across the rank axis that simulate() adds"
    )


def _stack_ranks(x: torch.Tensor, x_dim: int | None, world_size: int) -> torch.Tensor:
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


@torch.library.custom_op("fn::sim_all_reduce", mutates_args=())
def sim_all_reduce(
    x: torch.Tensor, rank: torch.Tensor, op: str, local_size: int, hop: int, group_size: int
) -> torch.Tensor:
    raise outside_error("all_reduce")


@sim_all_reduce.register_fake
def _(x, rank, op, local_size, hop, group_size):
    return torch.empty_like(x)


@sim_all_reduce.register_vmap
def _(info, in_dims, x, rank, op, local_size, hop, group_size):
    x_dim, rank_dim = in_dims[0], in_dims[1]
    if rank_dim is None:
        return sim_all_reduce(x.movedim(x_dim, 0), rank, op, local_size, hop, group_size), 0
    grouped = _to_groups(_stack_ranks(x, x_dim, info.batch_size), local_size, hop)
    if hop == WORLD:  # the same value on every rank
        return _reduce(grouped, op)[0], None
    reduced = _reduce(grouped, op).unsqueeze(1).expand_as(grouped)
    return _from_groups(reduced, hop), 0


@torch.library.custom_op("fn::sim_all_gather", mutates_args=())
def sim_all_gather(
    x: torch.Tensor, rank: torch.Tensor, local_size: int, hop: int, group_size: int
) -> torch.Tensor:
    raise outside_error("all_gather")


@sim_all_gather.register_fake
def _(x, rank, local_size, hop, group_size):
    return x.new_empty(group_size, *x.shape)


@sim_all_gather.register_vmap
def _(info, in_dims, x, rank, local_size, hop, group_size):
    x_dim, rank_dim = in_dims[0], in_dims[1]
    if rank_dim is None:
        return sim_all_gather(x.movedim(x_dim, 0), rank, local_size, hop, group_size), 1
    grouped = _to_groups(_stack_ranks(x, x_dim, info.batch_size), local_size, hop)
    if hop == WORLD:  # the same value on every rank
        return grouped[0].contiguous(), None
    groups, size = grouped.shape[:2]
    gathered = grouped.unsqueeze(1).expand(groups, size, *grouped.shape[1:])
    return _from_groups(gathered, hop), 0


@torch.library.custom_op("fn::sim_all_to_all", mutates_args=())
def sim_all_to_all(
    x: torch.Tensor, rank: torch.Tensor, local_size: int, hop: int, group_size: int
) -> torch.Tensor:
    raise outside_error("all_to_all")


@sim_all_to_all.register_fake
def _(x, rank, local_size, hop, group_size):
    return torch.empty_like(x)


@sim_all_to_all.register_vmap
def _(info, in_dims, x, rank, local_size, hop, group_size):
    x_dim, rank_dim = in_dims[0], in_dims[1]
    if rank_dim is None:
        return sim_all_to_all(x.movedim(x_dim, 1), rank, local_size, hop, group_size), 1
    # [groups, source, destination, *chunk]
    grouped = _to_groups(_stack_ranks(x, x_dim, info.batch_size), local_size, hop)
    return _from_groups(grouped.transpose(1, 2), hop).contiguous(), 0


@torch.library.custom_op("fn::sim_reduce_scatter", mutates_args=())
def sim_reduce_scatter(
    x: torch.Tensor, rank: torch.Tensor, op: str, local_size: int, hop: int, group_size: int
) -> torch.Tensor:
    raise outside_error("reduce_scatter")


@sim_reduce_scatter.register_fake
def _(x, rank, op, local_size, hop, group_size):
    return x.new_empty(x.shape[1:])


@sim_reduce_scatter.register_vmap
def _(info, in_dims, x, rank, op, local_size, hop, group_size):
    x_dim, rank_dim = in_dims[0], in_dims[1]
    if rank_dim is None:
        return sim_reduce_scatter(x.movedim(x_dim, 1), rank, op, local_size, hop, group_size), 0
    # [groups, source, destination, *chunk]
    grouped = _to_groups(_stack_ranks(x, x_dim, info.batch_size), local_size, hop)
    return _from_groups(_reduce(grouped, op), hop), 0
