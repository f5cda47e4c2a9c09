"""What the stack-specific glue shares: finding fn's optimizer inside a stack's wrapper, and
handing a DDP model to ``fn.ddp``."""

from __future__ import annotations

from typing import Any

import torch

from fn.optim import FunctionalOptimizer


def unwrap_optimizer(optimizer: Any) -> FunctionalOptimizer:
    """The ``fn.optim`` optimizer inside a stack's wrappers (accelerate's ``AcceleratedOptimizer``
    and friends keep the wrapped optimizer as ``.optimizer``).

    Raises:
        TypeError: no ``fn.optim.FunctionalOptimizer`` is found.
    """
    seen = optimizer
    while not isinstance(seen, FunctionalOptimizer):
        inner = getattr(seen, "optimizer", None)
        if inner is None or inner is seen:
            raise TypeError(
                "fn.integrations needs an fn.optim optimizer (e.g. fn.optim.OnebitAdam), got "
                f"{type(optimizer).__name__}"
            )
        seen = inner
    return seen


def register_ddp(model: torch.nn.Module, optimizer: FunctionalOptimizer) -> bool:
    """Attaches ``optimizer`` to ``model`` with ``fn.ddp.register`` when ``model`` is a
    ``DistributedDataParallel`` module.

    Returns:
        Whether it was attached (``False``: ``model`` is not DDP, e.g. a single process).
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return False
    from fn.ddp import register

    register(model, optimizer)
    return True
