"""fn's side of FSDP2's private surface, for which torch exports no public name: the base classes
of the comms that ``set_custom_all_gather`` and ``set_custom_reduce_scatter`` take, what fn
reads of FSDP2's state (the custom reduce-scatter a module runs, and whether FSDP2 stopped after
an exception in a backward). Each reader degrades to "nothing known" where torch's attributes
are missing. (What fn reads of DCP's state-dict API is in fn/collectives/dcp.py.)"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = [
    "AllGather",
    "FreshBuffers",
    "SynchronousReduceScatter",
    "group_members",
    "installed_reduce_scatter",
    "reduce_scatters_stopped",
]


class FreshBuffers:
    """The comms' ``allocate``: a new uninitialized buffer (FSDP2 asks for the ones it fills
    and the outputs)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``torch.empty(*size)`` of ``dtype`` on ``device``."""
        return torch.empty(*size, dtype=dtype, device=device)


class SynchronousReduceScatter(FreshBuffers, ReduceScatter):
    """A reduce-scatter for ``set_custom_reduce_scatter`` that finishes before it returns (FSDP2
    then sees no pending work): a subclass writes ``reduce_scatter(out, x, group, op)``, which
    writes this rank's shard of the reduction of ``x`` over ``group`` into ``out``."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        """FSDP2's call: ``reduce_scatter``; ``async_op=True`` (which FSDP2 never asks for)
        raises ``NotImplementedError``."""
        if async_op:
            raise NotImplementedError(f"{type(self).__name__} runs synchronously (async_op=False)")
        self.reduce_scatter(output_tensor, input_tensor, group, op)  # type: ignore[attr-defined]


def group_members(module: nn.Module) -> tuple[nn.Module, ...]:
    """The modules of ``module``'s FSDP2 group, in the order given to ``fully_shard``
    (``fully_shard([a, b])`` makes one group of ``a`` and ``b``, which share their state and
    their reduce-scatter), or ``(module,)`` where they cannot be read."""
    members = getattr(_state(module), "_modules", None)
    return tuple(members) if members else (module,)


def installed_reduce_scatter(module: nn.Module) -> Any:
    """The reduce-scatter that FSDP2 runs for ``module`` (``set_custom_reduce_scatter``'s, or
    its default), or ``None`` where it cannot be read."""
    group = getattr(_state(module), "_fsdp_param_group", None)
    return getattr(group, "_reduce_scatter_comm", None)


def reduce_scatters_stopped(module: nn.Module) -> bool:
    """Whether FSDP2's end-of-backward callback of ``module``'s root stayed queued after a
    backward, as after an exception inside one: FSDP2 then never queues it again and stops
    reduce-scattering. ``False`` where it cannot be read."""
    context = getattr(_state(module), "_state_ctx", None)
    return bool(getattr(context, "post_backward_final_callback_queued", False))


def _state(module: nn.Module) -> Any:
    get = getattr(module, "_get_fsdp_state", None)
    return None if get is None else get()
