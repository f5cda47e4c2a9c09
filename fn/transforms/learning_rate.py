"""Scaling by the (negated) learning rate, kept in the state so that it can be changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from fn.base import GradientTransformation, donating
from fn.errors import check_finite_nonnegative, check_lr
from fn.transforms._learning_rate import decoupled_decay, learning_rate_now, scale_leaves
from fn.transforms._leaves import device_of

__all__ = ["Schedule", "ScaleByLearningRateState", "scale_by_learning_rate"]

Schedule = Callable[[torch.Tensor], "torch.Tensor | float"]
"""A learning-rate schedule ``schedule(count) -> lr``, which every ``lr`` argument of the
transforms takes. It is a torch-traceable function of the 0-dim int64 update count (0 at the
first update) returning a 0-dim tensor or a float.

Example:
    >>> halving = lambda count: 0.1 * 0.5**count
    >>> tx, params = fn.sgd(lr=halving), {"w": torch.zeros(1)}
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...     updates, state = tx.update({"w": torch.ones(1)}, state, params)
    ...     print(updates["w"])
    tensor([-0.1000])
    tensor([-0.0500])
"""


class ScaleByLearningRateState(NamedTuple):
    """The state of :func:`scale_by_learning_rate` (the last member of ``fn.sgd``, ``fn.adam``,
    ...); ``fn.set_hyperparams`` sets its ``lr``.

    Attributes:
        count: ``[]`` int64 tensor, the number of updates made so far.
        lr: ``[]`` fp32 tensor, the learning rate (with a schedule: the last value used).

    Example:
        >>> fn.sgd(0.1).init({"w": torch.zeros(2)})[-1]
        ScaleByLearningRateState(count=tensor(0), lr=tensor(0.1000))
    """

    count: torch.Tensor
    lr: torch.Tensor


def scale_by_learning_rate(
    lr: float | Schedule, *, decoupled_weight_decay: float = 0.0
) -> GradientTransformation:
    """Multiplies the updates by ``-lr`` (gradient descent), optionally with decoupled decay.

    .. math::
        u_t \\leftarrow -\\eta_t\\, u_t
        \\qquad\\text{or, with } \\lambda > 0,\\qquad
        u_t \\leftarrow \\big((1 - \\eta_t\\lambda)\\, p_{t-1} - \\eta_t u_t\\big) - p_{t-1}

    The decoupled form is AdamW's (Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019) in ``torch.optim.AdamW``'s order of operations: the param is
    scaled by ``1 - lr * lambda`` first, then the step is added. That order matters in fp32:
    ``p - lr * lambda * p`` drifts from ``torch.optim.AdamW`` by ~1e-6 over 200 steps.

    The learning rate is the state field ``lr``, a 0-dim fp32 tensor, so that
    ``fn.set_hyperparams(state, lr=3e-4)`` changes it without rebuilding the transform or
    recompiling a ``torch.compile``'d step. With a schedule, ``eta_t = schedule(count)`` is
    evaluated at every update from the state's counter (0 at the first update) and stored in
    ``lr`` (so a value set with ``set_hyperparams`` is overwritten at the next update).

    Args:
        lr: a finite real number >= 0, or a schedule ``count -> lr`` (else ``ValueError``,
            naming ``lr``).
        decoupled_weight_decay: AdamW's ``lambda`` (>= 0); ``update`` then needs ``params``.

    Returns:
        A GradientTransformation with state :class:`ScaleByLearningRateState`. ``None``
        updates stay ``None``. With ``donate`` the updates are scaled in place.

    Example:
        >>> tx = fn.scale_by_learning_rate(0.1)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> tx.update({"w": torch.ones(1)}, state)[0]
        {'w': tensor([-0.1000])}
        >>> state = fn.set_hyperparams(state, lr=0.5)  # no rebuild, no recompile
        >>> tx.update({"w": torch.ones(1)}, state)[0]
        {'w': tensor([-0.5000])}

        A schedule is a function of the update count (0 at the first update):

        >>> tx = fn.scale_by_learning_rate(lambda count: 0.1 * 0.5**count)
        >>> state = tx.init({"w": torch.zeros(1)})
        >>> for _ in range(3):
        ...     updates, state = tx.update({"w": torch.ones(1)}, state)
        >>> updates, state.lr
        ({'w': tensor([-0.0250])}, tensor(0.0250))
    """
    check_lr("scale_by_learning_rate", lr)
    check_finite_nonnegative(
        "scale_by_learning_rate", decoupled_weight_decay=decoupled_weight_decay
    )

    def init_fn(params):
        device = device_of(params)
        count = torch.zeros((), dtype=torch.int64, device=device)
        first = lr(count) if callable(lr) else lr
        return ScaleByLearningRateState(
            count, torch.as_tensor(first, dtype=torch.float32, device=device).clone()
        )

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        del extra
        current = learning_rate_now(lr, state.count, state.lr)
        updates = scale_leaves(updates, -current, in_place=donating(donate))
        if decoupled_weight_decay != 0.0:
            updates = decoupled_decay(
                "scale_by_learning_rate", updates, params, current, decoupled_weight_decay
            )
        return updates, ScaleByLearningRateState(state.count + 1, current)

    return GradientTransformation(init_fn, update_fn)
