"""Learning-rate arithmetic shared by ``scale_by_learning_rate`` and the fused Adam step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fn.transforms._leaves import matching
from fn.tree import PyTree, can_donate, foreach_ok, live_leaves


def learning_rate_now(
    lr: float | Callable[[torch.Tensor], torch.Tensor | float],
    count: torch.Tensor,
    stored: torch.Tensor,
) -> torch.Tensor:
    """The learning rate of the next update: for a schedule ``lr``, ``lr(count)`` (``count``:
    the updates made before this one) with ``stored``'s dtype and device; for a constant, the
    state's ``stored`` value (so ``fn.set_hyperparams(state, lr=...)`` changes it)."""
    if not callable(lr):
        return stored
    value = lr(count)
    if isinstance(value, torch.Tensor):
        return value.to(device=stored.device, dtype=stored.dtype)
    return torch.full_like(stored, value)


def scale_leaves(updates: PyTree, factor: torch.Tensor, in_place: bool = False) -> PyTree:
    """``u * factor`` for every non-``None`` leaf (one ``torch._foreach_mul`` on eager); with
    ``in_place`` (donated updates), written into the leaves that can take it."""
    walk = live_leaves(updates)
    live = walk.at_live(0)
    in_place = in_place and can_donate(*live, factor)
    if foreach_ok(*live, scalars=(factor,)):
        if in_place:
            torch._foreach_mul_(live, factor)
        scaled = live if in_place else torch._foreach_mul(live, factor)
    else:
        scaled = [u.mul_(factor) if in_place else u * factor for u in live]
    return walk.rebuild(scaled)


def decoupled_decay(
    name: str, steps: PyTree, params: PyTree, lr: torch.Tensor, weight_decay: float
) -> PyTree:
    """AdamW's decoupled decay folded into the updates: ``((1 - lr * wd) p + s) - p`` per leaf
    with step ``s``, in ``torch.optim.AdamW``'s order (decay the param, then add the step). A
    ``None`` step stays ``None``; a ``None`` param under a step is an error."""
    if params is None:
        raise ValueError(f"{name}: decoupled weight decay needs params")
    check = matching(name, "a param is None where its update is not")
    walk = live_leaves(steps, params, check=check)
    ss, ps = walk.at_live(0), walk.at_live(1)
    keep = 1.0 - lr * weight_decay
    if foreach_ok(*ps, *ss, scalars=(keep,)):
        out = torch._foreach_mul(ps, keep)
        torch._foreach_add_(out, ss)
        torch._foreach_sub_(out, ps)
    else:
        out = [(p * keep + s) - p for p, s in zip(ps, ss, strict=True)]
    return walk.rebuild(out)
