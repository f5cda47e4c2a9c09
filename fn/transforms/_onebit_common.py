"""Shared pieces of the 1-bit family: learning rates kept in the state, the non-finite check,
leaf bookkeeping and argument validation.

Nothing here communicates; the optimizers call ``fn.collectives`` themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fn._validation import finite_or_raise
from fn.tree import PyTree

LearningRate = float | Callable[[torch.Tensor], torch.Tensor]


def init_lr(lr: LearningRate) -> torch.Tensor:
    """The ``lr`` state field at init: a 0-dim fp32 tensor (a schedule is read at count 0)."""
    if callable(lr):
        return torch.as_tensor(lr(torch.zeros((), dtype=torch.int64)), dtype=torch.float32)
    return torch.tensor(float(lr), dtype=torch.float32)


def moving_average(x: torch.Tensor, beta: float, y: torch.Tensor) -> torch.Tensor:
    """``beta * x + (1 - beta) * y``, rounded as written, with one fresh full-size tensor fewer
    (the sum goes into the fresh product)."""
    return (beta * x).add_((1 - beta) * y)


def moving_average_of_squares(x: torch.Tensor, beta: float, y: torch.Tensor) -> torch.Tensor:
    """``beta * x + (1 - beta) * y * y``, rounded as written (``((1 - beta) * y) * y``), with
    two fresh full-size tensors fewer."""
    return (beta * x).add_(((1 - beta) * y).mul_(y))


def check_finite(x: torch.Tensor, what: str) -> torch.Tensor:
    """Returns ``x`` (a copy under vmap or compile); raises ``ValueError`` (message contains
    "non-finite") if ``x`` holds a NaN or an Inf, also under ``torch.func.vmap`` (``Simulated``:
    all ranks are checked at once) and at run time under ``torch.compile`` (see
    ``fn._validation``).
    """
    return finite_or_raise(
        x,
        f"{what} contains non-finite values (NaN or Inf); no update was made and the "
        "optimizer state is unchanged",
    )


def leaves_or_nones(tree: PyTree | None, spec: Any) -> list[Any]:
    """``tree`` flattened up to ``spec``, or ``None`` for every leaf when ``tree`` is ``None``."""
    if tree is None:
        return [None] * spec.num_leaves
    return spec.flatten_up_to(tree)


def check_shape(grad: torch.Tensor, like: torch.Tensor, index: int) -> torch.Tensor:
    """``grad`` as fp32; raises ``ValueError`` unless it has its state's shape (no broadcasting)."""
    if grad.shape != like.shape:
        raise ValueError(
            f"gradient leaf {index} has shape {tuple(grad.shape)}, its state has "
            f"{tuple(like.shape)}"
        )
    return grad.float()


def require_params(params: PyTree | None, why: str) -> None:
    if params is None:
        raise ValueError(f"{why} needs the params: call update(grads, state, params, step=t)")


def resolve_plan(
    step: int | None,
    plan: Any,
    make_plan: Callable[[int], Any],
    plan_type: type,
    compressed: bool,
    phase: str,
) -> Any:
    """The plan of the update being made, from exactly one of ``step`` and ``plan``.

    ``step`` (a Python int) is turned into ``make_plan(step)`` on the host; a given ``plan`` must
    be a ``plan_type`` (``opt.plan(t)``). Both ways give the same plan, hence the same update.

    Raises:
        TypeError: if neither or both are given, or ``plan`` has the wrong type.
        ValueError: if ``step`` is not an int >= 1, or the plan is not one of ``phase``
            (``plan.compressed != compressed``).
    """
    if (step is None) == (plan is None):
        raise TypeError(
            "pass exactly one of step=t (the 1-based update count) and plan=opt.plan(t)"
        )
    if plan is None:
        plan, where = make_plan(check_nonnegative_int("step", step, 1)), f"update {step}"
    elif not isinstance(plan, plan_type):
        raise TypeError(f"plan must be a {plan_type.__name__} (opt.plan(t)), got {plan!r}")
    else:
        where = f"the update planned as {plan}"
    if plan.compressed != compressed:
        raise ValueError(f"{where} is not a {phase} update")
    return plan


def check_nonnegative_int(name: str, value: int, minimum: int = 0, why: str = "") -> int:
    """``value``; raises ``ValueError`` (naming ``name``, then ``why``) unless it is an int (not a
    bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        reason = f": {why}" if why else ""
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}{reason}")
    return value


def check_betas(betas: tuple[float, float]) -> tuple[float, float]:
    b1, b2 = (float(b) for b in betas)
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got {betas!r}")
    return b1, b2
