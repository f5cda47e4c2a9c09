"""The fixed-size header that an outer exchange's first message carries, and the compressors that
send one.

An outer step used to spend collectives of its own before its messages: an allreduce of the
ranks' agreement that every pseudo-gradient is finite, and the size records
(``fn.collectives._sizes``). Here both ride in a header of :data:`HEADER_BYTES` bytes at the
front of every row of the exchange's first collective (and of its second, for the exchanges
that reduce on owners and all-gather the result): five fp32 values,

- ``flag``: 1 where the sending rank takes part (its input, and its error feedback, finite), else
  0;
- ``slot``: the row's index in an all_to_all (the receiving rank), 0 in an all-gather; an owner
  learns from it which slice it owns;
- the size record: the element count ``n`` as two exact fp32 digits and a 24-bit checksum of the
  call's layout and settings (``fn.collectives._sizes``).

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

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fn.base import GradientTransformation, chain
from fn.collectives import _sizes

__all__ = [
    "HEADER_BYTES",
    "Exchanged",
    "Compressor",
    "compressor_chain",
    "flag_of",
    "sealed",
    "Opened",
    "opened",
]

HEADER_BYTES = 20
"""The bytes of the header in front of every row of an exchange's message: five fp32 values.

Example:
    >>> fn.collectives.HEADER_BYTES
    20
"""


class Exchanged(NamedTuple):
    """What a :class:`Compressor`'s ``exchange`` returns.

    Attributes:
        updates: the estimate of the mean over the ranks, the same on every rank, each leaf of
            its input's shape and dtype (meaningful where every ``flags`` entry is set).
        state: the compressor's new state.
        flags: ``[W]`` bool, the flag of every rank as its headers carried it (rank ``i``'s
            input and error feedback finite, and ``i`` taking part), the same on every rank.

    Example:
        >>> from fn.collectives import Exchanged
        >>> Exchanged({"w": torch.zeros(1)}, (), torch.tensor([True, True])).flags.all()
        tensor(True)
    """

    updates: Any
    state: Any
    flags: torch.Tensor


class Compressor(NamedTuple):
    """A GradientTransformation (``init``, ``update``) that can also run as an outer exchange
    whose messages carry the header of this module (``exchange``).

    - ``update(updates, state, params=None)``: the transform on its own: the size record first,
      then the messages; a non-finite input on some rank raises on every rank.
    - ``exchange(updates, state, flag)``: the same estimate from the messages with this rank's
      ``flag`` ([] bool tensor, ``True``: it takes part) in their headers, no collective of its
      own; returns :class:`Exchanged`. A rank whose flag is ``False`` (or whose input or error
      feedback is not finite) sends a message of zeros and gets back its old state; whoever
      reads ``flags`` decides what to do with a step that not every rank took part in. The
      sizes and settings must already be agreed (module docstring).

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

    def exchange_fn(updates, state, flag=None, params=None, **extra):
        del extra
        updates, first, flags = compressor.exchange(updates, state[0], flag, params)
        states = [first]
        for tx, s in zip(rest, state[1:], strict=True):
            updates, s = tx.update(updates, s, params)
            states.append(s)
        return Exchanged(updates, tuple(states), flags)

    return Compressor(chained.init, chained.update, exchange_fn)


def flag_of(flag: torch.Tensor | bool | None) -> torch.Tensor:
    """An exchange's flag as a [] bool tensor (``None``: taking part).

    Example:
        >>> fn.collectives.header.flag_of(None), fn.collectives.header.flag_of(torch.tensor([0]))
        (tensor(True), tensor(False))
    """
    if flag is None:
        return torch.ones((), dtype=torch.bool)
    return torch.as_tensor(flag).reshape(()).bool()


def sealed(
    payload: torch.Tensor, flag: torch.Tensor, n: int, checksum: int, slots: bool = False
) -> torch.Tensor:
    """``payload`` (uint8 ``[rows, bytes]``) with the header in front of every row.

    Args:
        payload: one row per destination (an all_to_all) or one row (an all-gather).
        flag: [] bool, whether this rank takes part.
        n: the call's element count.
        checksum: the 24-bit checksum of the call's layout and settings.
        slots: write each row's index as its slot (an all_to_all); else 0.

    Returns:
        uint8 ``[rows, HEADER_BYTES + bytes]``.

    Example:
        >>> from fn.collectives.header import sealed
        >>> sealed(torch.zeros(2, 1, dtype=torch.uint8), torch.tensor(True), 3, 7).shape
        torch.Size([2, 21])
    """
    rows = payload.shape[0]
    record = _sizes.with_count(payload.new_empty(rows, 0, dtype=torch.float32), n, checksum)
    slot = torch.arange(rows, device=payload.device) if slots else payload.new_zeros(rows)
    head = torch.cat([flag.float().expand(rows, 1), slot.float().view(rows, 1), record], dim=1)
    return torch.cat([head.view(torch.uint8), payload], dim=1)


class Opened(NamedTuple):
    """What :func:`opened` reads from the received rows.

    Attributes:
        flags: ``[rows]`` bool, every sender's flag.
        slot: [] int64, the slot the rows were sent to (this rank's index in an all_to_all).
        payload: uint8 ``[rows, bytes]``, the rows without their headers.
    """

    flags: torch.Tensor
    slot: torch.Tensor
    payload: torch.Tensor


def opened(received: torch.Tensor, n: int, what: str, checksum: int) -> Opened:
    """The rows of an exchange (row ``i`` from rank ``i``), once every header's size record is
    that of ``n`` and ``checksum``.

    Raises:
        ValueError: a record differs, naming every rank's count (the same on every rank).

    Example:
        >>> from fn.collectives.header import opened, sealed
        >>> rows = sealed(torch.ones(2, 3, dtype=torch.uint8), torch.tensor(False), 5, 9)
        >>> got = opened(rows, 5, "example", 9)
        >>> got.flags, got.payload.shape
        (tensor([False, False]), torch.Size([2, 3]))
    """
    head = received[:, :HEADER_BYTES].clone(memory_format=torch.contiguous_format)
    head = head.view(torch.float32)  # [rows, 5]; a copy: 4-byte aligned
    payload = _sizes.released(received[:, HEADER_BYTES:], head[:, 2:], n, what, checksum)
    return Opened(head[:, 0] != 0, head[0, 1].long(), payload)
