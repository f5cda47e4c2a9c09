"""Adam: the bias-corrected adaptive-moment preconditioner and the Adam/AdamW optimizers."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fn.base import GradientTransformation, chain
from fn.transforms._leaves import (
    check_betas,
    check_nonnegative,
    device_of,
    update_state_leaves,
)
from fn.transforms.learning_rate import Schedule, scale_by_learning_rate
from fn.transforms.weight_decay import add_decayed_weights
from fn.tree import PyTree, tree_map, tree_zeros_like

__all__ = ["ScaleByAdamState", "scale_by_adam", "adam", "adamw"]


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # [] int64: updates made so far
    mu: PyTree  # like params: first moment m
    nu: PyTree  # like params: second moment v


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, bias_correction: bool = True
) -> GradientTransformation:
    """Rescales the updates by Adam's moment estimates.

    For the ``t``-th update (``t = count + 1``) with incoming update ``g``:

    .. math::
        m_t = \\beta_1 m_{t-1} + (1 - \\beta_1) g, \\qquad
        v_t = \\beta_2 v_{t-1} + (1 - \\beta_2) g^2,

        u = \\frac{m_t / (1 - \\beta_1^t)}{\\sqrt{v_t} / \\sqrt{1 - \\beta_2^t} + \\epsilon}
        \\quad\\text{or, without bias correction,}\\quad
        u = \\frac{m_t}{\\sqrt{v_t} + \\epsilon}.

    The moments are computed as ``torch.optim.Adam`` does (``m.lerp(g, 1 - b1)``,
    ``v * b2 + (1 - b2) * g * g``). A leaf whose update is ``None`` keeps its moments unchanged;
    the counter is shared by all leaves. Non-finite updates propagate into the moments, as in
    ``torch.optim`` (check with ``fn.tree.tree_all_finite`` to skip such steps).

    Reference: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the denominator, >= 0.
        bias_correction: divide the moments by ``1 - beta^t`` (Adam) or not (DeepSpeed's
            1-bit family).

    Returns:
        A GradientTransformation with state :class:`ScaleByAdamState`; moments have the
        params' shapes and dtypes.
    """
    b1, b2 = check_betas("scale_by_adam", (b1, b2))
    check_nonnegative("scale_by_adam", eps=eps)

    def init_fn(params):
        count = torch.zeros((), dtype=torch.int64, device=device_of(params))
        return ScaleByAdamState(count, tree_zeros_like(params), tree_zeros_like(params))

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        mu = update_state_leaves(
            "scale_by_adam", lambda m, g: torch.lerp(m, g, 1.0 - b1), state.mu, updates
        )
        nu = update_state_leaves(
            "scale_by_adam",
            lambda v, g: torch.addcmul(v * b2, g, g, value=1.0 - b2),
            state.nu,
            updates,
        )
        count = state.count + 1
        if bias_correction:
            bc1 = _bias_correction(b1, count)
            bc2_sqrt = _bias_correction(b2, count).sqrt()
            # Same ops and rounding as (m / bc1) / (sqrt(v) / bc2_sqrt + eps); the in-place
            # steps only touch fresh temporaries (two fewer full-size allocations per leaf).
            updates = tree_map(
                lambda g, m, v: (m / bc1).div_((v.sqrt() / bc2_sqrt).add_(eps)), updates, mu, nu
            )
        else:
            updates = tree_map(lambda g, m, v: m / (v.sqrt() + eps), updates, mu, nu)
        return updates, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init_fn, update_fn)


def _bias_correction(beta: float, count: torch.Tensor) -> torch.Tensor:
    """``1 - beta**count`` as fp32, computed as ``-expm1(count * log(beta))``: the direct form
    cancels catastrophically in fp32 (``1 - 0.999**1`` keeps only ~4 significant digits)."""
    if beta == 0.0:
        return torch.ones_like(count, dtype=torch.float32)
    return -torch.expm1(count.to(torch.float32) * math.log(beta))


def adam(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adam with L2 weight decay, as ``torch.optim.Adam``.

    .. math::
        g \\leftarrow g + \\lambda p_{t-1}, \\quad
        p_t = p_{t-1} - \\eta\\, \\frac{\\hat m_t}{\\sqrt{\\hat v_t} + \\epsilon}

    with the bias-corrected moments of :func:`scale_by_adam` taken of the decayed ``g``.
    ``chain(add_decayed_weights(weight_decay), scale_by_adam(*betas, eps),
    scale_by_learning_rate(lr))``.

    Reference: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.

    Args:
        lr: learning rate ``eta`` (float or schedule; in the state as ``lr``).
        betas: ``(beta1, beta2)``.
        eps: denominator term ``epsilon``.
        weight_decay: L2 coefficient ``lambda`` added to the gradient.

    Returns:
        The chained GradientTransformation; its state is
        ``(EmptyState(), ScaleByAdamState, ScaleByLearningRateState)``.
    """
    return chain(
        add_decayed_weights(weight_decay),
        scale_by_adam(*betas, eps),
        scale_by_learning_rate(lr),
    )


def adamw(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
) -> GradientTransformation:
    """Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    .. math::
        p_t = (1 - \\eta\\lambda)\\, p_{t-1}
        - \\eta\\, \\frac{\\hat m_t}{\\sqrt{\\hat v_t} + \\epsilon}

    ``chain(scale_by_adam(*betas, eps), scale_by_learning_rate(lr,
    decoupled_weight_decay=weight_decay))``: the decay is scaled by the current ``lr``, so a new
    ``lr`` set with ``fn.set_hyperparams`` scales both, and it is applied in
    ``torch.optim.AdamW``'s order (see :func:`scale_by_learning_rate`).

    Reference: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.

    Args:
        lr: learning rate ``eta`` (float or schedule; in the state as ``lr``).
        betas: ``(beta1, beta2)``.
        eps: denominator term ``epsilon``.
        weight_decay: decoupled decay coefficient ``lambda``.

    Returns:
        The chained GradientTransformation; its state is
        ``(ScaleByAdamState, ScaleByLearningRateState)``.
    """
    return chain(
        scale_by_adam(*betas, eps),
        scale_by_learning_rate(lr, decoupled_weight_decay=weight_decay),
    )
