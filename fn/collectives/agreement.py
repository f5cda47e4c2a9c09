"""Agreement between ranks: what the ranks compare before they act together, so that a setting
or a refusal on one rank is the same error on every rank, at once, rather than a hang or a wrong
average at the first collective that depends on it.

- :func:`agree`: the ranks' settings (and whether some rank refused its own), one all-gather
  of a few integers: each setting as its :func:`digest`; the messages of the ranks that
  refused travel only then (:func:`gather_texts`).
- :func:`digest`: the one digest of a setting, a description or bytes (CRC-32), the same in
  every process (unlike ``hash``); :func:`bit_checksum`: a tensor's checksum, computed where
  the tensor lives.
- :func:`gather_texts`, :func:`shared`, :func:`differences`: every rank's text, and the
  messages that name which ranks said what.

``fn.optim`` (its param groups and the periodic check of its ranks), ``fn.fsdp`` (the
optimizers' and installers' settings, the checkpoints' steps) and ``fn.diloco`` (the wrapper's
settings) agree through these.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fn.collectives.comm import Comm

__all__ = [
    "KINDS",
    "agree",
    "bit_checksum",
    "differences",
    "digest",
    "gather_texts",
    "problem_of",
    "shared",
]

# The kinds of refusal a rank can report to the others (their index travels)
KINDS: tuple[type[Exception] | None, ...] = (None, ValueError, NotImplementedError, TypeError)


def digest(value: str | bytes, start: int = 0) -> int:
    """The CRC-32 of ``value`` (a ``str`` as UTF-8), continuing from the digest ``start`` of
    what came before it: the same in every process.

    Example:
        >>> from fn.collectives.agreement import digest
        >>> digest("sync_every=30") == digest(b"sync_every=30")
        True
    """
    return zlib.crc32(value.encode() if isinstance(value, str) else value, start)


def bit_checksum(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x``'s elements' bit patterns as integers (int64, wrapping, on ``x``'s
    device): equal exactly when the values are (up to collisions), and independent of the
    summation order.

    Example:
        >>> from fn.collectives.agreement import bit_checksum
        >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 1.0])
        >>> bool(bit_checksum(a) == bit_checksum(b))
        True
    """
    flat = x.detach().contiguous().view(-1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(
        flat.element_size(), torch.uint8
    )
    return flat.view(as_int).sum(dtype=torch.int64)


def gather_texts(
    comm: Comm, text: str, sizes: Sequence[int] | None = None, device: Any = "cpu"
) -> list[str]:
    """Every rank's ``text``, in rank order: one all-gather of their UTF-8 bytes, padded to the
    longest (a collective), after one of their sizes unless ``sizes`` are given.

    Args:
        comm: the ranks.
        text: this rank's text.
        sizes: every rank's byte count of its text, when the ranks have exchanged them already.
        device: where the all-gathers run (a ``nccl`` group has no CPU collectives).

    Returns:
        The ranks' texts.

    Example:
        >>> from fn.collectives.agreement import gather_texts
        >>> gather_texts(fn.collectives.Local(), "ok")
        ['ok']
    """
    data = text.encode()
    if sizes is None:
        mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = comm.all_gather(mine).view(-1).tolist()
    width = max(max(sizes), 1)
    padded = torch.tensor(list(data.ljust(width, b"\0")), dtype=torch.uint8)
    rows = comm.all_gather(padded.to(device)).cpu().view(len(sizes), width)
    return [bytes(rows[r, :n].tolist()).decode() for r, n in enumerate(sizes)]


def shared(texts: Sequence[str], verb: str, ranks: Sequence[int] | None = None) -> str:
    """The ranks' non-empty ``texts`` as one message: ``"rank(s) [r, ...] <verb>: <text>"`` for
    each distinct text, in the order of their first ranks, joined by ``"; "``; ``ranks``: the
    ranks in the world of the texts' senders (default: their index).

    Example:
        >>> from fn.collectives.agreement import shared
        >>> shared(["", "bits must be 4", "bits must be 4"], "refused the settings")
        'rank(s) [1, 2] refused the settings: bits must be 4'
    """
    found: dict[str, list[int]] = {}
    for index, text in enumerate(texts):
        if text:
            found.setdefault(text, []).append(index if ranks is None else ranks[index])
    return "; ".join(f"rank(s) {senders} {verb}: {text}" for text, senders in found.items())


def differences(described: Sequence[Mapping[str, str]]) -> list[str]:
    """``"field: value on ranks [..]; value on ranks [..]"`` for each field the ranks' described
    settings (``{field: value}``, by rank) disagree on (a field missing on a rank shows as
    ``<none>``), in rank 0's order.

    Example:
        >>> from fn.collectives.agreement import differences
        >>> differences([{"lr": "0.1", "eps": "1e-08"}, {"lr": "0.2", "eps": "1e-08"}])
        ['lr: 0.1 on ranks [0]; 0.2 on ranks [1]']
    """
    fields = list(dict.fromkeys(field for d in described for field in d))
    out = []
    for field in fields:
        by_value: dict[str, list[int]] = {}
        for rank, d in enumerate(described):
            by_value.setdefault(d.get(field, "<none>"), []).append(rank)
        if len(by_value) > 1:
            shown = "; ".join(f"{value} on ranks {ranks}" for value, ranks in by_value.items())
            out.append(f"{field}: {shown}")
    return out


def problem_of(error: Exception) -> tuple[type[Exception], str]:
    """``error`` as :func:`agree`'s ``problem``: its kind (one of :data:`KINDS`, else
    ``ValueError``) and message.

    Example:
        >>> from fn.collectives.agreement import problem_of
        >>> problem_of(KeyError("x"))
        (<class 'ValueError'>, "'x'")
    """
    kind = type(error) if type(error) in KINDS else ValueError
    return kind, str(error)


def agree(
    comm: Comm,
    who: str,
    settings: Mapping[str, Any],
    problem: tuple[type[Exception], str] | None = None,
    *,
    what: str = "settings",
    ranks: Sequence[int] | None = None,
    device: Any = "cpu",
) -> None:
    """Raises on every rank of ``comm`` if some rank refused its arguments (``problem``) or the
    ranks' ``settings`` differ: one all-gather of ``2 + len(settings)`` int64 per rank (each
    setting as the :func:`digest` of its ``repr``), and a second one of the refusals' messages
    when some rank refused. With one rank, ``problem`` alone is raised.

    Args:
        comm: the ranks that must agree.
        who: the caller, which starts every message (``"fn.fsdp.OnebitAdam"``).
        settings: name -> value, the same names in the same order on every rank (the caller's
            code).
        problem: what this rank refused (a kind of :data:`KINDS` and its message, without
            ``who``), or ``None``.
        what: what the settings are, for the message.
        ranks: the ranks of ``comm`` in the world, for the messages (default: ``comm``'s).
        device: where the all-gathers run (a ``nccl`` group has no CPU collectives).

    Raises:
        ValueError, NotImplementedError, TypeError: on every rank, the same: the kind of the
            first rank that refused, with every distinct refusal and the ranks that made it
            (``"<who>: rank(s) [2, 3] refused the model or the settings: <why>"``).
        ValueError: on every rank, naming each setting that differs and how the ranks split on
            it (``"sync_every (ranks 0, 2 | 1)"``).

    Example:
        >>> from fn.collectives.agreement import agree
        >>> agree(fn.collectives.Local(), "DiLoCo", {"sync_every": 30})
    """
    if comm.world_size == 1:
        if problem is not None:
            raise problem[0](f"{who}: {problem[1]}")
        return
    text = "" if problem is None else problem[1] or problem[0].__name__
    kind = KINDS.index(problem[0]) if problem else 0
    values = [digest(repr(value)) for value in settings.values()]
    mine = torch.tensor([kind, len(text.encode()), *values], dtype=torch.int64, device=device)
    rows = comm.all_gather(mine).cpu().tolist()
    ranks = list(range(len(rows))) if ranks is None else list(ranks)
    refused = [r for r, row in enumerate(rows) if row[0]]
    if refused:
        texts = gather_texts(comm, text, [row[1] for row in rows], device)
        verb = "refused the model or the settings"
        raise KINDS[rows[refused[0]][0]](f"{who}: {shared(texts, verb, ranks)}")
    differing = []
    for column, name in enumerate(settings, start=2):
        split: dict[int, list[int]] = {}
        for index, row in enumerate(rows):
            split.setdefault(row[column], []).append(ranks[index])
        if len(split) > 1:
            groups = " | ".join(", ".join(map(str, members)) for members in split.values())
            differing.append(f"{name} (ranks {groups})")
    if differing:
        raise ValueError(
            f"{who}: the ranks passed different {what}: {'; '.join(differing)}. Every rank must "
            "pass the same; nothing was changed"
        )
