"""DiLoCo's workers step alone between outer steps: nothing but DiLoCo may communicate across
them. The check, at construction, of the groups that the inner optimizer (``fn.optim``'s
``comm``, ``fn.fsdp``'s ``world``, a ``process_group``), a ``DistributedDataParallel`` model and
the parameters' device mesh communicate over."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from fn.collectives import Comm, Local, ProcessGroup
from fn.diloco.inner import InnerOptimizer

__all__ = ["isolation_problem"]


def _ranks(group: Any) -> set[int] | None:
    """The ranks (in the world) of a comm or group; ``None`` for one that does not
    communicate."""
    if group is None or isinstance(group, Local):
        return None
    if isinstance(group, ProcessGroup):
        group = group.group or dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return set(dist.get_process_group_ranks(group))
    return None


def isolation_problem(
    model: nn.Module, inner: InnerOptimizer, within: Sequence[Comm], comm: Comm
) -> str | None:
    """What makes the workers communicate outside DiLoCo, or ``None``.

    A group spans other workers where it holds more than one of ``comm``'s ranks (a sharded
    worker's own mesh holds one: this rank's).

    Args:
        model: the worker's model.
        inner: its inner optimizer.
        within: the groups inside a sharded worker (its parameters' device mesh).
        comm: DiLoCo's group of workers.

    Returns:
        The message of the first problem (the same on every rank of a symmetric layout), or
        ``None``.

    Example:
        >>> from fn.diloco.inner import InnerOptimizer
        >>> from fn.diloco.isolation import isolation_problem
        >>> model = torch.nn.Linear(2, 1)
        >>> inner = InnerOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> print(isolation_problem(model, inner, [], fn.collectives.Local()))
        None
    """
    workers = _ranks(comm)
    if not workers or len(workers) == 1:
        return None
    name = type(inner.optimizer).__name__
    spans = [
        (f"the inner optimizer ({name}) communicates over {what}", g) for what, g in inner.groups()
    ]
    if isinstance(model, nn.parallel.DistributedDataParallel):
        what = "the model is wrapped in DistributedDataParallel, which averages the gradients"
        spans.append((f"{what} over its process_group", model.process_group))
    spans += [
        ("the parameters' device mesh (FSDP2's collectives) spans a group", c) for c in within
    ]
    for what, group in spans:
        shared = (_ranks(group) or set()) & workers
        if len(shared) > 1:
            return (
                f"DiLoCo: {what}, which holds {len(shared)} of the {len(workers)} workers of "
                "DiLoCo's group: the workers would communicate at every inner step, which "
                "DiLoCo's local steps are there to avoid, and would no longer step on their "
                "own. Give it the worker's own ranks (fn.optim: comm=fn.collectives.Local() "
                "for a worker of one rank; fn.fsdp: world= the worker's shard group) and pass "
                "the model unwrapped; nothing was changed"
            )
    return None
