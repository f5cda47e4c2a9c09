"""``topk_allreduce(exchange="owner")``: the top-k messages reduced on owners, so that each rank
moves about two messages' bytes whatever the number of ranks.

The chunks of the live leaves (``c`` of them) are partitioned over the ``W`` ranks: rank ``j``
owns chunks ``j m`` to ``(j + 1) m - 1``, ``m = ceil(c / W)`` (the last owners' shares padded
with empty chunks). Each rank compresses as in the all-gather exchange (chunk-wise top-k in 2
bits, its error feedback ``e``), sends each owner that owner's chunks of its message (one
all_to_all), each owner adds the ``W`` decoded pieces in rank order and divides by ``W``,
compresses the mean again (keeping ``server_k`` values per chunk) with a server error feedback
``e_s`` of its own, and the owners' messages are all-gathered. DeepSpeed's compressed allreduce
does the same for 1-bit signs (Tang et al. 2021, arXiv:2102.02888); gTop-k and Ok-Topk (PPoPP
2022) for sparse values.
docs/algorithms.md, "DiLoCo: local steps and a compressed outer step", gives the rule and its
bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fn.collectives._topk_code import (
    NON_FINITE,
    WHAT,
    Layout,
    Sparse,
    compress,
    dense,
    exchange_checksum,
    finished,
    flattened,
    mean_of,
    padded,
    select,
    size_checked,
    valid_positions,
)
from fn.collectives.comm import Comm
from fn.collectives.error_feedback import ErrorFeedbackField, ParamShapedErrorFeedbackField
from fn.collectives.header import (
    Compressor,
    Exchanged,
    Opened,
    exchange_rows,
    flag_of,
    headers_only,
)
from fn.collectives.participation import Participation
from fn.errors import finite_or_raise
from fn.tree import tree_leaves, tree_map, tree_unflatten

__all__ = ["TopkOwnerState", "owner_form"]


class TopkOwnerState(NamedTuple):
    """The state of ``topk_allreduce(exchange="owner")`` on one rank.

    Attributes:
        error: per leaf, fp32 of the leaf's shape: what this rank has not sent yet (as
            :class:`~fn.collectives.TopkAllreduceState`'s).
        server_error: fp32 ``[ceil(c / W) * chunk_size]``: what this rank, as an owner, has not
            sent of the mean of the chunks it owns (``c`` the chunks of the live leaves); zero
            in the chunks' padding.

    Example:
        >>> tx = fn.collectives.topk_allreduce(2, 8, comm=fn.collectives.Simulated(2),
        ...                                    exchange="owner")
        >>> state = tx.init({"w": torch.zeros(20)})  # 3 chunks of 8: 2 per owner
        >>> state.error["w"].shape, state.server_error.shape
        (torch.Size([20]), torch.Size([16]))
    """

    error: ParamShapedErrorFeedbackField
    server_error: ErrorFeedbackField


def _share(chunks: int, world_size: int, server_error: torch.Tensor, chunk_size: int) -> int:
    """The chunks each owner holds (``ceil(chunks / W)``), once ``server_error`` is an owner's
    of that many."""
    share = -(-chunks // world_size)
    if server_error.shape != (share * chunk_size,):
        raise ValueError(
            f"{WHAT}: the server error has shape {tuple(server_error.shape)}, the "
            f"owner of {share} chunk(s) of {chunk_size} needs ({share * chunk_size},) "
            "(a state from init on these leaves and ranks)"
        )
    return share


def _server_step(
    got: Opened, layout: Layout, server_error: torch.Tensor, call: tuple, part: Participation
) -> tuple[Sparse, torch.Tensor]:
    """The owner's part: the mean of its chunks over the ranks that take part (zero in their
    padding) plus its server error, compressed to ``server_k`` values a chunk; the new server
    error. ``call``: the leaves, the positions of the live ones, ``server_k``, ``chunk_size``
    and ``W``."""
    leaves, live, server_k, chunk_size, world_size = call
    share = layout.chunks
    if live:
        valid = valid_positions(leaves, live, chunk_size, world_size * share)
        mine = torch.index_select(valid.view(world_size, -1), 0, got.slot.view(1))
        valid = mine.view(share, chunk_size)
    else:
        valid = torch.zeros(share, chunk_size, dtype=torch.bool)
    mean = mean_of(got.payload, layout, chunk_size, world_size, part)
    s = torch.where(valid, mean, 0.0) + server_error.view(share, chunk_size)
    server = select(s, server_k)
    return server, torch.where(valid, s - dense(server, chunk_size), 0.0).view(-1)


def owner_form(k: int, chunk_size: int, comm: Comm, decay: float, server_k: int) -> Compressor:
    """``topk_allreduce``'s owner-partitioned exchange (module docstring); the settings are
    checked by the caller."""

    def init_fn(params):
        # zero error feedback, a worker's per leaf and an owner's of ceil(c / W) chunks
        live = [x for x in tree_leaves(params) if x is not None and x.numel() > 0]
        chunks = sum(-(-x.numel() // chunk_size) for x in live)
        share = -(-chunks // comm.world_size)
        device = live[0].device if live else None
        return TopkOwnerState(
            tree_map(lambda p: torch.zeros(p.shape, dtype=torch.float32, device=p.device), params),
            torch.zeros(share * chunk_size, dtype=torch.float32, device=device),
        )

    def exchange_fn(updates, state, flag=None, params=None, *, extra=()):
        del params
        world_size = comm.world_size
        leaves, spec, errors, live = flattened(updates, state)
        if not live:
            return headers_only(comm, updates, state, flag, WHAT, extra)
        offered = flag_of(flag)
        worked = compress(leaves, errors, live, k, chunk_size, decay, offered)
        share = _share(worked.mine.scales.numel(), world_size, state.server_error, chunk_size)
        flag = offered & torch.isfinite(worked.mine.scales).all()
        n = sum(leaves[i].numel() for i in live)
        checksum = exchange_checksum(leaves, live, k, chunk_size, server_k)
        layout, server_layout = Layout(share, k, chunk_size), Layout(share, server_k, chunk_size)
        rows = layout.encode(padded(worked.mine, world_size * share), rows=world_size)
        rows = torch.where(flag, rows, 0)
        got, part = exchange_rows(comm, rows, flag, n, WHAT, checksum, to_each=True, extra=extra)
        server, server_error = _server_step(
            got, layout, state.server_error, (leaves, live, server_k, chunk_size, world_size), part
        )
        server_flag = torch.isfinite(server.scales).all()
        message = torch.where(server_flag, server_layout.encode(server), 0)
        slices, _ = exchange_rows(comm, message, server_flag, n, WHAT, checksum)
        result = torch.cat(
            [dense(server_layout.decode(slices.payload[r]), chunk_size) for r in range(world_size)]
        )
        out, new_errors = finished(worked, flag, result, leaves, errors, live, chunk_size)
        new_state = TopkOwnerState(
            tree_unflatten(new_errors, spec),
            torch.where(server_flag, server_error, state.server_error),
        )
        # an owner's non-finite result (an overflow) spoils every worker's: none took part
        participants = got.flags & slices.flags.all()
        return Exchanged(tree_unflatten(out, spec), new_state, participants, got.extra)

    def update_fn(updates, state, params=None, *, participation=None, **extra):
        del params, extra
        leaves, _, _, live = flattened(updates, state)
        if not live:
            return updates, state
        # the size record first, in a collective of its own: the messages' sizes depend on it
        taking = torch.ones((), dtype=torch.bool, device=leaves[live[0]].device)
        if participation is not None:
            taking = participation.takes_part
        flag = size_checked(comm, taking, leaves, live, k, chunk_size)
        out, new_state, participants, _ = exchange_fn(updates, state, flag)
        # a rank that takes part but whose flag came back unset is not finite: every rank
        # sees the count fall short
        expected = comm.world_size if participation is None else participation.count
        finite_or_raise(torch.where(participants.sum() == expected, 0.0, torch.nan), NON_FINITE)
        return out, new_state

    return Compressor(init_fn, update_fn, exchange_fn)
