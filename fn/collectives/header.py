"""The fixed-size header that an outer exchange's first message carries, and the compressors that
send one.

An outer step used to spend collectives of its own before its messages: an allreduce of the
ranks' agreement that every pseudo-gradient is finite, and the size records
(``fn.collectives._sizes``). Here both ride in a header of :data:`HEADER_BYTES` bytes at the
front of every row of the exchange's first collective (and of its second, for top-k reduced on
owners, whose owners send there whether their results are finite): five fp32 values,

- ``flag``: 1 where the sending rank takes part (it offers its input, which is finite, as is
  its error feedback), else 0 (its message is zeros);
- ``slot``: the row's index in an all_to_all (the receiving rank), 0 in an all-gather; an owner
  learns from it which slice it owns;
- the size record: the element count ``n`` as two exact fp32 digits and a 24-bit checksum of the
  call's layout and settings (``fn.collectives._sizes``);

and after them whatever integers the caller adds for its ranks to compare (``fn.diloco``: the
inner step and the fragment of the exchange), 8 bytes each.

Every receiver checks every row's record before it uses anything (a mismatch is the same
``ValueError`` on every rank) and reads every rank's flag: the ranks agree on who took part at no
collective of their own. The message's byte size must be the same on every rank for the
collective to run at all (gloo aborts a process that receives more than it posted for), so the
header catches ranks whose sizes or settings differ where their messages are the same size; the
sizes themselves are agreed before (``fn.diloco.DiLoCo`` compares every setting and shape at
construction; the standalone transforms send their size record first, in a collective of fixed
size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from fn.base import GradientTransformation, chain
from fn.collectives import _sizes
from fn.collectives.participation import Participation
from fn.tree import tree_leaves

__all__ = [
    "HEADER_BYTES",
    "Exchanged",
    "Compressor",
    "compressor_chain",
    "gathered",
    "flag_of",
    "participation_of",
    "sealed",
    "Opened",
    "opened",
    "exchange_rows",
    "alone",
    "headers_only",
]

_DIGIT = 2**24  # every integer below 2^24 is exact in fp32

HEADER_BYTES = 20
"""The bytes of the header in front of every row of an exchange's message, five fp32 values
(and 8 bytes for each value the caller adds, ``sealed``'s ``extra``).

Example:
    >>> fn.collectives.HEADER_BYTES
    20
"""


class Exchanged(NamedTuple):
    """What a :class:`Compressor`'s ``exchange`` returns.

    Attributes:
        updates: the mean over the ranks that took part, the same on every rank, each leaf of
            its input's shape and dtype (meaningless where none did).
        state: the compressor's new state (a rank that did not take part keeps its error
            feedback).
        participants: ``[W]`` bool, whether each rank took part, as its headers carried its
            flag (its ``flag``, its input and error feedback finite), the same on every rank.
        extra: int64 ``[W, len(extra)]``, every rank's ``extra`` values.

    Example:
        >>> from fn.collectives import Exchanged
        >>> done = Exchanged({"w": torch.zeros(1)}, (), torch.tensor([True, True]),
        ...                  torch.zeros(2, 0, dtype=torch.int64))
        >>> done.participants.sum()
        tensor(2)
    """

    updates: Any
    state: Any
    participants: torch.Tensor
    extra: torch.Tensor


class Compressor(NamedTuple):
    """A GradientTransformation (``init``, ``update``) that can also run as an outer exchange
    whose messages carry the header of this module (``exchange``).

    - ``update(updates, state, params=None, participation=None)``: the transform on its own:
      the size record first, then the messages; a non-finite input on a rank that takes part
      raises on every rank.
    - ``exchange(updates, state, flag, params=None, extra=())``: the mean over the ranks that
      take part, from the messages with this rank's ``flag`` ([] bool tensor, ``True``: it
      takes part), the size record and ``extra`` (integers every rank sends, e.g. where it is
      in a schedule) in their headers, no collective of their own; returns :class:`Exchanged`.
      A rank whose flag is ``False`` (or whose input or error feedback is not finite) sends a
      message of zeros and keeps its error feedback, and the sums are divided by the number of
      ranks whose flags are set (``fn.collectives.participants_mean``: the bits of the mean over
      ``W`` where every rank takes part, and of ``update``). The sizes and settings must
      already be agreed (module docstring).

    Attributes:
        init: ``init(params)``, the state, as a GradientTransformation's.
        update: the transform on its own, as above.
        exchange: the outer exchange, as above.

    Example:
        >>> tx = fn.collectives.topk_allreduce(2, 8, comm=fn.collectives.Local())
        >>> isinstance(tx, fn.collectives.Compressor), sorted(tx._fields)
        (True, ['exchange', 'init', 'update'])
    """

    init: Callable[..., Any]
    update: Callable[..., Any]
    exchange: Callable[..., Exchanged]


def compressor_chain(
    compressor: Compressor | GradientTransformation, *rest: GradientTransformation
) -> Compressor | GradientTransformation:
    """``fn.chain(compressor, *rest)``, and, where ``compressor`` is a :class:`Compressor`, a
    :class:`Compressor` whose ``exchange`` is ``compressor``'s followed by ``rest``'s
    ``update`` s (an outer rule whose messages carry the header).

    Example:
        >>> from fn.collectives import Local, cast_allreduce
        >>> from fn.collectives.header import compressor_chain
        >>> rule = compressor_chain(cast_allreduce(comm=Local()), fn.scale_by_learning_rate(1.0))
        >>> rule.exchange({"w": torch.ones(1)}, rule.init({"w": torch.ones(1)})).updates
        {'w': tensor([-1.])}
    """
    chained = chain(compressor, *rest)
    if not isinstance(compressor, Compressor):
        return chained

    def exchange_fn(updates, state, flag=None, params=None, *, extra=()):
        updates, first, participants, values = compressor.exchange(
            updates, state[0], flag, params, extra=extra
        )
        states = [first]
        for tx, s in zip(rest, state[1:], strict=True):
            updates, s = tx.update(updates, s, params)
            states.append(s)
        return Exchanged(updates, tuple(states), participants, values)

    return Compressor(chained.init, chained.update, exchange_fn)


def gathered(comm: Any, x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x``, ``[W, *x.shape]`` (row ``i`` rank ``i``'s), as an all-gather gives
    it, sent as an all_to_all of ``x`` to every rank: the same bytes per rank, ``(W - 1)``
    times ``x``'s, in one exchange between every pair of ranks at once, where gloo's ring
    all-gather makes ``W - 1`` exchanges one after the other (on a link with a 50 ms delay, 0.31
    s against 0.11 s at ``W = 4``: benchmarks/README.md, ``diloco_wall.py``).

    Example:
        >>> from fn.collectives import Simulated, simulate
        >>> from fn.collectives.header import gathered
        >>> comm = Simulated(2)
        >>> simulate(lambda x: gathered(comm, x), comm)(torch.tensor([[1.0], [2.0]]))[0]
        tensor([[1.],
                [2.]])
    """
    return comm.all_to_all(x.unsqueeze(0).expand(comm.world_size, *x.shape).contiguous())


def flag_of(flag: torch.Tensor | bool | None) -> torch.Tensor:
    """An exchange's flag as a [] bool tensor (``None``: taking part).

    Example:
        >>> fn.collectives.header.flag_of(None), fn.collectives.header.flag_of(torch.tensor([0]))
        (tensor(True), tensor(False))
    """
    return torch.as_tensor(True if flag is None else flag).reshape(()).bool()


def sealed(
    payload: torch.Tensor,
    flag: torch.Tensor,
    n: int,
    checksum: int,
    slots: bool = False,
    extra: Sequence[int] = (),
) -> torch.Tensor:
    """``payload`` (uint8 ``[rows, bytes]``) with the header in front of every row.

    Args:
        payload: one row per destination (an all_to_all) or one row (an all-gather).
        flag: [] bool, whether this rank takes part.
        n: the call's element count.
        checksum: the 24-bit checksum of the call's layout and settings.
        slots: write each row's index as its slot (an all_to_all); else 0.
        extra: integers from 0 to 2^48 that the caller's ranks must agree on (e.g. where each
            worker is in its schedule), 8 bytes each (two exact fp32 digits) after the record.

    Returns:
        uint8 ``[rows, HEADER_BYTES + 8 len(extra) + bytes]``.

    Raises:
        ValueError: a value of ``extra`` outside ``[0, 2^48)`` (it would not travel exactly).

    Example:
        >>> from fn.collectives.header import sealed
        >>> sealed(torch.zeros(2, 1, dtype=torch.uint8), torch.tensor(True), 3, 7).shape
        torch.Size([2, 21])
    """
    rows = payload.shape[0]
    record = _sizes.with_count(payload.new_empty(rows, 0, dtype=torch.float32), n, checksum)
    slot = torch.arange(rows, device=payload.device) if slots else payload.new_zeros(rows)
    outside = [int(v) for v in extra if not 0 <= int(v) < _DIGIT**2]
    if outside:
        raise ValueError(f"the exchange's header holds integers in [0, 2^48), got {outside}")
    digits = [float(d) for value in extra for d in divmod(int(value), _DIGIT)]
    more = torch.tensor(digits, dtype=torch.float32, device=payload.device).expand(rows, -1)
    head = [flag.float().expand(rows, 1), slot.float().view(rows, 1), record, more]
    return torch.cat([torch.cat(head, dim=1).view(torch.uint8), payload], dim=1)


class Opened(NamedTuple):
    """What :func:`opened` reads from the received rows.

    Attributes:
        flags: ``[rows]`` bool, every sender's flag.
        slot: [] int64, the slot the rows were sent to (this rank's index in an all_to_all).
        payload: uint8 ``[rows, bytes]``, the rows without their headers.
        extra: int64 ``[rows, extra]``, every sender's ``extra`` values.
    """

    flags: torch.Tensor
    slot: torch.Tensor
    payload: torch.Tensor
    extra: torch.Tensor


def opened(received: torch.Tensor, n: int, what: str, checksum: int, extra: int = 0) -> Opened:
    """The rows of an exchange (row ``i`` from rank ``i``) sealed with ``extra`` values each,
    once every header's size record is that of ``n`` and ``checksum``.

    Raises:
        ValueError: a record differs, naming every rank's count (the same on every rank).

    Example:
        >>> from fn.collectives.header import opened, sealed
        >>> rows = sealed(torch.ones(2, 3, dtype=torch.uint8), torch.tensor(False), 5, 9, extra=[7])
        >>> got = opened(rows, 5, "example", 9, extra=1)
        >>> got.flags, got.payload.shape, got.extra
        (tensor([False, False]), torch.Size([2, 3]), tensor([[7],
                [7]]))
    """
    size = HEADER_BYTES + 8 * extra
    head = received[:, :size].clone(memory_format=torch.contiguous_format)
    head = head.view(torch.float32)  # [rows, 5 + 2 extra]; a copy: 4-byte aligned
    payload = _sizes.released(received[:, size:], head[:, 2:5], n, what, checksum)
    digits = head[:, 5:].double().view(head.shape[0], extra, 2)
    values = (digits[..., 0] * _DIGIT + digits[..., 1]).long()
    return Opened(head[:, 0] != 0, head[0, 1].long(), payload, values)


def participation_of(flag: torch.Tensor, got: Opened) -> Participation:
    """This rank's participation in an exchange: its ``flag``, and the count of every rank's
    flag in the headers ``got`` read (``fn.collectives.participants_mean`` divides by it).

    Example:
        >>> from fn.collectives.header import opened, participation_of, sealed
        >>> rows = sealed(torch.zeros(1, 0, dtype=torch.uint8), torch.tensor(True), 0, 0)
        >>> participation_of(torch.tensor(True), opened(rows, 0, "x", 0)).count
        tensor(1)
    """
    return Participation(flag, got.flags.sum())


def exchange_rows(
    comm: Any,
    payload: torch.Tensor,
    flag: torch.Tensor,
    n: int,
    what: str,
    checksum: int,
    *,
    to_each: bool = False,
    extra: Sequence[int] = (),
) -> tuple[Opened, Participation]:
    """One collective of an exchange: ``payload`` with the header in front of every row
    (:func:`sealed`), sent, and every rank's row opened (:func:`opened`), with this rank's
    participation read from their flags (:func:`participation_of`).

    Args:
        comm: the ranks.
        payload: uint8, one row that every rank receives (``[1, bytes]``, all-gathered by
            :func:`gathered`), or with ``to_each`` one row per rank (``[W, bytes]``, an
            all_to_all: row ``i`` to rank ``i``).
        flag: [] bool, whether this rank takes part.
        n: the call's element count.
        what: the caller's name, which starts a mismatch's message.
        checksum: the 24-bit checksum of the call's layout and settings.
        to_each: an all_to_all of ``W`` rows, each sealed with its slot.
        extra: integers the ranks compare (:func:`sealed`).

    Returns:
        ``(got, participation)``: the received rows, row ``i`` from rank ``i``
        (:class:`Opened`), and this rank's participation.

    Raises:
        ValueError: a size record differs (the same on every rank), or ``extra`` holds a value
            outside ``[0, 2^48)``.

    Example:
        >>> from fn.collectives import Simulated, simulate
        >>> from fn.collectives.header import exchange_rows
        >>> comm = Simulated(2)
        >>> def rows(x, flag):
        ...     got, part = exchange_rows(comm, x.view(1, 1), flag, 1, "example", 0)
        ...     return got.payload, part.count
        >>> x, flags = torch.tensor([[3], [5]], dtype=torch.uint8), torch.tensor([True, False])
        >>> payload, count = simulate(rows, comm)(x, flags)
        >>> payload[0].view(-1), count[0]
        (tensor([3, 5], dtype=torch.uint8), tensor(1))
    """
    rows = sealed(payload, flag, n, checksum, slots=to_each, extra=extra)
    received = comm.all_to_all(rows) if to_each else gathered(comm, rows.view(-1))
    got = opened(received, n, what, checksum, len(extra))
    return got, participation_of(flag, got)


def alone(updates: Any, state: Any, flag: Any, leaves: list, live: list[int], extra) -> Exchanged:
    """The exchange of a group of one rank: ``updates`` and ``state`` as they are, with its
    ``flag`` (and its ``leaves`` at the positions ``live`` finite) and ``extra`` as its headers
    would have carried them.

    Example:
        >>> from fn.collectives.header import alone
        >>> alone({"w": torch.ones(1)}, (), None, [torch.ones(1)], [0], [7]).participants
        tensor([True])
    """
    flag = flag_of(flag)
    for i in live:
        flag = flag & torch.isfinite(leaves[i]).all()
    values = torch.tensor([list(extra)], dtype=torch.int64)
    return Exchanged(updates, state, flag.reshape(1), values)


def headers_only(comm: Any, updates: Any, state: Any, flag: Any, what: str, extra) -> Exchanged:
    """The exchange of a tree with nothing to send (every leaf ``None`` or empty): ``updates``
    and ``state`` as they are, the ranks' flags and ``extra`` agreed in one collective of headers
    alone (as every rank's tree has the same shapes, every rank takes this path).

    Example:
        >>> from fn.collectives import Simulated, simulate
        >>> from fn.collectives.header import headers_only
        >>> comm = Simulated(2)
        >>> def exchange(flag):
        ...     return headers_only(comm, {"w": torch.zeros(0)}, (), flag, "example", [3])
        >>> done = simulate(exchange, comm)(torch.tensor([True, False]))
        >>> done.participants[0], done.extra[0]
        (tensor([ True, False]), tensor([[3],
                [3]]))
    """
    if comm.world_size == 1:
        return alone(updates, state, flag, [], [], extra)
    devices = [x.device for x in tree_leaves(updates) if x is not None]
    empty = torch.zeros(1, 0, dtype=torch.uint8, device=devices[0] if devices else None)
    checksum = _sizes.layout_checksum(())
    got, _ = exchange_rows(comm, empty, flag_of(flag), 0, what, checksum, extra=extra)
    return Exchanged(updates, state, got.flags, got.extra)
