"""The chunk-wise top-k 2-bit code of ``fn.collectives.topk``: selection, packing, the message
layout, and the worker side shared by its two exchanges (docs/algorithms.md, "DiLoCo: local
steps and a compressed outer step")."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fn.collectives import _sizes
from fn.collectives.comm import Comm
from fn.collectives.participation import Participation, participants_mean, sent
from fn.errors import check_closed_fraction
from fn.tree import tree_flatten

WHAT = "topk_allreduce"
NON_FINITE = (
    f"{WHAT}: non-finite values in some rank's input (or its error feedback); the state is "
    "unchanged"
)
_MAX_CHUNK = 2**16  # a position and the magnitude's 31 bits share one int64 key


class Sparse(NamedTuple):
    """Compressed chunks: ``c`` chunks of ``k`` kept values."""

    positions: torch.Tensor  # int64 [c, k], the kept values' positions in their chunk, ascending
    codes: torch.Tensor  # int64 [c, k], 2 bits: sign (MSB), level
    scales: torch.Tensor  # fp32 [c], the chunk's absmax M


def check(k: int, chunk_size: int, decay: float) -> None:
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int)
        or not 2 <= chunk_size <= _MAX_CHUNK
    ):
        raise ValueError(f"{WHAT}: chunk_size must be an int from 2 to 2^16, got {chunk_size!r}")
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"{WHAT}: chunk_size must be a power of two, got {chunk_size}")
    check_kept("k", k, chunk_size)
    check_closed_fraction(WHAT, decay=decay)


def check_kept(name: str, value: int, chunk_size: int) -> None:
    """``value`` (``k``, or the owners' ``server_k``) is a count of values kept per chunk."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= chunk_size:
        raise ValueError(
            f"{WHAT}: {name} must be an int from 1 to chunk_size={chunk_size}, got {value!r}"
        )


def select(chunks: torch.Tensor, k: int) -> Sparse:
    """The ``k`` values of largest magnitude of every row of ``chunks`` (fp32 ``[c, C]``), ties
    to the lower position, in the 2-bit code, their positions ascending in each row."""
    size = chunks.shape[-1]
    magnitude = chunks.abs()
    # distinct keys: the magnitude's bits (ordered as the values for non-negative floats), then
    # the position reversed, so that topk's choice among equal magnitudes is defined
    reversed_position = size - 1 - torch.arange(size, device=chunks.device)
    keys = (magnitude.view(torch.int32).long() << 16) | reversed_position
    positions = keys.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
    kept = chunks.gather(-1, positions)
    scales = magnitude.amax(dim=-1)
    level = kept.abs() > (scales * 0.5).unsqueeze(-1)
    return Sparse(positions, (kept < 0).long() * 2 + level.long(), scales)


def _values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The decoded kept values, fp32 ``[c, k]``: ``+-M/4`` or ``+-3M/4``."""
    scale = scales.unsqueeze(-1)
    magnitude = torch.where((codes & 1) == 1, scale * 0.75, scale * 0.25)
    return torch.where(codes >= 2, -magnitude, magnitude)


def _pack(fields: torch.Tensor, width: int) -> torch.Tensor:
    """``width`` bits of every element of each row of the int64 ``fields`` (``[rows, count]``),
    MSB first, packed into bytes per row (each row's last byte zero-padded)."""
    shifts = torch.arange(width - 1, -1, -1, device=fields.device)
    bits = ((fields.unsqueeze(-1) >> shifts) & 1).flatten(-2)
    bits = torch.nn.functional.pad(bits, (0, -bits.shape[-1] % 8)).unflatten(-1, (-1, 8))
    return (bits << torch.arange(7, -1, -1, device=fields.device)).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The first ``count`` fields of ``width`` bits that :func:`_pack` packed into one row,
    int64."""
    bits = (packed.long().unsqueeze(-1) >> torch.arange(7, -1, -1, device=packed.device)) & 1
    bits = bits.reshape(-1)[: count * width].view(count, width)
    return (bits << torch.arange(width - 1, -1, -1, device=packed.device)).sum(-1)


class Layout(NamedTuple):
    """Where the parts of one message lie: ``c`` chunks of ``k`` values, each chunk's positions
    in the Elias-Fano code, then the codes, then the fp32 scales.

    With ``L = floor(log2(C / k))`` and ``p_0 < ... < p_{k-1}`` a chunk's positions, the chunk's
    low part is ``p_i mod 2^L`` in ``L`` bits each and its high part a vector of
    ``k + floor(C / 2^L)`` bits, bit ``floor(p_i / 2^L) + i`` set for every ``i``: ``k L + k +
    floor(C / 2^L)`` bits a chunk, whatever the positions. All chunks' low parts are one stream
    of whole bytes, their high parts the next.
    """

    chunks: int
    k: int
    chunk_size: int

    @property
    def low(self) -> int:
        """``L``, the bits of a position kept as they are."""
        return (self.chunk_size // self.k).bit_length() - 1

    @property
    def high_bits(self) -> int:
        """The bits of a chunk's high part, ``k + floor(C / 2^L)``."""
        return self.k + (self.chunk_size >> self.low)

    @property
    def low_bytes(self) -> int:
        return -(-self.chunks * self.k * self.low // 8)

    @property
    def position_bytes(self) -> int:
        return self.low_bytes + -(-self.chunks * self.high_bits // 8)

    @property
    def code_bytes(self) -> int:
        return -(-self.chunks * self.k // 4)

    def encode(self, sparse: Sparse, rows: int = 1) -> torch.Tensor:
        """``rows`` messages of :attr:`chunks` chunks each (``sparse`` holds ``rows`` times as
        many, their positions ascending in each chunk), uint8 ``[rows, bytes]``."""
        positions = sparse.positions
        rank = torch.arange(self.k, device=positions.device)
        high = positions.new_zeros(positions.shape[0], self.high_bits)
        high = high.scatter(-1, (positions >> self.low) + rank, 1)
        low = positions & ((1 << self.low) - 1)
        scales = sparse.scales.contiguous().view(torch.uint8).view(rows, -1)
        parts = [
            _pack(low.reshape(rows, -1), self.low),
            _pack(high.reshape(rows, -1), 1),
            _pack(sparse.codes.reshape(rows, -1), 2),
            scales,
        ]
        return torch.cat(parts, dim=1)

    def scales(self, message: torch.Tensor) -> torch.Tensor:
        start = self.position_bytes + self.code_bytes
        scales = message[..., start:].clone(memory_format=torch.contiguous_format)
        return scales.view(torch.float32)  # a copy: 4-byte aligned

    def decode(self, message: torch.Tensor) -> Sparse:
        """The chunks of one message, uint8 ``[bytes]``; their positions ascending."""
        count, shape = self.chunks * self.k, (self.chunks, self.k)
        low = _unpack(message[: self.low_bytes], count, self.low).view(shape)
        high = message[self.low_bytes : self.position_bytes]
        high = _unpack(high, self.chunks * self.high_bits, 1).view(self.chunks, self.high_bits)
        # a stable sort puts the k set bits first, in their order; an all-zero message (a rank
        # that sat out) yields positions 0, with scales 0
        ones = high.sort(dim=-1, descending=True, stable=True).indices[:, : self.k]
        rank = torch.arange(self.k, device=message.device)
        positions = ((ones - rank) << self.low) | low
        codes = message[self.position_bytes : self.position_bytes + self.code_bytes]
        return Sparse(positions, _unpack(codes, count, 2).view(shape), self.scales(message))


def chunked(v: torch.Tensor, chunk_size: int) -> torch.Tensor:
    flat = v.reshape(-1)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % chunk_size)).view(-1, chunk_size)


def dense(sparse: Sparse, chunk_size: int) -> torch.Tensor:
    """The decoded chunks, fp32 ``[c, C]``, zero where nothing was kept."""
    values = _values(sparse.codes, sparse.scales)
    zeros = values.new_zeros(sparse.scales.numel(), chunk_size)
    return zeros.scatter(-1, sparse.positions, values)


def padded(sparse: Sparse, chunks: int) -> Sparse:
    """``sparse`` with all-zero chunks appended up to ``chunks`` (positions 0, codes 0, scales
    0: they decode to zeros)."""
    extra = chunks - sparse.scales.numel()
    pad = torch.nn.functional.pad
    return Sparse(*(pad(x, (0, 0) * (x.dim() - 1) + (0, extra)) for x in sparse))


def flattened(updates, state) -> tuple[list, object, list, list[int]]:
    """The update's leaves, their spec, the state's errors flattened as them and the positions
    of the leaves that communicate (not ``None``, not empty)."""
    leaves, spec = tree_flatten(updates)
    live = [i for i, u in enumerate(leaves) if u is not None and u.numel() > 0]
    return leaves, spec, spec.flatten_up_to(state.error), live


class Compressed(NamedTuple):
    """The worker side on one rank: ``v = decay e + u`` per live leaf and its chunks' code."""

    v: dict[int, torch.Tensor]
    mine: Sparse


def compress(
    leaves: list,
    errors: list,
    live: list[int],
    k: int,
    chunk_size: int,
    decay: float,
    takes_part: torch.Tensor | None = None,
) -> Compressed:
    """``v`` and the chunk-wise top-``k`` of every live leaf (its chunks in leaf order). Where
    ``takes_part`` is ``False`` the input is not read (``v = decay e``) and the message is
    all zeros (scales 0: it decodes to zeros)."""
    if any(errors[i] is None for i in live):
        raise ValueError(f"{WHAT}: an update leaf has no error state")
    if not live:  # nothing to send: a message of no chunks
        positions = torch.zeros(0, k, dtype=torch.int64)
        return Compressed({}, Sparse(positions, positions, torch.zeros(0)))
    part = None if takes_part is None else Participation(takes_part, takes_part.long())
    v = {i: errors[i] * decay + sent(leaves[i], part).float() for i in live}
    per_leaf = [select(chunked(v[i], chunk_size), k) for i in live]
    mine = Sparse(*(torch.cat(parts) for parts in zip(*per_leaf, strict=True)))
    return Compressed(v, mine if part is None else Sparse(*sent(tuple(mine), part)))


def cut(rows: torch.Tensor, leaves: list, live: list[int], chunk_size: int) -> list[torch.Tensor]:
    """The decoded chunks ``rows`` (fp32 ``[>= c, C]``) cut back to each live leaf's shape."""
    out, chunk = [], 0
    for i in live:
        numel = leaves[i].numel()
        count = -(-numel // chunk_size)
        out.append(rows[chunk : chunk + count].reshape(-1)[:numel].view(leaves[i].shape))
        chunk += count
    return out


def valid_positions(leaves: list, live: list[int], chunk_size: int, chunks: int) -> torch.Tensor:
    """Bool ``[chunks, C]``: ``True`` where a position of the padded chunks holds a value of a
    live leaf (``False`` in each leaf's last chunk's padding and in appended chunks)."""
    device = leaves[live[0]].device
    ones = [torch.ones(leaves[i].numel(), dtype=torch.bool, device=device) for i in live]
    mask = torch.cat([chunked(x, chunk_size) for x in ones])
    return torch.nn.functional.pad(mask, (0, 0, 0, chunks - mask.shape[0]))


def exchange_checksum(
    leaves: list, live: list[int], k: int, chunk_size: int, server_k: int = 0
) -> int:
    """The checksum an exchange's header carries: the live leaves' sizes, ``k``, ``chunk_size``
    and the owners' ``server_k`` (0 for the all-gather, which has no owners)."""
    settings = [(-1, k), (-2, chunk_size), (-3, server_k)]
    return _sizes.layout_checksum([(i, leaves[i].numel()) for i in live] + settings)


def mean_of(
    received: torch.Tensor,
    layout: Layout,
    chunk_size: int,
    world_size: int,
    participation: Participation | None = None,
) -> torch.Tensor:
    """The decoded messages ``received`` (``[W, bytes]``) added into zeros in rank order, over
    ``W`` (or over the ``n`` ranks that take part): fp32 ``[c, C]``."""
    total = torch.zeros(layout.chunks, chunk_size, device=received.device)
    for rank in range(world_size):
        total = total + dense(layout.decode(received[rank]), chunk_size)
    return participants_mean(total, world_size, participation)


def size_checked(
    comm: Comm, x: torch.Tensor, leaves: list, live: list[int], k: int, chunk_size: int
) -> torch.Tensor:
    """``x`` (or a copy, under vmap or ``torch.compile``), once every rank's size record (the
    live leaves' sizes, ``k`` and ``chunk_size``: 12 bytes, all-gathered) matched this rank's."""
    n = sum(leaves[i].numel() for i in live)
    layout = [(i, leaves[i].numel()) for i in live] + [(-1, k), (-2, chunk_size)]
    checksum = _sizes.layout_checksum(layout)
    record = _sizes.with_count(torch.zeros(0, device=x.device), n, checksum)
    return _sizes.released(x, comm.all_gather(record), n, WHAT, checksum)


def finished(
    worked: Compressed,
    flag: torch.Tensor,
    result: torch.Tensor,
    leaves: list,
    errors: list,
    live: list[int],
    chunk_size: int,
) -> tuple[list, list]:
    """Every leaf's result (the decoded chunks ``result``, in its dtype) and its new error
    (``v - c`` where ``flag``, else the old one), ``None`` and empty leaves as they were."""
    sent = cut(dense(worked.mine, chunk_size), leaves, live, chunk_size)
    out, new_errors = list(leaves), list(errors)
    for i, mean, own in zip(live, cut(result, leaves, live, chunk_size), sent, strict=True):
        new_errors[i] = torch.where(flag, worked.v[i] - own, errors[i])
        out[i] = mean.to(leaves[i].dtype)
    return out, new_errors
