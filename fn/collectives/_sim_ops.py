"""The ``Simulated`` collectives as ``torch.library`` custom ops with cross-rank vmap rules.

Every op takes the per-rank payload ``x`` and ``rank``, a tensor that ``simulate`` batches over
the rank axis (it holds ``arange(W)``). The vmap rule runs once per vmap level the op sees:

- at the rank level (``rank`` is batched there) the rule sees every rank's ``x`` stacked on
  dim 0 and performs the collective across that dim, counting one rank's bytes;
- at any other level (a user ``vmap`` inside ``simulate``; ``rank`` is not batched there) the
  rule moves that batch dim into the payload and calls the op again, so each element of the
  inner batch is communicated independently, as one larger message would be by a real backend.

Called without the rank level (outside ``simulate``) the ops raise.
"""

from __future__ import annotations

import torch

from fn.collectives import _traffic

# comm_id -> the Simulated comm whose simulate() is running; the rules count bytes into it.
_ACTIVE: dict[int, object] = {}


def _outside(name: str) -> RuntimeError:
    return RuntimeError(
        f"Simulated.{name} was called outside fn.collectives.simulate(f, comm): a simulated "
        "collective only exists across the rank axis that simulate() adds"
    )


def _stack_ranks(x: torch.Tensor, x_dim: int | None, world_size: int) -> torch.Tensor:
    if x_dim is None:  # every rank holds the same value
        return x.unsqueeze(0).expand(world_size, *x.shape)
    return x.movedim(x_dim, 0)


def _count(comm_id: int, kind: str, stacked: torch.Tensor) -> None:
    comm = _ACTIVE[comm_id]
    comm._count(kind, _traffic.payload_bytes(stacked[0]), stacked.shape[0])


def _reduce(stacked: torch.Tensor, op: str) -> torch.Tensor:
    total = stacked.sum(0)
    return total / stacked.shape[0] if op == "mean" else total


@torch.library.custom_op("fn::sim_all_reduce", mutates_args=())
def sim_all_reduce(x: torch.Tensor, rank: torch.Tensor, comm_id: int, op: str) -> torch.Tensor:
    raise _outside("all_reduce")


@sim_all_reduce.register_fake
def _(x, rank, comm_id, op):
    return torch.empty_like(x)


@sim_all_reduce.register_vmap
def _(info, in_dims, x, rank, comm_id, op):
    x_dim, rank_dim = in_dims[0], in_dims[1]
    if rank_dim is None:
        return sim_all_reduce(x.movedim(x_dim, 0), rank, comm_id, op), 0
    stacked = _stack_ranks(x, x_dim, info.batch_size)
    _count(comm_id, "all_reduce", stacked)
    return _reduce(stacked, op), None


@torch.library.custom_op("fn::sim_all_gather", mutates_args=())
def sim_all_gather(x: torch.Tensor, rank: torch.Tensor, comm_id: int) -> torch.Tensor:
    raise _outside("all_gather")


@sim_all_gather.register_fake
def _(x, rank, comm_id):
    return x.new_empty(_ACTIVE[comm_id].world_size, *x.shape)


@sim_all_gather.register_vmap
def _(info, in_dims, x, rank, comm_id):
    x_dim, rank_dim = in_dims[0], in_dims[1]
    if rank_dim is None:
        return sim_all_gather(x.movedim(x_dim, 0), rank, comm_id), 1
    stacked = _stack_ranks(x, x_dim, info.batch_size)
    _count(comm_id, "all_gather", stacked)
    return stacked.contiguous(), None


@torch.library.custom_op("fn::sim_all_to_all", mutates_args=())
def sim_all_to_all(x: torch.Tensor, rank: torch.Tensor, comm_id: int) -> torch.Tensor:
    raise _outside("all_to_all")


@sim_all_to_all.register_fake
def _(x, rank, comm_id):
    return torch.empty_like(x)


@sim_all_to_all.register_vmap
def _(info, in_dims, x, rank, comm_id):
    x_dim, rank_dim = in_dims[0], in_dims[1]
    if rank_dim is None:
        return sim_all_to_all(x.movedim(x_dim, 1), rank, comm_id), 1
    stacked = _stack_ranks(x, x_dim, info.batch_size)  # [source, destination, *chunk]
    _count(comm_id, "all_to_all", stacked)
    return stacked.transpose(0, 1).contiguous(), 0


@torch.library.custom_op("fn::sim_reduce_scatter", mutates_args=())
def sim_reduce_scatter(x: torch.Tensor, rank: torch.Tensor, comm_id: int, op: str) -> torch.Tensor:
    raise _outside("reduce_scatter")


@sim_reduce_scatter.register_fake
def _(x, rank, comm_id, op):
    return x.new_empty(x.shape[1:])


@sim_reduce_scatter.register_vmap
def _(info, in_dims, x, rank, comm_id, op):
    x_dim, rank_dim = in_dims[0], in_dims[1]
    if rank_dim is None:
        return sim_reduce_scatter(x.movedim(x_dim, 1), rank, comm_id, op), 0
    stacked = _stack_ranks(x, x_dim, info.batch_size)  # [source, destination, *chunk]
    _count(comm_id, "reduce_scatter", stacked)
    return _reduce(stacked, op), 0
