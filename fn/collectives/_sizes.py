"""Size records: what the compressed collectives send so that ranks whose sizes differ raise.

Every rank must pass a tensor of the same size; one that does not would get results of another
shape or mix unrelated chunks, and with gloo a message longer than the receive posted for it
aborts the process. So each rank sends a record of its call's size in the first exchange of
every call, and every receiver checks the records before it uses anything: a mismatch is the
same ``ValueError`` on every rank, at no extra collective. A record is the element count ``n``
as two exact fp32 digits ``(n // 2^24, n % 2^24)`` (exact up to ``2^48``), followed, for the
quantized collectives, by a checksum of the call's layout (:func:`layout_checksum`, 24 bits:
exact in fp32) that tells apart calls whose other tensors differ.

The 1-bit allreduce appends the record to the one scale it all-gathers: a message of fixed size.
The quantized collectives' scales grow with ``n``, so their records travel first, on their own
(fixed size, every rank's to every rank), and the scales then travel with the codes; point to
point, the count goes first and the checksum after the chunks (whose sizes it does not set).

The check reads tensor values, so under vmap (``Simulated``) and ``torch.compile`` it runs as a
custom op (as ``fn.errors.finite_or_raise``) that returns a copy of a tensor that the call
goes on with: the check stays in the compiled graph and before everything that depends on it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fn.collectives._sim_ops import stack_ranks
from fn.tree import eager

_DIGIT = 2**24  # every integer below 2^24 is exact in fp32


def layout_checksum(layout: Iterable[tuple[int, int]]) -> int:
    """A 24-bit checksum of ``(position, element count)`` of every tensor a call reduces: 32-bit
    FNV-1a over their 8-byte little-endian values, folded (plain integer arithmetic, which
    ``torch.compile`` evaluates while tracing).

    Example:
        >>> from fn.collectives._sizes import layout_checksum
        >>> layout_checksum([(0, 300), (2, 64)]) == layout_checksum([(0, 300), (1, 64)])
        False
    """
    checksum = 0x811C9DC5
    for position, numel in layout:
        for value in (position, int(numel)):
            for shift in range(0, 64, 8):
                checksum = ((checksum ^ ((value >> shift) & 0xFF)) * 0x01000193) % 2**32
    return ((checksum >> 24) ^ checksum) % _DIGIT


def with_count(scales: torch.Tensor, n: int, checksum: int | None = None) -> torch.Tensor:
    """``scales`` (``[rows, k]``, ``k`` may be 0) with the record of ``n`` (and ``checksum``)
    appended to every row."""
    record = [n // _DIGIT, n % _DIGIT] + ([] if checksum is None else [checksum])
    digits = torch.tensor(record, dtype=torch.float32, device=scales.device)
    return torch.cat([scales, digits.expand(*scales.shape[:-1], len(record))], dim=-1)


def checked_scales(
    received: torch.Tensor, n: int, what: str, checksum: int | None = None
) -> torch.Tensor:
    """The scales of ``received`` (``[rows, k + record]``, row ``i`` from the ``i``-th rank of
    the exchange) without the records; raises ``ValueError`` unless every row carries the
    record of ``n`` (and ``checksum``)."""
    width = 2 if checksum is None else 3
    return released(received[..., :-width], received[..., -width:], n, what, checksum)


def released(
    x: torch.Tensor, records: torch.Tensor, n: int, what: str, checksum: int | None = None
) -> torch.Tensor:
    """``x`` (eager) or a copy of it (under vmap or ``torch.compile``), once every row of
    ``records`` (row ``i`` from the ``i``-th rank) is the record of ``n`` (and ``checksum``).

    Raises:
        ValueError: on a mismatch, naming every rank's count (the same message on every rank
            that received the same records).
    """
    if not eager(x, records):
        return _released_op(x, records, n, what, -1 if checksum is None else checksum)
    check(records, n, what, checksum)
    return x


def check(records: torch.Tensor, n: int, what: str, checksum: int | None = None) -> None:
    """Raises ``ValueError`` unless every row of ``records`` (``[rows, record]``, eager) is the
    record of ``n`` (and ``checksum``)."""
    records = records.double()
    counts = records[..., 0] * _DIGIT + records[..., 1]
    matches = counts == n
    if checksum is not None:
        matches &= records[..., 2] == checksum
    if bool(matches.all()):
        return
    counts = counts.reshape(-1, records.shape[-2])[0].tolist()
    shown = ", ".join(f"rank {i}: {int(c)} elements" for i, c in enumerate(counts))
    if len(set(counts)) > 1:
        raise ValueError(
            f"{what}: the ranks passed tensors of different sizes ({shown}); every rank must "
            "pass the same number of elements. Nothing was changed."
        )
    sums = records[..., 2].reshape(-1, records.shape[-2])[0].tolist()
    layouts = ", ".join(f"rank {i}: {int(c):06x}" for i, c in enumerate(sums))
    raise ValueError(
        f"{what}: the ranks passed different sets of tensors or settings ({shown} in this "
        f"exchange, but the call's tensors differ in number, position or size, or its settings "
        f"that size the messages (bits, group_size, a dtype, k, chunk_size) differ: layout "
        f"checksums {layouts}); every rank must pass the same tensors (the same leaves, none "
        "missing or empty on only some ranks) and build the collective alike. Nothing was "
        "changed."
    )


@torch.library.custom_op("fn::released", mutates_args=())
def _released_op(
    x: torch.Tensor, records: torch.Tensor, n: int, what: str, checksum: int
) -> torch.Tensor:
    check(records, n, what, None if checksum < 0 else checksum)
    return x.clone()


@_released_op.register_fake
def _(x, records, n, what, checksum):
    return torch.empty_like(x)


@_released_op.register_vmap
def _(info, in_dims, x, records, n, what, checksum):
    size = info.batch_size
    x, records = stack_ranks(x, in_dims[0], size), stack_ranks(records, in_dims[1], size)
    return _released_op(x, records, n, what, checksum), 0
