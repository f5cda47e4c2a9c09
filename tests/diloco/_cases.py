"""The outer rules the tests run, by name, and the workers' drifts that stand in for their inner
steps: the same on ``Simulated`` and on gloo ranks."""

from __future__ import annotations

import torch

import fn.diloco
from fn.base import GradientTransformation
from fn.collectives import Comm

# every compressor after Nesterov, and SparseLoCo's rule
KINDS = (*fn.diloco.COMPRESSIONS, "sparseloco")


# options small enough for small tensors (loco4's errors reset every other call)
OPTIONS = {
    "topk": {"k": 2, "chunk_size": 8},
    "sparseloco": {"k": 2, "chunk_size": 8},
    "int8": {"group_size": 8},
    "loco4": {"group_size": 8, "err_beta": 0.8, "reset_T": 2},
}


def outer_rule(kind: str, comm: Comm) -> GradientTransformation:
    """The outer rule ``kind`` (SparseLoCo with lr 1 and beta 0.95; else Nesterov with lr 0.7
    and momentum 0.9 after the compressor), with :data:`OPTIONS`."""
    if kind == "sparseloco":
        return fn.diloco.sparseloco(comm=comm, **OPTIONS[kind])
    return fn.diloco.nesterov(fn.diloco.compression(kind, comm=comm, **OPTIONS.get(kind, {})))


def drifts(shape: tuple[int, ...], world_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """``[W, *shape]`` per outer step: how far each worker moves from the anchor before it."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(world_size, *shape, generator=g) * 0.1 for _ in range(steps)]
