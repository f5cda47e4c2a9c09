"""The outer rules the tests run, by name, and the workers' drifts that stand in for their inner
steps: the same on ``Simulated`` and on gloo ranks."""

from __future__ import annotations

import torch

import fn.diloco
from fn.base import GradientTransformation
from fn.collectives import Comm

# every compressor after Nesterov, and SparseLoCo's rule
KINDS = (*fn.diloco.COMPRESSIONS, "sparseloco")


def outer_rule(kind: str, comm: Comm) -> GradientTransformation:
    """The outer rule ``kind``, with options small enough for small tensors."""
    if kind == "sparseloco":
        return fn.diloco.sparseloco(k=2, chunk_size=8, comm=comm)
    options = {"topk": {"k": 2, "chunk_size": 8}, "int8": {"group_size": 8}}.get(kind, {})
    return fn.diloco.nesterov(fn.diloco.compression(kind, comm=comm, **options))


def drifts(shape: tuple[int, ...], world_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """``[W, *shape]`` per outer step: how far each worker moves from the anchor before it."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(world_size, *shape, generator=g) * 0.1 for _ in range(steps)]
