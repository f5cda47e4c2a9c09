"""LAMB: Adam's direction with weight decay, rescaled per layer by the trust ratio."""

from __future__ import annotations

from fn.base import GradientTransformation, chain
from fn.errors import check_betas, check_finite_nonnegative, check_lr
from fn.transforms.adam_transform import scale_by_adam
from fn.transforms.learning_rate import Schedule, scale_by_learning_rate
from fn.transforms.trust_ratio import scale_by_trust_ratio
from fn.transforms.weight_decay import add_decayed_weights

__all__ = ["lamb"]


def lamb(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    min_coeff: float | None = None,
    max_coeff: float | None = None,
) -> GradientTransformation:
    """The LAMB optimizer.

    Per leaf (layer), with the bias-corrected moments of :func:`scale_by_adam`:

    .. math::
        r_t = \\frac{\\hat m_t}{\\sqrt{\\hat v_t} + \\epsilon} + \\lambda\\, p_{t-1}, \\qquad
        \\phi = \\frac{\\lVert p_{t-1} \\rVert_2}{\\lVert r_t \\rVert_2}
        \\ (1 \\text{ if either norm is } 0), \\qquad
        p_t = p_{t-1} - \\eta\\, \\phi\\, r_t

    ``chain(scale_by_adam(*betas, eps, bias_correction=...), add_decayed_weights(weight_decay),
    scale_by_trust_ratio(min_coeff=..., max_coeff=...), scale_by_learning_rate(lr))``.

    Reference: You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes", ICLR 2020.

    Args:
        lr: learning rate ``eta`` (float or schedule; in the state as ``lr``).
        betas: ``(beta1, beta2)``.
        eps: denominator term ``epsilon``.
        weight_decay: ``lambda``, added to the direction before the trust ratio.
        bias_correction: bias-correct the moments (DeepSpeed's ``FusedLamb`` option).
        min_coeff: optional lower clamp of the trust ratio (DeepSpeed's ``min_coeff``).
        max_coeff: optional upper clamp of the trust ratio (DeepSpeed's ``max_coeff``).

    Returns:
        The chained GradientTransformation; its state is ``(ScaleByAdamState, EmptyState(),
        EmptyState(), ScaleByLearningRateState)``.

    Raises:
        ValueError: naming the argument: ``betas`` that is not a pair of real numbers in
            [0, 1), ``lr`` (unless a schedule) or ``eps`` that is not a finite real number
            >= 0, a negative ``weight_decay``.

    Example:
        The trust ratio makes each layer's step ``lr`` times its param norm, whatever the
        gradient's scale:

        >>> params = {"w": torch.tensor([3.0, 4.0])}  # norm 5
        >>> tx = fn.lamb(lr=0.1)
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": torch.tensor([1e-3, -1e-3])}, state, params)
        >>> updates
        {'w': tensor([-0.3536,  0.3536])}
        >>> fn.tree.tree_l2_norm(updates)
        tensor(0.5000)
    """
    b1, b2 = check_betas("lamb", betas)
    check_finite_nonnegative("lamb", eps=eps)
    check_lr("lamb", lr)
    return chain(
        scale_by_adam(b1, b2, eps, bias_correction=bias_correction),
        add_decayed_weights(weight_decay),
        scale_by_trust_ratio(min_coeff=min_coeff, max_coeff=max_coeff),
        scale_by_learning_rate(lr),
    )
