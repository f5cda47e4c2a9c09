"""Blockwise-quantized allreduce (ZeRO++ qgZ) with optional LoCo error feedback.

Quantization (``fn.kernels.quantize``): symmetric, per group of ``group_size`` values, ``b`` in
{4, 8} bits, scale ``absmax / 2^(b-1)``, ``Q(v) = clamp(round(v / scale), -2^(b-1), 2^(b-1)-1)``,
``DQ(q) = q * scale``; the scales travel as fp32 next to the packed values. The allreduce is a
quantized reduce-scatter (one hop, or inside each node and then across nodes: rank ``(node,
local)`` then holds chunk ``local * (W / L) + node``) and a quantized all-gather; it returns the
true MEAN over the ``W`` ranks. Every call starts with the ranks' size records
(``fn.collectives._sizes``). LoCo keeps one error buffer per quantization (per hop of the
reduce-scatter and one for the all-gather), reset to zero every ``reset_T`` updates:

.. math::
    v = x + e, \\quad q = Q(v), \\quad e' = \\beta e + (1 - \\beta) (v - DQ(q))

docs/algorithms.md, "Quantized allreduce with LoCo error feedback", describes the phases, the
fused in-place paths and the point-to-point one.

References:
    Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
    Training", 2023 (arXiv:2306.10209), qgZ.
    Xie et al., "LoCo: Low-Bit Communication Adaptor for Large-scale Model Training", 2024
    (arXiv:2407.04480).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import torch

from fn import kernels
from fn.base import EmptyState, donated_state, donating
from fn.collectives import _sizes
from fn.collectives._fusion_barrier import fusion_barrier
from fn.collectives.comm import Comm
from fn.collectives.error_feedback import ErrorFeedbackField
from fn.collectives.header import (
    Compressor,
    Exchanged,
    alone,
    exchange_rows,
    flag_of,
    gathered,
)
from fn.collectives.participation import Participation, kept, participants_mean, sent
from fn.collectives.process_group import ProcessGroup
from fn.errors import NonFiniteError, check_closed_fraction, check_int, finite_or_raise
from fn.tree import eager, fitting, tree_flatten, tree_map, tree_unflatten

__all__ = [
    "quantized_padded_numel",
    "quantized_reduce_scatter",
    "quantized_reduce_scatter_into",
    "quantized_all_gather_into",
    "quantized_allreduce",
    "QuantizedError",
    "LocoAllreduceState",
    "loco_allreduce",
]

_T = TypeVar("_T")
_WHAT = "quantized allreduce"
_NON_FINITE = f"{_WHAT}: non-finite values in x (or in the error feedback)"


def quantized_padded_numel(numel: int, world_size: int, group_size: int) -> int:
    """``numel`` rounded up to a multiple of ``W * group_size``: every chunk is whole groups.

    Args:
        numel: the number of elements.
        world_size: ``W``.
        group_size: the values per quantization group.

    Returns:
        The padded element count.

    Example:
        >>> fn.collectives.quantized_padded_numel(300, 2, 128)
        512
    """
    unit = world_size * group_size
    return -(-numel // unit) * unit


class _Plan(NamedTuple):
    world: Comm
    hops: tuple[Comm, ...]  # the reduce-scatter hops: (world,) or (intra, inter)
    local_world_size: int | None
    bits: int
    group_size: int


def _plan(comm: Comm, bits: int, group_size: int, local_world_size: int | None) -> _Plan:
    kernels.check_quant_args(bits, group_size)
    hops = (comm,) if local_world_size is None else comm.split(local_world_size)
    return _Plan(comm, tuple(hops), local_world_size, bits, group_size)


def _quantize(v: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
    # A group with a non-finite value has a non-finite scale (or the kernel refuses it). Then
    # this rank sends all-NaN scales, so every peer that receives from it (directly, or through
    # a poisoned partial sum) raises at the check after the last hop: nobody is left waiting
    # for a rank that raised.
    try:
        q, scales = kernels.quantize(v, plan.bits, plan.group_size)
    except NonFiniteError:
        q = v.new_zeros(v.numel() * plan.bits // 8, dtype=torch.uint8)
        return q, v.new_full((v.numel() // plan.group_size,), torch.nan)
    return q, torch.where(torch.isfinite(scales).all(), scales, torch.nan)


def _feedback(
    v: torch.Tensor, error: torch.Tensor | None, plan: _Plan, err_beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantizes ``v + error``; returns ``(q, scales, e')`` with LoCo's ``e'`` (or ``None``)."""
    if error is None:
        return *_quantize(v, plan), None
    v = v + error
    q, scales = _quantize(v, plan)
    dq = kernels.dequantize(q, scales, plan.bits, v.numel())  # fp32
    if v.dtype != dq.dtype:  # an fp64 error buffer: the residual keeps its precision
        return q, scales, err_beta * error + (1 - err_beta) * (v - dq)
    # v - dq, then beta e + (1 - beta) r, in place on the fresh temporaries: the same rounding,
    # two full-size allocations fewer (~40% of this function's time on CPU at 2^24).
    residual = dq.neg_().add_(v)
    return q, scales, residual.mul_(1 - err_beta).add_(err_beta * error)


def _exchange_hop(
    plan: _Plan, index: int, q: torch.Tensor, scales: torch.Tensor, n: int, checksum: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hop ``index`` of the reduce-scatter: sends chunk ``r`` of the codes and of the scales to
    rank ``r`` of the hop, in one message; returns the received codes and scales, flat, the
    pieces in the hop's rank order. The first hop's chunks go once every rank's size record
    matched this call's: the records go first, every rank's to every rank, in a message whose
    size does not depend on ``n`` (an all_to_all, as the chunks). The last hop's scales are
    checked finite on every rank."""
    if index == 0:
        # the settings that size the chunks too: ranks that differ raise before any chunk moves
        checksum = _sizes.layout_checksum([(-1, checksum), (-2, plan.bits), (-3, plan.group_size)])
        mine = _sizes.with_count(scales.new_empty(plan.world.world_size, 0), n, checksum)
        scales = _sizes.released(scales, plan.world.all_to_all(mine), n, _WHAT, checksum)
    size = plan.hops[index].world_size
    received = plan.hops[index].all_to_all(_rows([(q, scales)], size))
    [(q, scales)] = _split(received, [(q, scales)], size)
    if index == len(plan.hops) - 1:
        scales = finite_or_raise(scales, _NON_FINITE)
    return q, scales


def _reduce_scatter(
    v: torch.Tensor,
    n: int,
    errors: tuple[torch.Tensor | None, ...],
    plan: _Plan,
    err_beta: float,
    checksum: int | None = None,
    participation: Participation | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Mean over the world of this rank's chunk of the padded fp32 ``v`` (``n`` elements before
    padding; ``checksum``: of the call's layout, by default of ``v`` alone); new hop errors.
    With ``participation``, a rank that sits out sends zero codes and scales at the first hop
    (its first hop's new error is then meaningless: the caller keeps the old one) and the sum
    is divided by the participants."""
    checksum = _sizes.layout_checksum([(0, n)]) if checksum is None else checksum
    new_errors = []
    v = sent(v, participation)
    for index, (hop, error) in enumerate(zip(plan.hops, errors, strict=True)):
        q, scales, new_error = _feedback(v, error, plan, err_beta)
        if index == 0 and participation is not None:  # the sitter's own message: zero
            q, scales = (torch.where(participation.takes_part, x, 0) for x in (q, scales))
        new_errors.append(new_error)
        q, scales = _exchange_hop(plan, index, q, scales, n, checksum)
        pieces = kernels.dequantize(q, scales, plan.bits, v.numel())
        v = kernels.sum_ranks(pieces.view(hop.world_size, -1))
    return participants_mean(v, plan.world.world_size, participation), new_errors


def _all_gather(
    shard: torch.Tensor, error: torch.Tensor | None, plan: _Plan, err_beta: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The quantized all-gather of every rank's shard, in chunk order; the new error."""
    q, scales, new_error = _feedback(shard, error, plan, err_beta)
    world_size = plan.world.world_size
    q = plan.world.all_gather(q)  # [W, bytes per chunk]
    scales = plan.world.all_gather(scales)  # [W, groups per chunk]
    out = kernels.dequantize(
        q.reshape(-1), scales.reshape(-1), plan.bits, world_size * shard.numel()
    )
    if plan.local_world_size is not None:  # rank node * L + local holds chunk local * nodes + node
        nodes = world_size // plan.local_world_size
        out = out.view(nodes, plan.local_world_size, -1).transpose(0, 1).reshape(-1)
    return fusion_barrier(out), new_error


_scratch = threading.local()


def _workspace(
    name: str, numel: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A scratch buffer of ``numel`` values for the donated path: one per (thread, name, dtype,
    device), grown to the largest size asked for and then reused (its contents are scratch)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key = (name, dtype, device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


def _codes(
    name: str, numel: int, plan: _Plan, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspaces ``name.q`` and ``name.scales`` for the codes and scales of ``numel``
    values."""
    return (
        _workspace(f"{name}.q", numel * plan.bits // 8, device, torch.uint8),
        _workspace(f"{name}.scales", numel // plan.group_size, device),
    )


def _into(buffer: object, value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into the donated ``buffer`` when it fits, else ``value`` itself."""
    return value if fitting(buffer, value) is None else buffer.copy_(value)


class _Pending(NamedTuple):
    """One quantization whose LoCo error is written once every rank's check has passed."""

    source: torch.Tensor  # the values quantized (before zero padding and the error)
    error: torch.Tensor | None  # fp32[N_k], or None for a zero error
    q: torch.Tensor
    scales: torch.Tensor
    rows: tuple[int, int, int] | None  # how source is laid out (fn.kernels.loco_quantize)


def _quantize_padded(
    source: torch.Tensor,
    error: torch.Tensor | None,
    numel: int,
    plan: _Plan,
    name: str,
    rows: tuple[int, int, int] | None = None,
) -> _Pending:
    """Phase 1 into the workspaces ``name``; a non-finite group makes every scale NaN, as in
    :func:`_quantize` (the codes are then never used)."""
    out = _codes(name, numel, plan, source.device)
    q, scales = kernels.loco_quantize(source, error, plan.bits, plan.group_size, numel, out, rows)
    scales = torch.where(torch.isfinite(scales).all(), scales, torch.nan)
    return _Pending(source, error, q, scales, rows)


def _reduce_scatter_into(
    x: torch.Tensor,
    errors: tuple[torch.Tensor | None, ...],
    plan: _Plan,
    out: torch.Tensor,
    rows: tuple[int, int, int] | None = None,
    tag: str = "",
    checksum: int | None = None,
) -> list[_Pending]:
    """:func:`_reduce_scatter` of the flat fp32 ``x`` (zero-padded only virtually; laid out by
    ``rows`` as in ``fn.kernels.loco_quantize``) into ``out`` (fp32[N / W]), hop sums in
    workspaces. Writes nothing else, and ``out`` only after the last hop's check passed;
    returns the hops' quantizations for :func:`_write_errors` (in workspaces named after
    ``tag``: another tag keeps them while this function runs again)."""
    n = x.numel()
    checksum = _sizes.layout_checksum([(0, n)]) if checksum is None else checksum
    if rows is None and _point_to_point(plan, x.device):
        return [_reduce_scatter_streamed(x, errors[0], plan, out, tag, checksum)]
    numel = quantized_padded_numel(n, plan.world.world_size, plan.group_size)
    if rows is not None:
        numel = n // rows[0] * rows[1]
    pending = []
    source = x
    for index, (hop, error) in enumerate(zip(plan.hops, errors, strict=True)):
        quantized = _quantize_padded(
            source, error, numel, plan, f"{tag}hop{index}", rows if index == 0 else None
        )
        pending.append(quantized)
        q, scales = _exchange_hop(plan, index, quantized.q, quantized.scales, n, checksum)
        numel //= hop.world_size
        last = index == len(plan.hops) - 1
        source = out if last else _workspace(f"{tag}sum{index}", numel, x.device)
        kernels.dequantize_sum(q, scales, plan.bits, hop.world_size, source)
    out.div_(plan.world.world_size)
    return pending


def _point_to_point(plan: _Plan, device: torch.device) -> bool:
    """Whether the donated path streams its chunks point to point (one hop on a
    :class:`ProcessGroup` with host tensors) instead of calling the comm's collectives."""
    return len(plan.hops) == 1 and isinstance(plan.world, ProcessGroup) and device.type == "cpu"


def _peers(comm: ProcessGroup) -> list[int]:
    """The other ranks from ``rank + 1`` on: at each step every rank sends to a different one."""
    return [(comm.rank + k) % comm.world_size for k in range(1, comm.world_size)]


def _reduce_scatter_streamed(
    x: torch.Tensor,
    error: torch.Tensor | None,
    plan: _Plan,
    out: torch.Tensor,
    tag: str,
    checksum: int,
) -> _Pending:
    """:func:`_reduce_scatter_into` in one hop on a :class:`ProcessGroup`, point to point, with
    the bits, bytes and errors of the collectives. The size record is split: its count goes to
    every peer first, and while the counts travel this rank quantizes its first peer's chunk,
    then checks every rank's count (a mismatch raises here on every rank, before any chunk
    moves). Then each peer's chunk is sent as soon as it is ready, while the chunks already sent
    travel, and the layout checksum follows the chunks, NaN unless all of this rank's scales are
    finite: every rank checks them all before ``out`` is written."""
    comm = plan.world
    assert isinstance(comm, ProcessGroup)
    world_size, n, bits = comm.world_size, x.numel(), plan.bits
    numel = quantized_padded_numel(n, world_size, plan.group_size)
    chunk = numel // world_size
    q, scales = _codes(f"{tag}hop0", numel, plan, x.device)
    got_q, got_scales = _codes("scatter.got", numel, plan, x.device)
    got_records = _workspace("scatter.got.records", 3 * world_size, x.device).view(world_size, 3)
    q, got_q = q.view(world_size, -1), got_q.view(world_size, -1)
    scales, got_scales = scales.view(world_size, -1), got_scales.view(world_size, -1)
    record = _sizes.with_count(scales[:1, :0], n, checksum).view(3)
    peers = _peers(comm)
    with comm.transfers("quantized reduce-scatter (point to point)") as transfers:
        for peer in peers:
            transfers.recv(got_records[peer, :2], peer, 2)
            transfers.send(record[:2], peer, 2)
        for index, peer in enumerate([*peers, comm.rank]):
            begin = peer * chunk
            kernels.loco_quantize(
                x[min(begin, n) : begin + chunk],
                None if error is None else error[begin : begin + chunk],
                bits,
                plan.group_size,
                chunk,
                (q[peer], scales[peer]),
            )
            if index == 0:
                for source in peers:
                    transfers.wait_from(source)
                got_records[comm.rank] = record
                _sizes.check(got_records[:, :2], n, _WHAT)
                for source in peers:
                    transfers.recv(got_q[source], source, 0)
                    transfers.recv(got_scales[source], source, 1)
                    transfers.recv(got_records[source, 2:], source, 3)
            if peer != comm.rank:
                transfers.send(q[peer], peer, 0)
                transfers.send(scales[peer], peer, 1)
        tail = torch.where(torch.isfinite(scales).all(), record[2:], torch.nan)
        for peer in peers:
            transfers.send(tail, peer, 3)
        got_q[comm.rank] = q[comm.rank]
        got_scales[comm.rank] = scales[comm.rank]
        got_records[comm.rank, 2:] = tail
    _sizes.check(finite_or_raise(got_records, _NON_FINITE), n, _WHAT, checksum)
    kernels.dequantize_sum(got_q.view(-1), got_scales.view(-1), bits, world_size, out)
    out.div_(world_size)
    return _Pending(x, error, q.view(-1), scales.view(-1), None)


def _all_gather_streamed(
    quantized: _Pending,
    plan: _Plan,
    y: torch.Tensor,
    pending: Sequence[_Pending],
    pending_outs: Sequence[torch.Tensor],
    err_beta: float,
) -> None:
    """The all-gather of :func:`_all_gather_into` point to point on a :class:`ProcessGroup`:
    the errors are written while the chunks travel, then each chunk is dequantized into ``y``
    as it arrives (this rank's first)."""
    comm = plan.world
    assert isinstance(comm, ProcessGroup)
    world_size, chunk = comm.world_size, quantized.q.numel() * 8 // plan.bits
    got_q, got_scales = _codes("gather.got", world_size * chunk, plan, y.device)
    got_q, got_scales = got_q.view(world_size, -1), got_scales.view(world_size, -1)
    got_q[comm.rank], got_scales[comm.rank] = quantized.q, quantized.scales

    def dequantize(rank):
        out = y[rank * chunk : (rank + 1) * chunk]
        if out.numel():
            kernels.dequantize_into(got_q[rank], got_scales[rank], plan.bits, out, 1)

    with comm.transfers("quantized all-gather (point to point)") as transfers:
        for peer in _peers(comm):
            transfers.recv(got_q[peer], peer, 0)
            transfers.recv(got_scales[peer], peer, 1)
        for peer in _peers(comm):
            transfers.send(quantized.q, peer, 0)
            transfers.send(quantized.scales, peer, 1)
        _write_errors(pending, pending_outs, plan, err_beta)
        dequantize(comm.rank)
        for peer in _peers(comm):
            transfers.wait_from(peer)
            dequantize(peer)


def _write_errors(
    pending: Sequence[_Pending], outs: Sequence[torch.Tensor], plan: _Plan, err_beta: float
) -> None:
    for quantized, out in zip(pending, outs, strict=True):
        source, error, q, scales, rows = quantized
        kernels.loco_error(source, error, q, scales, plan.bits, err_beta, out, rows)


@functools.lru_cache(maxsize=1)
def _comm_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="fn-comm")


# A forked child inherits the executor object but not its thread.
os.register_at_fork(after_in_child=_comm_thread.cache_clear)


def _overlapped(
    comm: Comm, device: torch.device, collectives: Callable[[], _T], work: Callable[[], None]
) -> _T:
    """``work()`` while ``collectives()`` runs, the result of ``collectives()``. On a
    :class:`ProcessGroup` with CPU tensors (whose collectives wait without the GIL, as the CPU
    kernels run) the collectives go to a helper thread, so that the wire and this rank's
    compute overlap; on any other comm (``Simulated`` under vmap, ``Local``) or device (whose
    streams are per thread) they run first, in this thread."""
    if not isinstance(comm, ProcessGroup) or device.type != "cpu":
        result = collectives()
        work()
        return result
    future = _comm_thread().submit(collectives)
    try:
        work()
    finally:
        result = future.result()  # a collective is never left running
    return result


def _all_gather_into(
    shard: torch.Tensor,
    error: torch.Tensor | None,
    error_out: torch.Tensor | None,
    plan: _Plan,
    err_beta: float,
    y: torch.Tensor,
    pending: Sequence[_Pending] = (),
    pending_outs: Sequence[torch.Tensor] = (),
) -> None:
    """:func:`_all_gather` writing the first ``y.numel()`` values into the fp32 ``y`` and, with
    ``error_out``, LoCo's new error into it (it may be ``error``). The errors of ``pending``
    (the reduce-scatter's quantizations) are written into ``pending_outs`` while the codes are
    on the wire, before ``y`` is written (``y`` may hold a ``pending`` source)."""
    quantized = _quantize_padded(shard, error, shard.numel(), plan, "gather")
    if error_out is not None:
        pending, pending_outs = [*pending, quantized], [*pending_outs, error_out]
    if _point_to_point(plan, y.device):
        return _all_gather_streamed(quantized, plan, y, pending, pending_outs, err_beta)
    q, scales = _overlapped(
        plan.world,
        shard.device,
        lambda: (plan.world.all_gather(quantized.q), plan.world.all_gather(quantized.scales)),
        lambda: _write_errors(pending, pending_outs, plan, err_beta),
    )
    local = plan.local_world_size or 1
    kernels.dequantize_into(q.reshape(-1), scales.reshape(-1), plan.bits, y, q.shape[0], local)


def _allreduce_pure(
    u: torch.Tensor,
    errors: tuple[torch.Tensor | None, ...],
    plan: _Plan,
    err_beta: float,
    checksum: int,
    participation: Participation | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """The quantized mean of the leaf ``u`` (its shape and dtype) and the new errors; ``errors``
    per hop of the reduce-scatter, then the all-gather's (``None``: zero, no new error); with
    ``participation``, over the ranks that take part (:func:`_reduce_scatter`)."""
    shard, hop_errors = _reduce_scatter(
        _flat_padded(u, plan), u.numel(), errors[:-1], plan, err_beta, checksum, participation
    )
    y, gather_error = _all_gather(shard, errors[-1], plan, err_beta)
    return y[: u.numel()].view(u.shape).to(u.dtype), (*hop_errors, gather_error)


def _allreduce_into(
    u: torch.Tensor,
    errors: tuple[torch.Tensor | None, ...],
    outs: tuple[torch.Tensor, ...] | None,
    plan: _Plan,
    err_beta: float,
    tag: str,
    checksum: int,
) -> Callable[[], torch.Tensor]:
    """Phase 1 of the donated :func:`_allreduce_pure` of the eager ``u``: every rank's checks,
    nothing written (the shard and the quantizations wait in workspaces named after ``tag``).
    Returns phase 2, which writes the new errors into ``outs`` (``None``: none) and then the
    result into ``u`` when it is contiguous fp32 (else into a fresh tensor), with the same bits."""
    _flat_padded(u.reshape(-1)[:0], plan)  # the type check
    x = u.detach().reshape(-1).float()
    shard_numel = quantized_padded_numel(x.numel(), plan.world.world_size, plan.group_size)
    shard = _workspace(f"{tag}shard", shard_numel // plan.world.world_size, x.device)
    pending = _reduce_scatter_into(x, errors[:-1], plan, shard, tag=tag, checksum=checksum)

    def write() -> torch.Tensor:
        # u's values are read (by the pending errors) before the all-gather writes the result.
        in_place = u.dtype == torch.float32 and u.is_contiguous()
        y = u.detach().view(-1) if in_place else x.new_empty(u.numel())
        if outs is None:
            _all_gather_into(shard, errors[-1], None, plan, err_beta, y)
        else:
            _all_gather_into(shard, errors[-1], outs[-1], plan, err_beta, y, pending, outs[:-1])
        return u if in_place else _into(u, y.view(u.shape).to(u.dtype))

    return write


def _over_live(
    live: list[int],
    donated: bool,
    pure: Callable[[int], _T],
    phase1: Callable[[int, str], Callable[[], _T]],
) -> list[_T]:
    """``pure(i)`` for every live leaf position ``i``; donated, the phase 2 that ``phase1(i,
    tag)`` returns for every one, run once every leaf's phase 1 (its checks) passed."""
    if not donated:
        return [pure(i) for i in live]
    # each leaf's workspaces are held between the two phases: a single leaf uses the plain names
    writes = [phase1(i, "" if len(live) == 1 else f"leaf{k}.") for k, i in enumerate(live)]
    return [write() for write in writes]


def _live(leaves: Sequence[torch.Tensor | None]) -> tuple[list[int], int]:
    """The positions of the leaves that communicate (not ``None``, not empty) and the checksum
    of the call's layout that every rank's size records carry (``fn.collectives._sizes``)."""
    live = [i for i, u in enumerate(leaves) if u is not None and u.numel() > 0]
    return live, _sizes.layout_checksum((i, leaves[i].numel()) for i in live)


def _flat_padded(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    if not x.is_floating_point():
        raise TypeError(f"quantized allreduce needs a floating-point x, got {x.dtype}")
    n = x.numel()
    n_padded = quantized_padded_numel(n, plan.world.world_size, plan.group_size)
    return torch.nn.functional.pad(x.reshape(-1).float(), (0, n_padded - n))


def quantized_reduce_scatter(
    x: torch.Tensor,
    *,
    comm: Comm,
    bits: int = 4,
    group_size: int = 128,
    local_world_size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's shard of the mean of ``x`` over the ranks, sent quantized (ZeRO++ qgZ).

    ``x`` is flattened and zero-padded to ``N = quantized_padded_numel(x.numel(), W,
    group_size)`` and split in ``W`` chunks of ``N / W``.

    Args:
        x: this rank's tensor (floating point, any shape).
        comm: the communicator.
        bits: 4 or 8.
        group_size: values per quantization group (even).
        local_world_size: ranks per node for the two-hop mode, or ``None`` for one hop.
        out: an fp32[N / W] buffer for the result (written only after every rank's checks
            passed), or ``None`` for a fresh tensor; eager, written by the fused kernels of
            :func:`loco_allreduce`'s donation.

    Returns:
        ``out`` or a fresh fp32[N / W], holding chunk ``rank`` (one hop) or chunk
        ``local * (W / L) + node`` (two hops) of ``mean_i DQ(Q(x_i))`` (two hops: requantized
        after the node sums).

    Raises:
        ValueError: on every rank, if the ranks' ``x`` differ in element count (before any
            chunk is sent, naming every rank's count) or some rank's ``x`` is not finite; ``out``
            is not written.

    Example:
        >>> from fn.collectives import Simulated, quantized_reduce_scatter, simulate
        >>> comm = Simulated(2)
        >>> x = torch.linspace(-1, 1, 16).view(2, 8)  # row r: rank r's tensor
        >>> x.mean(0)
        tensor([-0.4667, -0.3333, -0.2000, -0.0667,  0.0667,  0.2000,  0.3333,  0.4667])
        >>> def shard(x):  # written for one rank
        ...     return quantized_reduce_scatter(x, comm=comm, bits=8, group_size=4)
        >>> simulate(shard, comm)(x)  # row r: rank r's shard, chunk r of the mean
        tensor([[-0.4672, -0.3333, -0.2013, -0.0693],
                [ 0.0674,  0.2013,  0.3333,  0.4633]])
    """
    plan = _plan(comm, bits, group_size, local_world_size)
    if out is not None:
        shard_numel = quantized_padded_numel(x.numel(), comm.world_size, group_size)
        if out.dtype != torch.float32 or out.shape != (shard_numel // comm.world_size,):
            raise ValueError(
                f"out must be fp32 of shape ({shard_numel // comm.world_size},), got "
                f"{out.dtype}{tuple(out.shape)}"
            )
    if out is None or not eager(x) or not eager(out):
        shard, _ = _reduce_scatter(
            _flat_padded(x, plan), x.numel(), (None,) * len(plan.hops), plan, 0.0
        )
        return shard if out is None else out.copy_(shard)
    _flat_padded(x[:0], plan)  # the type check
    _reduce_scatter_into(x.detach().reshape(-1).float(), (None,) * len(plan.hops), plan, out)
    return out


def quantized_reduce_scatter_into(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    errors: Sequence[torch.Tensor | None] = (),
    error_outs: Sequence[torch.Tensor] = (),
    *,
    comm: Comm,
    bits: int = 4,
    group_size: int = 128,
    local_world_size: int | None = None,
    err_beta: float = 0.0,
    scale: float = 1.0,
) -> None:
    """``torch.distributed.reduce_scatter_tensor`` sent quantized (ZeRO++ qgZ), in place, with
    optional LoCo error feedback.

    ``input_tensor`` holds ``W`` rows of ``m = output_tensor.numel()`` values, row ``r`` for
    rank ``r``. Every row is zero-padded on its own to ``p`` values, whole groups, and quantized
    (``v = row + e``, ``e`` this rank's error of the hop); rank ``r`` writes ``scale`` times the
    mean over the ranks of their dequantized row ``r`` into ``output_tensor`` (its dtype). With
    ``local_world_size`` the rows go intra-node first, then inter-node (each hop quantizes
    again), still row ``r`` to rank ``r``. With ``error_outs``, LoCo's new errors
    ``e' = err_beta e + (1 - err_beta) (v - DQ(Q(v)))`` are written into them (they may be
    ``errors`` themselves).

    Eager calls allocate no full-size tensor (docs/algorithms.md, "Inside FSDP2's
    reduce-scatter"); under ``torch.compile`` or ``vmap`` the padded rows are made, with the
    same bits.

    Args:
        output_tensor: ``[m]`` values of any floating dtype, written last.
        input_tensor: ``[W * m]`` floating-point values.
        errors: per hop, this rank's fp32 error ``[W * p]`` (the second hop ``[W * p / L]``),
            ``None`` for zero; ``()``: zero errors.
        error_outs: per hop, where the new error goes (same shapes), or ``()`` for none.
        comm: the communicator.
        bits: 4 or 8.
        group_size: values per quantization group (even).
        local_world_size: ranks per node for the two-hop mode, or ``None`` for one hop.
        err_beta: LoCo's error decay ``beta``.
        scale: the factor of the mean (``W`` for the sum).

    Raises:
        ValueError: ``input_tensor`` is not ``W`` rows of ``output_tensor``'s size, a bad
            ``bits`` or ``group_size``; on every rank, if the ranks' ``input_tensor`` differ in
            size (checked before any chunk is sent). ``fn.NonFiniteError`` (a ``ValueError``):
            on every rank, if some rank's values (or errors) are not finite. Nothing is written.

    Example:
        >>> from fn.collectives import Simulated, quantized_reduce_scatter_into, simulate
        >>> comm = Simulated(2)
        >>> x = torch.linspace(-1, 1, 12).view(2, 6)  # row r: rank r's input, 2 rows of 3
        >>> def shard(x):  # written for one rank: the sum of row `rank`, to 8 bits
        ...     out = x.new_empty(3)
        ...     quantized_reduce_scatter_into(out, x, comm=comm, bits=8, group_size=4, scale=2.0)
        ...     return out
        >>> simulate(shard, comm)(x)  # row r: rank r's output
        tensor([[-0.9077, -0.5469, -0.1818],
                [ 0.1783,  0.5469,  0.8999]])
        >>> x.view(2, 2, 3).sum(0)
        tensor([[-0.9091, -0.5455, -0.1818],
                [ 0.1818,  0.5455,  0.9091]])
    """
    plan = _plan(comm, bits, group_size, local_world_size)
    world_size, numel = comm.world_size, input_tensor.numel()
    row = output_tensor.numel()
    if numel % world_size or row != numel // world_size:
        raise ValueError(
            f"input_tensor ({numel} values) must be world_size={world_size} rows of "
            f"output_tensor's {row} values"
        )
    padded = -(-row // group_size) * group_size
    errors = tuple(errors) or (None,) * len(plan.hops)
    if not eager(input_tensor, output_tensor):
        return _reduce_scatter_rows_padded(
            output_tensor, input_tensor, plan, scale, errors, error_outs, err_beta, padded
        )
    x = input_tensor.reshape(-1).float()
    shares = output_tensor.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    direct = output_tensor.dtype == torch.float32 and output_tensor.is_contiguous()
    direct = direct and padded == row and not shares
    shard = output_tensor.view(-1) if direct else _workspace("rows.shard", padded, x.device)
    rows = (row, padded, local_world_size or 1)
    pending = _reduce_scatter_into(x, errors, plan, shard, rows)
    if error_outs:
        _write_errors(pending, error_outs, plan, err_beta)
    shard = shard[:row]
    if scale != 1.0:
        shard.mul_(scale)
    if not direct:
        output_tensor.copy_(shard.view(output_tensor.shape))
    return None


def _reduce_scatter_rows_padded(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    plan: _Plan,
    scale: float,
    errors: tuple[torch.Tensor | None, ...],
    error_outs: Sequence[torch.Tensor],
    err_beta: float,
    padded: int,
) -> None:
    """:func:`quantized_reduce_scatter_into` on the padded (and, with two hops, reordered)
    rows, made as tensors: the path under ``torch.compile`` and ``vmap``."""
    world_size, row = plan.world.world_size, output_tensor.numel()
    v = torch.nn.functional.pad(input_tensor.view(world_size, row).float(), (0, padded - row))
    if plan.local_world_size is not None:
        # two hops: rank node * L + local receives chunk local * nodes + node; reorder the rows
        # so that this chunk is its own row
        v = v.view(-1, plan.local_world_size, padded).transpose(0, 1)
    if error_outs:  # a zero error still gives a new one
        errors = tuple(
            torch.zeros_like(out) if e is None else e
            for e, out in zip(errors, error_outs, strict=True)
        )
    shard, new_errors = _reduce_scatter(v.reshape(-1), input_tensor.numel(), errors, plan, err_beta)
    shard = shard[:row]
    output_tensor.copy_(shard if scale == 1.0 else shard * scale)
    for out, new in zip(error_outs, new_errors if error_outs else (), strict=True):
        out.copy_(new)


def quantized_all_gather_into(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    *,
    comm: Comm,
    bits: int = 8,
    group_size: int = 128,
) -> None:
    """``torch.distributed.all_gather_into_tensor`` sent quantized (ZeRO++ qwZ), in place.

    Every rank sends its ``input_tensor`` (``n`` values, zero-padded on its own to whole
    groups) as blockwise codes and fp32 scales; every rank writes ``DQ(Q(x_i))`` of every rank
    ``i``, its own included, as row ``i`` of ``output_tensor`` (``[W * n]``, its dtype). A rank's
    non-finite values gather as NaN.

    Args:
        output_tensor: ``[W * n]`` values of any floating dtype.
        input_tensor: this rank's ``n`` floating-point values.
        comm: the communicator.
        bits: 8 (ZeRO++'s qwZ) or 4.
        group_size: values per quantization group (even).

    Raises:
        ValueError: ``output_tensor`` does not hold ``W * n`` values, a bad ``bits`` or
            ``group_size``.

    Example:
        >>> from fn.collectives import Simulated, quantized_all_gather_into, simulate
        >>> comm = Simulated(2)
        >>> x = torch.tensor([[0.5, -1.0, 0.3], [0.25, 0.7, 0.1]])  # row r: rank r's shard
        >>> def gather(x):  # written for one rank
        ...     out = x.new_empty(6)
        ...     quantized_all_gather_into(out, x, comm=comm, bits=8, group_size=4)
        ...     return out
        >>> simulate(gather, comm)(x)[0]  # every rank: both shards, to 8 bits per group of 4
        tensor([ 0.5000, -1.0000,  0.2969,  0.2516,  0.6945,  0.0984])
    """
    plan = _plan(comm, bits, group_size, None)
    world_size, n = comm.world_size, input_tensor.numel()
    if output_tensor.numel() != world_size * n:
        raise ValueError(
            f"output_tensor must hold world_size={world_size} x {n} values, "
            f"got {output_tensor.numel()}"
        )
    padded = -(-n // group_size) * group_size
    shard = torch.nn.functional.pad(input_tensor.reshape(-1).float(), (0, padded - n))
    gathered, _ = _all_gather(shard, None, plan, 0.0)
    output_tensor.view(world_size, n).copy_(gathered.view(world_size, padded)[:, :n])


def _exchanged(
    leaves: list,
    live: list[int],
    errors: list[tuple[torch.Tensor | None, torch.Tensor | None]],
    plan: _Plan,
    err_beta: float,
    offered: torch.Tensor,
    extra: Sequence[int] = (),
) -> tuple[list[torch.Tensor], list[tuple], Participation, object]:
    """:func:`_allreduce_pure` of every live leaf at once, one hop, with this rank's flag, the
    size record and ``extra`` in a header: one all_to_all of every leaf's chunks (each leaf
    padded and quantized as on its own, so the same bits) and one all-gather of every leaf's
    shard. A rank whose flag is unset (``offered`` ``False``, or a value or an error not
    finite) sends zeros; the sums are divided by the ranks whose flags are set. Returns the
    leaves with every live one's result, their new errors ``(e_rs, e_ag)``, this rank's
    participation and what :func:`~fn.collectives.header.opened` read."""
    if plan.local_world_size is not None:
        raise NotImplementedError(
            "quantized allreduce: the exchange with a header runs on one hop; the two-hop mode "
            "(local_world_size) has only update (fn.diloco's compressors use one hop)"
        )
    world = plan.world
    world_size = world.world_size
    n = sum(leaves[i].numel() for i in live)
    layout = [(i, leaves[i].numel()) for i in live] + [(-1, plan.bits), (-2, plan.group_size)]
    checksum = _sizes.layout_checksum(layout)
    padded = [_flat_padded(leaves[i], plan) for i in live]
    flag = offered
    for x in padded + [e for pair in errors for e in pair if e is not None]:
        flag = flag & torch.isfinite(x).all()
    # a rank that sits out is not read (no non-finite value reaches the kernels, which may
    # refuse one for the whole batch of simulated ranks) and sends zeros
    padded = [torch.where(flag, v, 0.0) for v in padded]
    first = [_feedback(v, e[0], plan, err_beta) for v, e in zip(padded, errors, strict=True)]
    rows = _rows(first, world_size)
    rows = torch.where(flag, rows, 0)
    got, part = exchange_rows(world, rows, flag, n, _WHAT, checksum, to_each=True, extra=extra)
    if not live:
        return list(leaves), [], part, got
    pieces = _split(got.payload, first, world_size)
    shards = [
        participants_mean(
            kernels.sum_ranks(kernels.dequantize(q, s, plan.bits, v.numel()).view(world_size, -1)),
            world_size,
            part,
        )
        for (q, s), v in zip(pieces, padded, strict=True)
    ]
    second = [_feedback(x, e[1], plan, err_beta) for x, e in zip(shards, errors, strict=True)]
    received = gathered(world, _rows(second, 1)[0])
    ys = [
        fusion_barrier(kernels.dequantize(q, s, plan.bits, world_size * x.numel()))
        for (q, s), x in zip(_split(received, second, 1), shards, strict=True)
    ]
    out = list(leaves)
    for y, i in zip(ys, live, strict=True):
        out[i] = y[: leaves[i].numel()].view(leaves[i].shape).to(leaves[i].dtype)
    return out, [(a[2], b[2]) for a, b in zip(first, second, strict=True)], part, got


def _rows(quantized: list[tuple], rows: int) -> torch.Tensor:
    """Every leaf's codes, then every leaf's scales as bytes (``quantized``: ``(q, scales, ...)``
    per leaf), cut into ``rows`` rows (row ``r``: each leaf's chunk ``r``): uint8 ``[rows,
    bytes]``."""
    parts = [q.view(rows, -1) for q, *_ in quantized]
    parts += [s.view(rows, -1).view(torch.uint8) for _, s, *_ in quantized]
    return torch.cat(parts, dim=1) if parts else torch.zeros(rows, 0, dtype=torch.uint8)


def _split(
    received: torch.Tensor, quantized: list[tuple], rows: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The received rows (one per rank, ``[W, bytes]``) of the :func:`_rows` of ``quantized``
    (``(q, scales, ...)`` per leaf, cut into ``rows`` rows) back into each leaf's codes and
    scales, flat and in rank order."""
    widths = [q.numel() // rows for q, *_ in quantized]
    widths += [4 * s.numel() // rows for _, s, *_ in quantized]
    parts = received.split(widths, dim=1)
    count = len(quantized)
    return [
        (parts[k].reshape(-1), parts[count + k].clone(memory_format=torch.contiguous_format)
         .view(torch.float32).reshape(-1))
        for k in range(count)
    ]  # fmt: skip


def quantized_allreduce(
    bits: int = 4,
    group_size: int = 128,
    *,
    comm: Comm,
    local_world_size: int | None = None,
) -> Compressor:
    """Replaces every update leaf by its quantized mean over the ranks (no error feedback).

    ``u -> DQ(Q(mean_i DQ(Q(u_i)))`` chunkwise: quantized reduce-scatter, then quantized
    all-gather (see the module docstring for the two-hop mode). ``None`` leaves pass through;
    with ``W == 1`` it is the identity. Stateless. ``update(..., donate=True)`` writes each
    result into its update tensor as :func:`loco_allreduce` does (same bits as the pure call).
    ``update(..., participation=fn.collectives.Participation(takes_part, n))``: a rank that sits
    out sends zero codes and scales in the reduce-scatter (its input is not read; it still
    reduces and all-gathers its chunk) and the sums are divided by ``n``; computed purely.

    Args:
        bits: 4 or 8.
        group_size: values per quantization group (even).
        comm: the communicator.
        local_world_size: ranks per node for the two-hop mode, or ``None``.

    ``exchange(updates, state, flag)`` (:class:`~fn.collectives.Compressor`, one hop) gives the
    same bits with this rank's flag and the size record in a header, every leaf at once: one
    all_to_all of every leaf's chunks and one all-gather of every leaf's shard.

    Returns:
        A :class:`~fn.collectives.Compressor` with an ``EmptyState``.

    Raises:
        ValueError: from ``update``, on every rank, if the ranks' update leaves differ in size
            or in which of them communicate (not ``None``, not empty; checked before any chunk
            is sent) or some rank's values are not finite. No leaf is written.

    Example:
        >>> from fn.collectives import Simulated, quantized_allreduce, simulate
        >>> comm = Simulated(2)
        >>> tx = quantized_allreduce(bits=8, group_size=8, comm=comm)
        >>> grads = {"w": torch.linspace(-1, 1, 16).view(2, 8)}  # row r: rank r's gradient
        >>> updates, _ = simulate(tx.update, comm)(grads, tx.init(grads))
        >>> updates["w"][0]  # every rank: the mean, to 8-bit precision
        tensor([-0.4648, -0.3305, -0.1997, -0.0654,  0.0654,  0.1997,  0.3305,  0.4612])
    """
    plan = _plan(comm, bits, group_size, local_world_size)
    no_errors = (None,) * (len(plan.hops) + 1)

    def phase1(u, tag, checksum):
        if eager(u):
            return _allreduce_into(u, no_errors, None, plan, 0.0, tag, checksum)
        y, _ = _allreduce_pure(u, no_errors, plan, 0.0, checksum)
        return lambda: _into(u, y)

    def update_fn(updates, state, params=None, *, donate=None, participation=None, **extra):
        del params, extra
        leaves, spec = tree_flatten(updates)
        live, checksum = _live(leaves)
        if comm.world_size == 1 or not live:
            return updates, state
        results = _over_live(
            live,
            donating(donate) and participation is None,
            lambda i: _allreduce_pure(leaves[i], no_errors, plan, 0.0, checksum, participation)[0],
            lambda i, tag: phase1(leaves[i], tag, checksum),
        )
        for i, result in zip(live, results, strict=True):
            leaves[i] = result
        return tree_unflatten(leaves, spec), state

    def exchange_fn(updates, state, flag=None, params=None, *, extra=()):
        del params
        leaves, spec = tree_flatten(updates)
        live, _ = _live(leaves)
        if comm.world_size == 1:
            return alone(updates, state, flag, leaves, live, extra)
        no = [no_errors] * len(live)
        out, _, _, got = _exchanged(leaves, live, no, plan, 0.0, flag_of(flag), extra)
        return Exchanged(tree_unflatten(out, spec), state, got.flags, got.extra)

    return Compressor(lambda params: EmptyState(), update_fn, exchange_fn)


class QuantizedError(NamedTuple):
    """An error-feedback buffer kept in 8-bit blockwise form (``error_dtype=torch.int8``).

    Attributes:
        q: uint8 ``[k]``, the quantized values (``fn.kernels.quantize``'s codes).
        scales: fp32 ``[k / group_size]``, one scale per group.

    Example:
        >>> tx = fn.collectives.loco_allreduce(
        ...     bits=4, group_size=8, comm=fn.collectives.Simulated(2), error_dtype=torch.int8)
        >>> e_rs, e_ag = tx.init({"w": torch.zeros(10)}).errors["w"]
        >>> e_rs.q.shape, e_rs.scales.shape
        (torch.Size([16]), torch.Size([2]))
    """

    q: torch.Tensor
    scales: torch.Tensor


class LocoAllreduceState(NamedTuple):
    """The state of :func:`loco_allreduce` (``N`` a leaf's padded size, ``W`` ranks, ``L`` per
    node).

    Attributes:
        count: ``[]`` int64 tensor, the number of updates made so far.
        errors: per leaf, a tuple of error buffers (fp32, the ``error_dtype``, or
            :class:`QuantizedError`): one hop, ``(e_rs [N], e_ag [N / W])``; two hops,
            ``(e_intra [N], e_inter [N / L], e_ag [N / W])``.

    Example:
        >>> tx = fn.collectives.loco_allreduce(bits=4, group_size=8,
        ...                                    comm=fn.collectives.Simulated(2))
        >>> state = tx.init({"w": torch.zeros(10)})
        >>> state.count, [e.shape for e in state.errors["w"]]
        (tensor(0), [torch.Size([16]), torch.Size([8])])
    """

    count: torch.Tensor
    errors: ErrorFeedbackField


def _error_sizes(numel: int, plan: _Plan) -> tuple[int, ...]:
    """The sizes of a leaf's LoCo errors: per hop of the reduce-scatter, then the all-gather's."""
    world_size = plan.world.world_size
    n_padded = quantized_padded_numel(numel, world_size, plan.group_size)
    local = plan.local_world_size
    hops = (n_padded,) if local is None else (n_padded, n_padded // local)
    return (*hops, n_padded // world_size)


def _store(e: torch.Tensor, dtype: torch.dtype, group_size: int) -> torch.Tensor | QuantizedError:
    if dtype == torch.int8:
        return QuantizedError(*kernels.quantize(e, 8, group_size))
    return e.to(dtype)


def _load(stored: torch.Tensor | QuantizedError, numel: int, reset: torch.Tensor) -> torch.Tensor:
    if isinstance(stored, QuantizedError):
        e = kernels.dequantize(stored.q, stored.scales, 8, numel)
    else:
        e = stored.float()
    # the count lives on the host; batched by vmap, it is no scalar that a GPU tensor takes
    return torch.where(reset.to(e.device), 0.0, e)


def _sitters_first_hop(
    stored: tuple, entered: tuple, reset: torch.Tensor, participation: Participation | None
) -> tuple:
    """A leaf's new stored LoCo errors, where this rank sits out with the first hop's as it
    entered the call (zero where the reset is due, else its stored bits)."""
    if participation is None:
        return stored
    first = tree_map(lambda b: torch.where(reset.to(b.device), torch.zeros_like(b), b), entered[0])
    return (kept(stored[0], first, participation), *stored[1:])


class _Loco(NamedTuple):
    """``loco_allreduce``'s settings that its leaves' steps take."""

    plan: _Plan
    err_beta: float
    error_dtype: torch.dtype


def _loaded(stored: tuple, numel: int, plan: _Plan, reset: torch.Tensor) -> tuple:
    """A leaf's stored errors as fp32 (zeros at a reset)."""
    sizes = _error_sizes(numel, plan)
    return tuple(_load(b, m, reset) for b, m in zip(stored, sizes, strict=True))


def _loco_leaf(
    u: torch.Tensor,
    buffers: tuple,
    reset: torch.Tensor,
    checksum: int,
    loco: _Loco,
    participation: Participation | None = None,
) -> tuple[torch.Tensor, tuple]:
    """One leaf's mean and its new stored errors (a sitter's first hop's kept)."""
    errors = _loaded(buffers, u.numel(), loco.plan, reset)
    y, new = _allreduce_pure(u, errors, loco.plan, loco.err_beta, checksum, participation)
    stored = tuple(_store(e, loco.error_dtype, loco.plan.group_size) for e in new)
    return y, _sitters_first_hop(stored, buffers, reset, participation)


def _loco_leaf_donated(
    u: torch.Tensor, buffers: tuple, given: tuple, call: tuple, loco: _Loco
) -> Callable[[], tuple]:
    """Phase 1 of a donated leaf; returns phase 2, which writes the result and the errors.
    ``call``: the reset flag, the leaf's tag and the call's checksum."""
    reset, tag, checksum = call
    if loco.error_dtype != torch.float32 or not eager(u):
        y, new = _loco_leaf(u, buffers, reset, checksum, loco)
        return lambda: (_into(u, y), tuple(map(_into, given, new)))
    errors = (None,) * len(buffers) if bool(reset) else tuple(buffers)
    outs = tuple(
        g if fitting(g, b) is not None else torch.empty_like(b)
        for g, b in zip(given, buffers, strict=True)
    )
    write = _allreduce_into(u, errors, outs, loco.plan, loco.err_beta, tag, checksum)
    return lambda: (write(), outs)


def _loco_update(
    updates: Any,
    state: LocoAllreduceState,
    donated: LocoAllreduceState | None,
    participation: Participation | None,
    step: tuple[_Loco, torch.Tensor, torch.Tensor],
) -> tuple[Any, LocoAllreduceState]:
    """``loco_allreduce``'s update on more than one rank: every live leaf's mean and errors
    (into ``donated``'s buffers where given). ``step``: the settings, the reset flag and the
    new count."""
    loco, reset, count = step
    leaves, spec = tree_flatten(updates)
    stored = spec.flatten_up_to(state.errors)
    given = [None] * len(leaves) if donated is None else spec.flatten_up_to(donated.errors)
    live, checksum = _live(leaves)
    if any(stored[i] is None for i in live):
        raise ValueError("loco_allreduce: an update leaf has no error state")
    results = _over_live(
        live,
        donated is not None,
        lambda i: _loco_leaf(leaves[i], stored[i], reset, checksum, loco, participation),
        lambda i, tag: _loco_leaf_donated(
            leaves[i],
            stored[i],
            given[i] or (None,) * len(stored[i]),
            (reset, tag, checksum),
            loco,
        ),
    )
    for i, (y, new) in zip(live, results, strict=True):
        leaves[i], stored[i] = y, new
    return tree_unflatten(leaves, spec), LocoAllreduceState(count, tree_unflatten(stored, spec))


def loco_allreduce(
    bits: int = 4,
    group_size: int = 128,
    err_beta: float = 0.8,
    reset_T: int = 1024,  # noqa: N803 (LoCo's / DeepSpeed's name)
    *,
    comm: Comm,
    error_dtype: torch.dtype = torch.float32,
    local_world_size: int | None = None,
) -> Compressor:
    """Quantized mean allreduce of every update leaf with LoCo error feedback.

    Each quantization (each reduce-scatter hop and the all-gather) compensates with its own
    error buffer: ``v = x + e; q = Q(v); e' = err_beta * e + (1 - err_beta) * (v - DQ(q))``.
    Before update ``t`` (0-based count ``c`` in the state), ``e`` is replaced by zero when
    ``c % reset_T == 0``. ``None`` leaves pass through; with ``W == 1`` the updates pass through
    unchanged (the count still advances).

    Buffer donation: ``update(updates, state, donate=True)`` updates the fp32 error buffers in
    place (``donate=<a LocoAllreduceState>``: writes them into that state's buffers) and writes
    each result into its update tensor (contiguous fp32; other dtypes are copied back), with the
    bits of the pure call, through fused kernels and per-thread workspaces
    (docs/algorithms.md, "Quantized allreduce with LoCo error feedback"; on a
    :class:`ProcessGroup` with host tensors and one hop, point to point). Nothing is
    written before every rank's checks passed for every leaf: a ``ValueError`` leaves the
    buffers intact. With several leaves, each leaf's codes and shard wait in workspaces of
    their own (per thread and leaf position, about ``bits / 32 + 1 / W`` of the leaf's fp32
    size). ``error_dtype`` other than fp32 still computes in fresh fp32 tensors.

    ``update(..., participation=fn.collectives.Participation(takes_part, n))``: a rank that sits
    out sends zero codes and scales in the first hop of the reduce-scatter (its input is not
    read) and keeps that hop's error as it entered the call (zero where the reset is due, else
    its stored bits); its later hops and its all-gather, which carry the others' values,
    update their errors as usual; the sums are divided by ``n``; computed purely.

    Args:
        bits: 4 or 8.
        group_size: values per quantization group (even).
        err_beta: LoCo's error decay ``beta``.
        reset_T: zero the errors every ``reset_T`` updates.
        comm: the communicator.
        error_dtype: storage of the error buffers: a float dtype, or ``torch.int8`` for 8-bit
            blockwise form (:class:`QuantizedError`, groups of ``group_size``).
        local_world_size: ranks per node for the two-hop mode, or ``None``.

    ``exchange(updates, state, flag)`` (:class:`~fn.collectives.Compressor`, one hop): the same
    bits with this rank's flag and the size record in a header, every leaf at once (as
    :func:`quantized_allreduce`'s); a rank whose flag is ``False`` keeps its errors.

    Returns:
        A :class:`~fn.collectives.Compressor` with state :class:`LocoAllreduceState`.

    Raises:
        ValueError: from ``update``, on every rank, if the ranks' update leaves differ in size
            or in which of them communicate (not ``None``, not empty; checked before any chunk
            is sent) or some rank's values are not finite. Nothing is written.

    Example:
        >>> from fn.collectives import Simulated, loco_allreduce, simulate
        >>> comm = Simulated(2)
        >>> tx = loco_allreduce(bits=4, group_size=8, comm=comm)
        >>> grads = {"w": torch.linspace(-1, 1, 16).view(2, 8)}  # row r: rank r's gradient
        >>> state = simulate(tx.init, comm)(grads)
        >>> [e.shape for e in state.errors["w"]]  # [W, N] reduce-scatter, [W, N / W] all-gather
        [torch.Size([2, 16]), torch.Size([2, 8])]
        >>> updates, state = simulate(tx.update, comm)(grads, state)
        >>> updates["w"][0]  # every rank: the mean, to 4-bit precision
        tensor([-0.4375, -0.3281, -0.1641, -0.0547,  0.0547,  0.1641,  0.3281,  0.3828])
        >>> grads["w"].mean(0)
        tensor([-0.4667, -0.3333, -0.2000, -0.0667,  0.0667,  0.2000,  0.3333,  0.4667])
    """
    plan = _plan(comm, bits, group_size, local_world_size)
    check_closed_fraction("loco_allreduce", err_beta=err_beta)
    check_int("loco_allreduce: reset_T", reset_T, minimum=1)
    if not isinstance(error_dtype, torch.dtype) or not (
        error_dtype.is_floating_point or error_dtype == torch.int8
    ):
        raise ValueError(
            f"loco_allreduce: error_dtype must be a float dtype or torch.int8, got {error_dtype!r}"
        )
    loco = _Loco(plan, err_beta, error_dtype)

    def init_fn(params):
        def zeros(p):  # zero errors for every quantization of the leaf
            return tuple(
                _store(torch.zeros(k, dtype=torch.float32, device=p.device), error_dtype,
                       group_size)
                for k in _error_sizes(p.numel(), plan)
            )  # fmt: skip

        return LocoAllreduceState(torch.zeros((), dtype=torch.int64), tree_map(zeros, params))

    def update_fn(updates, state, params=None, *, donate=None, participation=None, **extra):
        del params, extra
        count = state.count + 1
        donated = donated_state(donate, state) if participation is None else None
        if comm.world_size == 1:
            return updates, state._replace(count=count)
        reset = state.count % reset_T == 0
        return _loco_update(updates, state, donated, participation, (loco, reset, count))

    def exchange_fn(updates, state, flag=None, params=None, *, extra=()):
        del params
        leaves, spec = tree_flatten(updates)
        live, _ = _live(leaves)
        count = state.count + 1
        if comm.world_size == 1:
            return alone(updates, state._replace(count=count), flag, leaves, live, extra)
        stored = list(spec.flatten_up_to(state.errors))
        reset = state.count % reset_T == 0
        loaded = [_loaded(stored[i], leaves[i].numel(), plan, reset) for i in live]
        out, new, part, got = _exchanged(leaves, live, loaded, plan, err_beta, flag_of(flag), extra)
        for i, errors in zip(live, new, strict=True):
            kept_errors = tuple(_store(e, error_dtype, group_size) for e in errors)
            stored[i] = _sitters_first_hop(kept_errors, stored[i], reset, part)
        new_state = LocoAllreduceState(count, tree_unflatten(stored, spec))
        return Exchanged(tree_unflatten(out, spec), new_state, got.flags, got.extra)

    return Compressor(init_fn, update_fn, exchange_fn)
