"""The ranks' agreement on DiLoCo's settings: ``fn.collectives.agreement.agree``, so that a
setting that differs on one rank is the same error on every rank before the first step, rather
than a hang or a wrong average at the first outer step."""

from __future__ import annotations

from collections.abc import Mapping

from fn.collectives import Comm
from fn.collectives.agreement import agree

__all__ = ["agree_on_settings"]


def agree_on_settings(comm: Comm, settings: Mapping[str, object], who: str) -> None:
    """Checks that every rank of ``comm`` passed the same ``settings``.

    Each value is sent as the digest of its ``repr`` (the field names and their order are the
    caller's code, the same on every rank), in one all-gather of ``8 * (2 + len(settings))``
    bytes.

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
    agree(comm, who, settings)
