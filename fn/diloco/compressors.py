"""The outer compressors: the collective that turns every rank's pseudo-gradient into an estimate
of their mean, named by a string so that ranks can compare their settings."""

from __future__ import annotations

import functools
from typing import Any

import torch

from fn.base import GradientTransformation
from fn.collectives import (
    Comm,
    cast_allreduce,
    loco_allreduce,
    onebit_allreduce,
    quantized_allreduce,
    topk_allreduce,
)

__all__ = ["COMPRESSIONS", "compression"]

# kind -> (the factory with its fixed arguments, the options it takes)
_FACTORIES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "fp32": (functools.partial(cast_allreduce, torch.float32), ()),
    "bf16": (functools.partial(cast_allreduce, torch.bfloat16), ()),
    "int8": (functools.partial(quantized_allreduce, 8), ("group_size",)),
    "loco4": (
        functools.partial(loco_allreduce, 4),
        ("group_size", "err_beta", "reset_T", "error_dtype"),
    ),
    "onebit": (onebit_allreduce, ()),
    "topk": (
        functools.partial(topk_allreduce, exchange="auto"),
        ("k", "chunk_size", "exchange", "server_k", "round_trip_bytes"),
    ),
}

COMPRESSIONS = tuple(_FACTORIES)
"""The kinds :func:`compression` builds, ``"fp32"``, ``"bf16"``, ``"int8"``, ``"loco4"``,
``"onebit"`` and ``"topk"``.

Example:
    >>> "topk" in fn.diloco.COMPRESSIONS
    True
"""


def compression(kind: str, *, comm: Comm, **options: Any) -> GradientTransformation:
    """The outer compressor ``kind``: a transform from this rank's pseudo-gradient to an estimate
    of the mean over the ranks of ``comm``, the same on every rank, bit for bit.

    - ``"fp32"``, ``"bf16"``: ``fn.collectives.cast_allreduce`` in that dtype (the exact mean
      in rank order; bf16 halves the bytes), no error feedback.
    - ``"int8"``: ``fn.collectives.quantized_allreduce(bits=8)``, no error feedback (the
      baseline of torchft's quantized outer allreduce); option ``group_size``.
    - ``"loco4"``: ``fn.collectives.loco_allreduce(bits=4)``, LoCo's error feedback; options
      ``group_size``, ``err_beta``, ``reset_T``, ``error_dtype``.
    - ``"onebit"``: ``fn.collectives.onebit_allreduce``, the error-compensated 1-bit allreduce.
    - ``"topk"``: ``fn.collectives.topk_allreduce``, chunk-wise top-``k`` in 2 bits with error
      feedback (SparseLoCo's compressor); options ``k``, ``chunk_size``, ``exchange``
      (``"gather"``, ``"owner"``, or ``"auto"``, the default: the one with fewer bytes,
      ``fn.collectives.topk_exchange_form``), ``server_k`` (the owners' ``k``) and
      ``round_trip_bytes`` (what ``"auto"`` counts a second round trip worth on the link).

    docs/algorithms.md, "DiLoCo: local steps and a compressed outer step" gives each one's
    bytes and error-feedback memory.

    Args:
        kind: one of :data:`COMPRESSIONS`.
        comm: the group of workers.
        **options: the kind's options, passed to its collective.

    Returns:
        The compressor, a GradientTransformation (its state holds the error feedback, if any).

    Raises:
        ValueError: an unknown ``kind``, an option the kind does not take, or a value its
            collective refuses.
        TypeError: ``comm`` is not a ``fn.collectives.Comm``.

    Example:
        >>> from fn.collectives import Simulated, simulate
        >>> comm = Simulated(2)
        >>> tx = fn.diloco.compression("fp32", comm=comm)
        >>> delta = {"w": torch.tensor([[1.0, 2.0], [3.0, 6.0]])}  # row r: rank r's
        >>> simulate(tx.update, comm)(delta, tx.init(delta))[0]["w"]
        tensor([[2., 4.],
                [2., 4.]])
    """
    if not isinstance(kind, str) or kind not in _FACTORIES:
        raise ValueError(
            f"compression: kind must be one of {', '.join(COMPRESSIONS)}, got {kind!r}"
        )
    # the collectives an outer exchange calls, looked up on the type (a comm's world size may
    # need a quorum first)
    if not all(callable(getattr(type(comm), name, None)) for name in ("all_gather", "all_to_all")):
        raise TypeError(
            "compression: comm must be a fn.collectives.Comm (Local, Simulated, ProcessGroup), "
            f"got {type(comm).__name__}"
        )
    factory, allowed = _FACTORIES[kind]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) if allowed else "no options"
        raise ValueError(f"compression: {kind!r} takes {takes}; got {', '.join(unknown)}")
    return factory(comm=comm, **options)
