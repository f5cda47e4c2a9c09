"""A finiteness check that can raise from inside ``torch.func.vmap`` and ``torch.compile``.

A Python ``if`` on a tensor value fails under vmap (``Simulated`` runs every rank under vmap), so
the check is a custom op: its vmap rule sees the whole batch as a plain tensor and checks it. It
returns a copy of its input that the caller goes on with, so a compiled graph cannot drop it.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("fn::finite_or_raise", mutates_args=())
def finite_or_raise(x: torch.Tensor, message: str) -> torch.Tensor:
    """A copy of ``x``; raises ``ValueError(message)`` if any element (any rank's) is not finite."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(message)
    return x.clone()


@finite_or_raise.register_fake
def _(x, message):
    return torch.empty_like(x)


@finite_or_raise.register_vmap
def _(info, in_dims, x, message):
    del info
    return finite_or_raise(x, message), in_dims[0]
