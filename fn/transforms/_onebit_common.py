"""Shared pieces of the 1-bit family: learning rates kept in the state, the non-finite check,
leaf bookkeeping and argument validation.

Nothing here communicates; the optimizers call ``fn.collectives`` themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fn.tree import PyTree

LearningRate = float | Callable[[torch.Tensor], torch.Tensor]


def init_lr(lr: LearningRate) -> torch.Tensor:
    """The ``lr`` state field at init: a 0-dim fp32 tensor (a schedule is read at count 0)."""
    if callable(lr):
        return torch.as_tensor(lr(torch.zeros((), dtype=torch.int64)), dtype=torch.float32)
    return torch.tensor(float(lr), dtype=torch.float32)


def current_lr(lr: LearningRate, stored: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The learning rate of the update being made.

    A constant ``lr`` is read from the state (so ``fn.set_hyperparams(state, lr=...)`` changes
    it); a schedule is evaluated at ``count``, the number of updates made before this one, and the
    value used is written back to the state.
    """
    if callable(lr):
        return torch.as_tensor(lr(count), dtype=torch.float32).to(stored.device)
    return stored


@torch.library.custom_op("fn_onebit::check_finite", mutates_args=())
def _check_finite(x: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(
            f"{what} contains non-finite values (NaN or Inf); no update was made and the "
            "optimizer state is unchanged"
        )
    return x.clone()


@_check_finite.register_fake
def _(x, what):
    return torch.empty_like(x)


def _check_finite_vmap(info, in_dims, x, what):
    del info
    return _check_finite(x, what), in_dims[0]


_check_finite.register_vmap(_check_finite_vmap)


def check_finite(x: torch.Tensor, what: str) -> torch.Tensor:
    """Returns a copy of ``x``; raises ``ValueError`` (message contains "non-finite") if ``x``
    holds a NaN or an Inf.

    A custom op, so that it raises on the host in eager mode, under ``torch.func.vmap`` (a
    ``Simulated`` comm: it then checks all ranks at once) and at run time under ``torch.compile``,
    without a data-dependent Python branch in the optimizer.
    """
    return _check_finite(x, what)


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


def check_nonnegative_int(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_betas(betas: tuple[float, float]) -> tuple[float, float]:
    b1, b2 = (float(b) for b in betas)
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got {betas!r}")
    return b1, b2
