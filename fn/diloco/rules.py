"""The outer rules by name: a table from a name to the rule's factory, as
:func:`fn.diloco.compression`'s table does for the compressors, so that ranks can compare their
settings as strings."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fn.base import GradientTransformation
from fn.collectives import Comm, Compressor
from fn.diloco.compressors import compression as build_compression
from fn.diloco.nesterov_rule import nesterov
from fn.diloco.sparseloco_rule import sparseloco

__all__ = ["OUTER_RULES", "outer_rule"]


def _nesterov(options: Mapping, kind: str | None, kind_options: Mapping, comm: Comm):
    return nesterov(build_compression(kind or "fp32", comm=comm, **kind_options), **options)


def _sparseloco(options: Mapping, kind: str | None, kind_options: Mapping, comm: Comm):
    if kind not in (None, "topk"):
        raise ValueError(
            f"DiLoCo: outer='sparseloco' sends its own top-k; compression must be None or "
            f"'topk' (its k and chunk_size go in compression_options), got {kind!r}"
        )
    return sparseloco(comm=comm, **options, **kind_options)


# name -> factory(outer_options, compression, compression_options, comm)
_RULES: dict[str, Callable[..., GradientTransformation]] = {
    "nesterov": _nesterov,
    "sparseloco": _sparseloco,
}

OUTER_RULES = tuple(_RULES)
"""The outer rules :class:`DiLoCo` takes by name, ``"nesterov"`` (:func:`fn.diloco.nesterov`,
after any compressor) and ``"sparseloco"`` (:func:`fn.diloco.sparseloco`, its top-k built in).

Example:
    >>> fn.diloco.OUTER_RULES
    ('nesterov', 'sparseloco')
"""


def outer_rule(
    outer: str,
    outer_options: Mapping[str, Any],
    compression: str | None,
    compression_options: Mapping[str, Any],
    comm: Comm,
) -> GradientTransformation | Compressor:
    """The outer rule ``outer`` with its compressor, as :class:`fn.diloco.DiLoCo` builds it.

    Args:
        outer: one of :data:`OUTER_RULES`.
        outer_options: the rule's options (``lr``, ``momentum``; ``lr``, ``beta``).
        compression: the compressor (``None``: the rule's own; ``"sparseloco"`` takes only
            ``"topk"``).
        compression_options: the compressor's options.
        comm: the workers.

    Returns:
        The rule: a ``fn.collectives.Compressor`` (its ``exchange`` carries the outer step's
        flag in its messages' headers) where its compressor is one, else a
        ``GradientTransformation``.

    Raises:
        ValueError: an unknown rule or compressor, or options they refuse.

    Example:
        >>> from fn.diloco.rules import outer_rule
        >>> rule = outer_rule("nesterov", {"lr": 1.0}, "bf16", {}, fn.collectives.Local())
        >>> type(rule).__name__
        'Compressor'
    """
    if outer not in _RULES:
        raise ValueError(f"DiLoCo: outer must be one of {', '.join(OUTER_RULES)}, got {outer!r}")
    return _RULES[outer](outer_options, compression, compression_options, comm)
