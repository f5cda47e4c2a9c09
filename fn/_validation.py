"""Validation shared by every layer (kernels, collectives, transforms, the adapter).

Finiteness: a check that can raise from inside ``torch.func.vmap`` and ``torch.compile``. A
Python ``if`` on a tensor value fails under vmap (``Simulated`` runs every rank under vmap), so
there the check is a custom op: its vmap rule sees the whole batch as a plain tensor and checks
it. The op returns a copy of its input that the caller goes on with, so a compiled graph cannot
drop it. On eager plain tensors the check runs directly and returns the input itself (no copy).
"""

from __future__ import annotations

import torch

__all__ = ["all_finite", "finite_or_raise"]


def all_finite(x: torch.Tensor) -> bool:
    """True if no element of ``x`` is NaN or infinite.

    One reduction in the common case: a sum is finite only if every element is (NaN and
    infinities propagate; ``inf + -inf`` is NaN). Only a non-finite sum, a NaN/Inf or finite
    values whose sum overflows, takes the elementwise test.
    """
    if bool(torch.isfinite(x.sum())):
        return True
    return bool(torch.isfinite(x).all())


def finite_or_raise(x: torch.Tensor, message: str) -> torch.Tensor:
    """``x`` (eager) or a copy of it (under vmap or ``torch.compile``); raises
    ``ValueError(message)`` if any element (any rank's) is not finite."""
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return _finite_or_raise_op(x, message)
    if not all_finite(x):
        raise ValueError(message)
    return x


@torch.library.custom_op("fn::finite_or_raise", mutates_args=())
def _finite_or_raise_op(x: torch.Tensor, message: str) -> torch.Tensor:
    if not all_finite(x):
        raise ValueError(message)
    return x.clone()


@_finite_or_raise_op.register_fake
def _(x, message):
    return torch.empty_like(x)


@_finite_or_raise_op.register_vmap
def _(info, in_dims, x, message):
    del info
    return _finite_or_raise_op(x, message), in_dims[0]
