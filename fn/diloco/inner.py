"""What ``DiLoCo`` needs of its inner optimizer: whether its state is finite, and a fresh state
for a worker that sat out an outer step.

Three kinds, told apart through their public API:

- ``torch.optim`` optimizers (any ``torch.optim.Optimizer`` that keeps its state in its
  per-param ``state`` dict, initialized at the first step that needs it, as every
  ``torch.optim`` optimizer does): the state's floating tensors are checked finite (one pass
  over the state of the fragment's parameters) and a reset clears ``state``, so that AdamW
  starts its moments and its step count afresh;
- ``fn.optim`` optimizers (``reset_state()``): reset by it; their state is finite by
  construction (a step with a non-finite gradient raises ``fn.NonFiniteError`` or is skipped,
  with nothing changed), so it is not checked;
- ``fn.fsdp``'s 1-bit optimizers: finite by construction as ``fn.optim``'s, and kept: they have
  no reset through their public API (their state's layout is being restructured), so a worker
  that sat out continues from the anchor with its moments.

It also says which groups the optimizer communicates over (``fn.optim``'s ``comm``,
``fn.fsdp``'s ``world``, a ``process_group`` such as ``ZeroRedundancyOptimizer``'s) and
describes its param groups, for the workers' agreement.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fn.collectives import local_shard

__all__ = ["InnerOptimizer"]


def _plain(value: Any) -> str:
    """A hyperparameter's value as text that does not depend on the rank (a tensor's values,
    not its device; no memory addresses)."""
    if isinstance(value, torch.Tensor):
        return repr(value.tolist())
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


class InnerOptimizer:
    """DiLoCo's view of its inner optimizer.

    Args:
        optimizer: the inner optimizer.

    Attributes:
        optimizer: the inner optimizer.
        resets: whether :meth:`reset` gives it a fresh state (``False``: ``fn.fsdp``'s, kept).

    Example:
        >>> from fn.diloco.inner import InnerOptimizer
        >>> model = torch.nn.Linear(2, 1)
        >>> inner = InnerOptimizer(torch.optim.AdamW(model.parameters()))
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> inner.optimizer.step()
        >>> bool(inner.finite(list(model.parameters()))), len(inner.optimizer.state)
        (True, 2)
        >>> inner.reset()
        >>> len(inner.optimizer.state)
        0
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        fsdp = sys.modules.get("fn.fsdp")  # (without fn.fsdp imported, no fn.fsdp optimizer)
        self._sharded_onebit = fsdp is not None and isinstance(
            optimizer, fsdp.ShardedOnebitOptimizer
        )
        self._own_reset = callable(getattr(optimizer, "reset_state", None))
        self.resets = not self._sharded_onebit

    @property
    def checks_state(self) -> bool:
        """Whether :meth:`finite` reads the state (``torch.optim``'s per-param state)."""
        return not (self._sharded_onebit or self._own_reset)

    def finite(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[]`` bool: whether the optimizer's state of ``params`` holds only finite values
        (``True`` for the kinds finite by construction), on the first parameter's device."""
        device = local_shard(params[0]).device if params else None
        ok = torch.ones((), dtype=torch.bool, device=device)
        if not self.checks_state:
            return ok
        for p in params:
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    ok = ok & torch.isfinite(local_shard(value)).all().to(device)
        return ok

    def reset(self) -> None:
        """Gives the optimizer a fresh state (a no-op for ``fn.fsdp``'s, see the module)."""
        if self._own_reset:
            self.optimizer.reset_state()
        elif not self._sharded_onebit:
            self.optimizer.state.clear()

    def groups(self) -> list[tuple[str, Any]]:
        """The groups the optimizer communicates over, as ``(what, group)``: a
        ``fn.collectives`` comm or a ``torch.distributed`` group."""
        optimizer, out = self.optimizer, []
        if self._sharded_onebit:
            out.append(("its world= (every update's checks)", optimizer.world or dist.group.WORLD))
        elif getattr(optimizer, "comm", None) is not None:
            out.append(("its comm", optimizer.comm))
        if getattr(optimizer, "process_group", None) is not None:
            out.append(("its process_group", optimizer.process_group))
        return out

    def description(self, params: Sequence[torch.Tensor]) -> dict[str, Any]:
        """The optimizer's kind, its param groups' hyperparameters and which of ``params``
        (by index; ``-1``: another tensor) each holds, for the workers' agreement."""
        index = {id(p): i for i, p in enumerate(params)}
        groups = self.optimizer.param_groups
        return {
            "inner optimizer": type(self.optimizer).__qualname__,
            "inner optimizer's hyperparameters": [
                sorted((k, _plain(v)) for k, v in group.items() if k != "params")
                for group in groups
            ],
            "inner optimizer's parameters": [
                [index.get(id(p), -1) for p in group["params"]] for group in groups
            ],
        }

    def what_reset(self) -> str:
        """What :meth:`reset` does, for the messages."""
        if self.resets:
            return "its inner optimizer's state was reset (its moments start afresh)"
        return (
            f"its inner optimizer's state was kept ({type(self.optimizer).__name__} refuses "
            "non-finite gradients, so its state stays finite)"
        )
