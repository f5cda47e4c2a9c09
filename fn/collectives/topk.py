"""Chunk-wise top-k with a 2-bit code and error feedback, averaged by an all-gather: the
compressor of SparseLoCo (Sarfi et al. 2025, arXiv:2508.15706).

Each leaf is cut into chunks of ``C`` values; in every chunk the ``k`` values of largest
magnitude are kept, each as its position and 2 bits (a sign, and whether it exceeds half the
chunk's absmax ``M``), and decode to ``+-M/4`` or ``+-3M/4``. What was not sent stays in the
error feedback, ``e' = decay * e + x - c``. Sparse pairs cannot be summed on the way as a ring
allreduce sums dense values, so every rank all-gathers every rank's message and adds the decoded
vectors in rank order: every rank gets the same mean, bit for bit. docs/algorithms.md, "DiLoCo:
local steps and a compressed outer step" gives the code, the message and its bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fn.base import GradientTransformation
from fn.collectives import _sizes
from fn.collectives.comm import Comm
from fn.collectives.error_feedback import ErrorFeedbackField
from fn.collectives.participation import Participation, kept, participants_mean, sent
from fn.errors import check_nonnegative, finite_or_raise
from fn.tree import tree_flatten, tree_map, tree_unflatten

__all__ = ["TopkAllreduceState", "topk_allreduce", "topk_message_bytes"]

_WHAT = "topk_allreduce"
_MAX_CHUNK = 2**16  # a position and the magnitude's 31 bits share one int64 key


class TopkAllreduceState(NamedTuple):
    """The state of :func:`topk_allreduce`.

    Attributes:
        error: per leaf, fp32 of the leaf's shape: what this rank has not sent yet (SparseLoCo's
            accumulator when ``decay < 1``).

    Example:
        >>> tx = fn.collectives.topk_allreduce(2, 8, comm=fn.collectives.Local())
        >>> tx.init({"w": torch.zeros(3)})
        TopkAllreduceState(error={'w': tensor([0., 0., 0.])})
    """

    error: ErrorFeedbackField


class _Sparse(NamedTuple):
    """One rank's compressed chunks: ``c`` chunks of ``k`` kept values."""

    positions: torch.Tensor  # int64 [c, k], each kept value's position in its chunk
    codes: torch.Tensor  # int64 [c, k], 2 bits: sign (MSB), level
    scales: torch.Tensor  # fp32 [c], the chunk's absmax M


def topk_message_bytes(chunks: int, k: int, chunk_size: int) -> int:
    """The bytes of one rank's message in :func:`topk_allreduce`: ``log2(chunk_size)`` bits per
    position and 2 bits per code, each stream packed to whole bytes, and one fp32 scale per
    chunk.

    Args:
        chunks: the number of chunks, ``sum(ceil(leaf.numel() / chunk_size))`` over the leaves.
        k: the values kept per chunk.
        chunk_size: the values per chunk.

    Returns:
        ``ceil(chunks * k * log2(chunk_size) / 8) + ceil(chunks * k / 4) + 4 * chunks``.

    Example:
        >>> fn.collectives.topk_message_bytes(chunks=1, k=32, chunk_size=4096)  # 48 + 8 + 4
        60
    """
    width = chunk_size.bit_length() - 1
    return -(-chunks * k * width // 8) + -(-chunks * k // 4) + 4 * chunks


def _check(k: int, chunk_size: int, decay: float) -> None:
    if not isinstance(chunk_size, int) or not 2 <= chunk_size <= _MAX_CHUNK:
        raise ValueError(f"{_WHAT}: chunk_size must be an int from 2 to 2^16, got {chunk_size!r}")
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"{_WHAT}: chunk_size must be a power of two, got {chunk_size}")
    if not isinstance(k, int) or not 1 <= k <= chunk_size:
        raise ValueError(f"{_WHAT}: k must be an int from 1 to chunk_size={chunk_size}, got {k!r}")
    check_nonnegative(_WHAT, decay=decay)
    if decay > 1.0:
        raise ValueError(f"{_WHAT}: decay must be in [0, 1], got {decay}")


def _select(chunks: torch.Tensor, k: int) -> _Sparse:
    """The ``k`` values of largest magnitude of every row of ``chunks`` (fp32 ``[c, C]``), ties
    to the lower position, in the 2-bit code."""
    size = chunks.shape[-1]
    magnitude = chunks.abs()
    # distinct keys: the magnitude's bits (ordered as the values for non-negative floats), then
    # the position reversed, so that topk's choice among equal magnitudes is defined
    reversed_position = size - 1 - torch.arange(size, device=chunks.device)
    keys = (magnitude.view(torch.int32).long() << 16) | reversed_position
    positions = keys.topk(k, dim=-1).indices
    kept = chunks.gather(-1, positions)
    scales = magnitude.amax(dim=-1)
    level = kept.abs() > (scales * 0.5).unsqueeze(-1)
    return _Sparse(positions, (kept < 0).long() * 2 + level.long(), scales)


def _values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The decoded kept values, fp32 ``[c, k]``: ``+-M/4`` or ``+-3M/4``."""
    scale = scales.unsqueeze(-1)
    magnitude = torch.where((codes & 1) == 1, scale * 0.75, scale * 0.25)
    return torch.where(codes >= 2, -magnitude, magnitude)


def _pack(fields: torch.Tensor, width: int) -> torch.Tensor:
    """``width`` bits of every element of the int64 ``fields``, MSB first, packed into bytes
    (the last byte zero-padded)."""
    shifts = torch.arange(width - 1, -1, -1, device=fields.device)
    bits = ((fields.reshape(-1, 1) >> shifts) & 1).reshape(-1)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8)).view(-1, 8)
    return (bits << torch.arange(7, -1, -1, device=fields.device)).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The first ``count`` fields of ``width`` bits that :func:`_pack` packed, int64."""
    bits = (packed.long().unsqueeze(-1) >> torch.arange(7, -1, -1, device=packed.device)) & 1
    bits = bits.reshape(-1)[: count * width].view(count, width)
    return (bits << torch.arange(width - 1, -1, -1, device=packed.device)).sum(-1)


class _Layout(NamedTuple):
    """Where the parts of one message lie: ``c`` chunks of ``k`` values, positions of ``width``
    bits."""

    chunks: int
    k: int
    width: int

    @property
    def position_bytes(self) -> int:
        return -(-self.chunks * self.k * self.width // 8)

    @property
    def code_bytes(self) -> int:
        return -(-self.chunks * self.k // 4)

    def encode(self, sparse: _Sparse) -> torch.Tensor:
        scales = sparse.scales.contiguous().view(torch.uint8)
        positions = _pack(sparse.positions, self.width)
        return torch.cat([positions, _pack(sparse.codes, 2), scales])

    def scales(self, message: torch.Tensor) -> torch.Tensor:
        start = self.position_bytes + self.code_bytes
        scales = message[..., start:].clone(memory_format=torch.contiguous_format)
        return scales.view(torch.float32)  # a copy: 4-byte aligned

    def decode(self, message: torch.Tensor) -> _Sparse:
        count, shape = self.chunks * self.k, (self.chunks, self.k)
        positions = _unpack(message[: self.position_bytes], count, self.width).view(shape)
        codes = message[self.position_bytes : self.position_bytes + self.code_bytes]
        return _Sparse(positions, _unpack(codes, count, 2).view(shape), self.scales(message))


def topk_allreduce(
    k: int = 64, chunk_size: int = 4096, *, comm: Comm, decay: float = 1.0
) -> GradientTransformation:
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

    Args:
        k: values kept per chunk, from 1 to ``chunk_size``.
        chunk_size: values per chunk, a power of two from 2 to 2^16.
        comm: the communicator.
        decay: the error's factor before the new input is added, in [0, 1].

    Returns:
        A GradientTransformation with state :class:`TopkAllreduceState`; the results are fp32
        values cast to each leaf's dtype.

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
    _check(k, chunk_size, decay)
    width = chunk_size.bit_length() - 1

    def init_fn(params):
        return TopkAllreduceState(
            tree_map(lambda p: torch.zeros(p.shape, dtype=torch.float32, device=p.device), params)
        )

    def update_fn(updates, state, params=None, *, participation=None, **extra):
        del params, extra
        leaves, spec = tree_flatten(updates)
        errors = spec.flatten_up_to(state.error)
        live = [i for i, u in enumerate(leaves) if u is not None and u.numel() > 0]
        if not live:
            return updates, state
        if any(errors[i] is None for i in live):
            raise ValueError(f"{_WHAT}: an update leaf has no error state")
        v = {i: errors[i] * decay + sent(leaves[i], participation).float() for i in live}
        per_leaf = [_select(_chunked(v[i], chunk_size), k) for i in live]
        mine = _Sparse(*(torch.cat(parts) for parts in zip(*per_leaf, strict=True)))
        mine = _silenced(mine, participation)
        layout = _Layout(mine.scales.numel(), k, width)
        received = _exchange(comm, layout.encode(mine), leaves, live, k, chunk_size)
        finite_or_raise(
            layout.scales(received),
            f"{_WHAT}: non-finite values in some rank's input (or its error feedback); the "
            "state is unchanged",
        )
        own_chunks = _dense(mine, layout, chunk_size)
        total = torch.zeros_like(own_chunks)
        for rank in range(comm.world_size):
            total = total + _dense(layout.decode(received[rank]), layout, chunk_size)
        mean = participants_mean(total, comm.world_size, participation)
        out, new_errors, chunk = list(leaves), list(errors), 0
        for i in live:
            numel, shape = leaves[i].numel(), leaves[i].shape
            rows = -(-numel // chunk_size)
            own = own_chunks[chunk : chunk + rows].reshape(-1)[:numel].view(shape)
            new_errors[i] = kept(v[i] - own, errors[i], participation)
            out[i] = mean[chunk : chunk + rows].reshape(-1)[:numel].view(shape).to(leaves[i].dtype)
            chunk += rows
        return tree_unflatten(out, spec), TopkAllreduceState(tree_unflatten(new_errors, spec))

    return GradientTransformation(init_fn, update_fn)


def _silenced(mine: _Sparse, participation: Participation | None) -> _Sparse:
    """This rank's message, or where it sits out, an all-zero one (scales 0: it decodes to
    zeros)."""
    if participation is None:
        return mine
    return _Sparse(*(torch.where(participation.takes_part, x, 0) for x in mine))


def _chunked(v: torch.Tensor, chunk_size: int) -> torch.Tensor:
    flat = v.reshape(-1)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % chunk_size)).view(-1, chunk_size)


def _dense(sparse: _Sparse, layout: _Layout, chunk_size: int) -> torch.Tensor:
    """The decoded chunks, fp32 ``[c, C]``, zero where nothing was kept."""
    values = _values(sparse.codes, sparse.scales)
    zeros = values.new_zeros(layout.chunks, chunk_size)
    return zeros.scatter(-1, sparse.positions, values)


def _exchange(
    comm: Comm,
    message: torch.Tensor,
    leaves: list,
    live: list[int],
    k: int,
    chunk_size: int,
) -> torch.Tensor:
    """Every rank's message, ``[W, bytes]``, once every rank's size record (the live leaves'
    sizes, ``k`` and ``chunk_size``) matched this rank's."""
    n = sum(leaves[i].numel() for i in live)
    layout = [(i, leaves[i].numel()) for i in live] + [(-1, k), (-2, chunk_size)]
    checksum = _sizes.layout_checksum(layout)
    record = _sizes.with_count(message.new_empty(0, dtype=torch.float32), n, checksum)
    message = _sizes.released(message, comm.all_gather(record), n, _WHAT, checksum)
    return comm.all_gather(message)
