"""A finiteness check that can raise from inside ``torch.func.vmap``.

A Python ``if`` on a tensor value fails under vmap (``Simulated`` runs every rank under vmap), so
the check is a custom op: its vmap rule sees the whole batch as a plain tensor and checks it.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("fn::assert_all_finite", mutates_args=())
def assert_all_finite(x: torch.Tensor, message: str) -> None:
    """Raises ``ValueError(message)`` unless every element of ``x`` (every rank's) is finite."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(message)


@assert_all_finite.register_fake
def _(x, message):
    return None


@assert_all_finite.register_vmap
def _(info, in_dims, x, message):
    del info, in_dims
    assert_all_finite(x, message)
    return None, None
