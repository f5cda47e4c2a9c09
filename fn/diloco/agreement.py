"""The ranks' agreement on their settings: one all-gather of a fixed-size record, so that a
setting that differs on one rank is the same error on every rank before the first step, rather
than a hang or a wrong average at the first outer step."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch

from fn.collectives import Comm

__all__ = ["agree_on_settings"]


def _digest(value: object) -> int:
    return zlib.crc32(repr(value).encode())


def agree_on_settings(comm: Comm, settings: Mapping[str, object], who: str) -> None:
    """Checks that every rank of ``comm`` passed the same ``settings``.

    Each value is sent as the CRC-32 of its ``repr`` (the field names and their order are the
    caller's code, the same on every rank), in one all-gather of ``8 * len(settings)`` bytes.

    Args:
        comm: the ranks that must agree.
        settings: name -> value, in the same order on every rank.
        who: the caller's name, for the message.

    Raises:
        ValueError: on every rank, the same message, naming each setting that differs and how
            the ranks split on it.

    Example:
        >>> from fn.diloco.agreement import agree_on_settings
        >>> agree_on_settings(fn.collectives.Local(), {"sync_every": 30}, "DiLoCo")
    """
    mine = torch.tensor([_digest(v) for v in settings.values()], dtype=torch.int64)
    rows = comm.all_gather(mine).tolist()
    differing = []
    for column, name in enumerate(settings):
        groups: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            groups.setdefault(row[column], []).append(rank)
        if len(groups) > 1:
            split = " | ".join(", ".join(map(str, ranks)) for ranks in groups.values())
            differing.append(f"{name} (ranks {split})")
    if differing:
        raise ValueError(
            f"{who}: the ranks' settings differ: {'; '.join(differing)}. Every rank must pass "
            "the same settings and start from the same parameters; nothing was changed."
        )
