"""Chunk-wise top-k with a 2-bit code and error feedback: the compressor of SparseLoCo (Sarfi et
al. 2025, arXiv:2508.15706), averaged by an all-gather or reduced on owners.

Each leaf is cut into chunks of ``C`` values; in every chunk the ``k`` values of largest
magnitude are kept, each as its position and 2 bits (a sign, and whether it exceeds half the
chunk's absmax ``M``), and decode to ``+-M/4`` or ``+-3M/4``. What was not sent stays in the
error feedback, ``e' = decay * e + x - c``. Sparse pairs cannot be summed on the way as a ring
allreduce sums dense values, so every rank all-gathers every rank's message and adds the decoded
vectors in rank order: every rank gets the same mean, bit for bit. That costs each rank ``W - 1``
messages; the owner-partitioned exchange (``fn.collectives.topk_owner``) about two, whatever
``W``. docs/algorithms.md, "DiLoCo: local steps and a compressed outer step" gives the code, the
messages and their bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fn.collectives._topk_code import (
    NON_FINITE,
    WHAT,
    Layout,
    check,
    check_kept,
    compress,
    exchange_checksum,
    finished,
    flattened,
    mean_of,
    size_checked,
)
from fn.collectives.comm import Comm
from fn.collectives.error_feedback import ParamShapedErrorFeedbackField
from fn.collectives.header import (
    HEADER_BYTES,
    Compressor,
    Exchanged,
    exchange_rows,
    flag_of,
    headers_only,
)
from fn.collectives.topk_owner import TopkOwnerState, owner_form
from fn.errors import check_int, finite_or_raise
from fn.tree import tree_leaves, tree_map, tree_unflatten

__all__ = [
    "TopkAllreduceState",
    "TopkOwnerState",
    "TOPK_EXCHANGES",
    "topk_allreduce",
    "topk_exchange_form",
    "topk_message_bytes",
]

TOPK_EXCHANGES = ("gather", "owner", "auto")
"""How :func:`topk_allreduce` exchanges its messages, one of ``"gather"`` (every rank
all-gathers every rank's message), ``"owner"`` (each rank reduces the chunks it owns and the
owners' results are all-gathered, :class:`TopkOwnerState`), ``"auto"``
(:func:`topk_exchange_form` chooses, at ``init``).

Example:
    >>> fn.collectives.TOPK_EXCHANGES
    ('gather', 'owner', 'auto')
"""


class TopkAllreduceState(NamedTuple):
    """The state of :func:`topk_allreduce` with ``exchange="gather"``.

    Attributes:
        error: per leaf, fp32 of the leaf's shape: what this rank has not sent yet (SparseLoCo's
            accumulator when ``decay < 1``).

    Example:
        >>> tx = fn.collectives.topk_allreduce(2, 8, comm=fn.collectives.Local())
        >>> tx.init({"w": torch.zeros(3)})
        TopkAllreduceState(error={'w': tensor([0., 0., 0.])})
    """

    error: ParamShapedErrorFeedbackField


def topk_message_bytes(chunks: int, k: int, chunk_size: int) -> int:
    """The bytes of one rank's message in :func:`topk_allreduce`: each chunk's positions in the
    Elias-Fano code (with ``L = floor(log2(chunk_size / k))``, the low ``L`` bits of every
    position, then a vector of ``k + floor(chunk_size / 2^L)`` bits that holds the rest), 2 bits
    per code, each of the three streams packed to whole bytes, and one fp32 scale per chunk.

    Args:
        chunks: the number of chunks, ``sum(ceil(leaf.numel() / chunk_size))`` over the leaves
            (an owner's share, ``ceil(chunks / W)``, in the ``"owner"`` exchange).
        k: the values kept per chunk.
        chunk_size: the values per chunk.

    Returns:
        ``ceil(chunks * k * L / 8) + ceil(chunks * (k + floor(chunk_size / 2^L)) / 8)
        + ceil(chunks * k / 4) + 4 * chunks``.

    Example:
        >>> fn.collectives.topk_message_bytes(chunks=1, k=32, chunk_size=4096)  # 28 + 8 + 8 + 4
        48
    """
    layout = Layout(chunks, k, chunk_size)
    return layout.position_bytes + layout.code_bytes + 4 * chunks


def topk_exchange_form(
    chunks: int,
    k: int,
    chunk_size: int,
    world_size: int,
    server_k: int | None = None,
    round_trip_bytes: int = 0,
) -> str:
    """The exchange ``"auto"`` chooses: ``"owner"`` where it sends fewer bytes per rank than
    ``"gather"`` by more than ``round_trip_bytes`` (the owners' exchange takes one round trip
    more), else ``"gather"``. With ``H`` = ``HEADER_BYTES``, ``B_k(c)`` =
    :func:`topk_message_bytes` of ``c`` chunks at ``k`` values each and ``m = ceil(c / W)``,
    an outer exchange sends (and receives) per rank

    .. math::
        \\text{gather: } (W - 1)\\,(H + B_k(c)), \\qquad
        \\text{owner: } (W - 1)\\,(2 H + B_k(m) + B_{k_s}(m)),

    so, with ``server_k = k`` and ``round_trip_bytes = 0``, ``"owner"`` wins from ``W = 3`` on,
    once the messages outweigh their headers (with ``server_k = 4 k``, from ``W = 5``). On a
    link where a round trip costs more than its bytes (bandwidth times latency: 10 Mbit/s and
    a 0.1 s collective are 125,000 bytes), ``round_trip_bytes`` keeps the all-gather until the
    owners save more than that.

    Args:
        chunks: the chunks of the live leaves, ``c``.
        k: values kept per chunk.
        chunk_size: values per chunk.
        world_size: ``W``.
        server_k: ``k_s``, the values an owner keeps per chunk (``None``: ``k``).
        round_trip_bytes: the bytes per rank that the owners' second round trip is worth.

    Returns:
        ``"owner"`` or ``"gather"``.

    Example:
        >>> from fn.collectives import topk_exchange_form
        >>> [topk_exchange_form(256, 32, 4096, w) for w in (2, 3, 64)]
        ['gather', 'owner', 'owner']
        >>> topk_exchange_form(3, 3, 16, 3)  # 3 chunks: the headers weigh more
        'gather'
        >>> [topk_exchange_form(256, 32, 4096, w, server_k=128) for w in (4, 5)]
        ['gather', 'owner']
        >>> [topk_exchange_form(38, 128, 4096, w, round_trip_bytes=125_000) for w in (8, 64)]
        ['gather', 'owner']
    """
    share = -(-chunks // world_size)
    gather = HEADER_BYTES + topk_message_bytes(chunks, k, chunk_size)
    owner = 2 * HEADER_BYTES + topk_message_bytes(share, k, chunk_size)
    owner += topk_message_bytes(share, k if server_k is None else server_k, chunk_size)
    return "owner" if (world_size - 1) * (gather - owner) > round_trip_bytes else "gather"


def topk_allreduce(
    k: int = 64,
    chunk_size: int = 4096,
    *,
    comm: Comm,
    decay: float = 1.0,
    exchange: str = "gather",
    server_k: int | None = None,
    round_trip_bytes: int = 0,
) -> Compressor:
    """The mean over the ranks of every rank's chunk-wise top-``k`` in a 2-bit code, with error
    feedback: SparseLoCo's compressor.

    Per leaf and rank, with ``e`` the stored error (fp32):

    .. math::
        v = \\mathrm{decay} \\cdot e + u, \\qquad c = T(v), \\qquad e' = v - c, \\qquad
        u \\leftarrow \\frac{1}{W} \\big(((0 + c_0) + c_1) + \\dots + c_{W-1}\\big)

    where ``T`` keeps, in every chunk of ``chunk_size`` values (the leaf flattened, the last
    chunk zero-padded), the ``k`` values of largest magnitude (ties to the lower position) as
    ``s (1 + 2 l) M / 4``: ``M`` the chunk's absmax, ``s`` the value's sign, ``l`` whether its
    magnitude exceeds ``M / 2``. Every rank all-gathers a 12-byte size record (checked on every
    rank), then every rank's message (:func:`topk_message_bytes` of the live leaves' chunks) and
    adds the decoded vectors in rank order: the same result on every rank. ``decay=1`` is plain
    error feedback; ``decay=beta < 1`` makes the error SparseLoCo's accumulator ``beta e +
    delta``. ``None`` and empty leaves pass through with their errors unchanged; with ``W == 1``
    the result is this rank's ``c`` (nothing is sent).

    ``update(..., participation=fn.collectives.Participation(takes_part, n))``: a rank that
    sits out sends an all-zero message (scales 0; its input is not read) and keeps its error
    as it was (``e' = e``, not decayed); the sum is divided by ``n``.

    ``exchange="owner"`` partitions the chunks over the ranks instead: each rank sends each
    owner that owner's chunks of its message (an all_to_all), the owner adds them in rank
    order, divides by ``W``, compresses the mean again with ``T`` (keeping ``server_k`` values
    per chunk) and an error feedback of its own (the server error, :class:`TopkOwnerState`),
    and the owners' messages are all-gathered: each rank moves about two messages' bytes
    whatever ``W``, at the cost of a second compression (fn/collectives/topk_owner.py). A
    ``server_k`` above ``k`` makes that second compression lose less, for ``server_k / k``
    times the bytes of the owners' messages. ``exchange="auto"`` picks one of the two at
    ``init``, by their bytes and the worth of a round trip (:func:`topk_exchange_form`). The
    :class:`Compressor`'s ``exchange`` is the same estimate with this rank's flag and the size
    record in a header on its messages (fn/collectives/header.py), no collective of their own.

    Args:
        k: values kept per chunk, from 1 to ``chunk_size``.
        chunk_size: values per chunk, a power of two from 2 to 2^16.
        comm: the communicator.
        decay: the error's factor before the new input is added, in [0, 1].
        exchange: one of :data:`TOPK_EXCHANGES`.
        server_k: the values an owner keeps per chunk, from 1 to ``chunk_size`` (``None``:
            ``k``); only with ``exchange`` ``"owner"`` or ``"auto"``.
        round_trip_bytes: with ``exchange="auto"``, the bytes per rank that the owners' second
            round trip is worth on the link (an int >= 0; 0: bytes alone decide).

    Returns:
        A :class:`Compressor` with state :class:`TopkAllreduceState` (or
        :class:`TopkOwnerState`); the results are fp32 values cast to each leaf's dtype.

    Raises:
        ValueError: for settings out of range; from ``update``, on every rank and with the
            state unchanged, if the ranks' leaves, ``k`` or ``chunk_size`` differ (before any
            message is sent) or some rank's ``decay * e + u`` is not finite
            (``fn.NonFiniteError``).

    Example:
        >>> from fn.collectives import Simulated, simulate, topk_allreduce
        >>> comm = Simulated(2)
        >>> tx = topk_allreduce(k=1, chunk_size=4, comm=comm)
        >>> grads = {"w": torch.tensor([[4.0, -1.0, 0.5, 0.0], [0.0, 1.0, -4.0, 2.0]])}
        >>> state = simulate(tx.init, comm)(grads)
        >>> updates, state = simulate(tx.update, comm)(grads, state)
        >>> updates["w"][0]  # rank 0 sent 3 M/4 = 3 at position 0, rank 1 -3 at position 2
        tensor([ 1.5000,  0.0000, -1.5000,  0.0000])
        >>> state.error["w"]  # what each rank keeps for later
        tensor([[ 1.0000, -1.0000,  0.5000,  0.0000],
                [ 0.0000,  1.0000, -1.0000,  2.0000]])
    """
    check(k, chunk_size, decay)
    if exchange not in TOPK_EXCHANGES:
        raise ValueError(
            f"{WHAT}: exchange must be one of {', '.join(TOPK_EXCHANGES)}, got {exchange!r}"
        )
    if server_k is not None and exchange == "gather":
        raise ValueError(f"{WHAT}: server_k is the owners' k; exchange='gather' has no owners")
    server_k = k if server_k is None else server_k
    check_kept("server_k", server_k, chunk_size)
    check_int(f"{WHAT}: round_trip_bytes", round_trip_bytes)
    if round_trip_bytes and exchange != "auto":
        raise ValueError(f"{WHAT}: round_trip_bytes weighs the forms of exchange='auto' only")
    gather = _gather_form(k, chunk_size, comm, decay)
    if exchange == "gather":
        return gather
    owner = owner_form(k, chunk_size, comm, decay, server_k)
    if exchange == "owner":
        return owner

    def init_fn(params):
        chunks = sum(-(-x.numel() // chunk_size) for x in tree_leaves(params) if x is not None)
        form = topk_exchange_form(
            chunks, k, chunk_size, comm.world_size, server_k, round_trip_bytes
        )
        return (owner if form == "owner" else gather).init(params)

    def form_of(state):
        return owner if isinstance(state, TopkOwnerState) else gather

    def update_fn(updates, state, *args, **extra):
        return form_of(state).update(updates, state, *args, **extra)

    def exchange_fn(updates, state, *args, **extra):
        return form_of(state).exchange(updates, state, *args, **extra)

    return Compressor(init_fn, update_fn, exchange_fn)


def _gather_form(k: int, chunk_size: int, comm: Comm, decay: float) -> Compressor:
    """``topk_allreduce``'s all-gather exchange."""

    def init_fn(params):
        return TopkAllreduceState(
            tree_map(lambda p: torch.zeros(p.shape, dtype=torch.float32, device=p.device), params)
        )

    def update_fn(updates, state, params=None, *, participation=None, **extra):
        del params, extra
        leaves, spec, errors, live = flattened(updates, state)
        if not live:
            return updates, state
        takes_part = None if participation is None else participation.takes_part
        worked = compress(leaves, errors, live, k, chunk_size, decay, takes_part)
        layout = Layout(worked.mine.scales.numel(), k, chunk_size)
        message = layout.encode(worked.mine).view(-1)
        received = comm.all_gather(size_checked(comm, message, leaves, live, k, chunk_size))
        finite_or_raise(layout.scales(received), NON_FINITE)
        mean = mean_of(received, layout, chunk_size, comm.world_size, participation)
        taking = torch.ones((), dtype=torch.bool) if takes_part is None else takes_part
        out, new_errors = finished(worked, taking, mean, leaves, errors, live, chunk_size)
        return tree_unflatten(out, spec), TopkAllreduceState(tree_unflatten(new_errors, spec))

    def exchange_fn(updates, state, flag=None, params=None, *, extra=()):
        del params
        leaves, spec, errors, live = flattened(updates, state)
        if not live:
            return headers_only(comm, updates, state, flag, WHAT, extra)
        offered = flag_of(flag)
        worked = compress(leaves, errors, live, k, chunk_size, decay, offered)
        flag = offered & torch.isfinite(worked.mine.scales).all()
        layout = Layout(worked.mine.scales.numel(), k, chunk_size)
        n = sum(leaves[i].numel() for i in live)
        checksum = exchange_checksum(leaves, live, k, chunk_size)
        message = torch.where(flag, layout.encode(worked.mine), 0)
        got, part = exchange_rows(comm, message, flag, n, WHAT, checksum, extra=extra)
        mean = mean_of(got.payload, layout, chunk_size, comm.world_size, part)
        out, new_errors = finished(worked, flag, mean, leaves, errors, live, chunk_size)
        new_state = TopkAllreduceState(tree_unflatten(new_errors, spec))
        return Exchanged(tree_unflatten(out, spec), new_state, got.flags, got.extra)

    return Compressor(init_fn, update_fn, exchange_fn)
