"""A copy that ``torch.compile`` cannot fuse through.

Works around an inductor CPU miscompile seen on torch 2.13: a fused kernel over the first ``n``
elements of a chunk-scaled product, e.g. ``q - (s.view(W, c) * a[:, None]).reshape(-1)[:n]``
with ``n`` not a multiple of ``c``, reads wrong scales for the last chunk (garbage results).
Materializing the full product in an opaque op first keeps the slice a plain view.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("fn::fusion_barrier", mutates_args=())
def fusion_barrier(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x``, opaque to the compiler's fusion."""
    return x.clone()


@fusion_barrier.register_fake
def _(x):
    return torch.empty_like(x)


@fusion_barrier.register_vmap
def _(info, in_dims, x):
    del info
    return fusion_barrier(x), in_dims[0]
