"""What fn reads of FSDP2's own state, for which torch has no public accessor: the custom
reduce-scatter a module runs, and whether FSDP2 stopped after an exception in a backward. Each
reader degrades to "nothing known" where torch's attributes are missing."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["installed_reduce_scatter", "reduce_scatters_stopped"]


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
