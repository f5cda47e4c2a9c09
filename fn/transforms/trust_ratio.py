"""The layer-wise trust ratio of LARS/LAMB."""

from __future__ import annotations

import torch

from fn.base import GradientTransformation
from fn.errors import check_finite_nonnegative, check_nonnegative, check_ordered
from fn.transforms._leaves import with_params
from fn.tree import can_donate

__all__ = ["scale_by_trust_ratio"]


def scale_by_trust_ratio(
    min_norm: float = 0.0,
    trust_coefficient: float = 1.0,
    eps: float = 0.0,
    *,
    min_coeff: float | None = None,
    max_coeff: float | None = None,
) -> GradientTransformation:
    """Scales each leaf's update by the ratio of the param norm to the update norm.

    .. math::
        r = c \\, \\frac{\\max(\\lVert p \\rVert_2, n_0)}{\\max(\\lVert u \\rVert_2, n_0)
        + \\epsilon}, \\qquad r \\leftarrow 1 \\ \\text{if either norm is } 0, \\qquad
        r \\leftarrow \\mathrm{clamp}(r, r_{\\min}, r_{\\max}), \\qquad u \\leftarrow r\\, u

    per leaf (per layer), with ``n_0 = min_norm``, ``c = trust_coefficient``. The clamp is
    DeepSpeed's (``min_coeff``, ``max_coeff``; off by default) and applies to the ratio 1 too.

    Reference: You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
    minutes", ICLR 2020 (LAMB).

    Args:
        min_norm: lower bound ``n_0`` on both norms.
        trust_coefficient: ``c``.
        eps: added to the update norm.
        min_coeff: optional lower clamp of the ratio.
        max_coeff: optional upper clamp of the ratio.

    Returns:
        A stateless GradientTransformation (:class:`fn.EmptyState`); ``update`` needs
        ``params``. ``None`` updates stay ``None``; with ``donate`` the updates are scaled in
        place.

    Example:
        >>> import torch
        >>> import fn
        >>> tx = fn.scale_by_trust_ratio()
        >>> params = {"w": torch.tensor([3.0, 4.0])}  # norm 5
        >>> updates = {"w": torch.tensor([0.0, 0.5])}  # norm 0.5: scaled by 5 / 0.5
        >>> scaled, _ = tx.update(updates, tx.init(params), params)
        >>> scaled["w"]
        tensor([0., 5.])
    """
    check_finite_nonnegative(
        "scale_by_trust_ratio", min_norm=min_norm, trust_coefficient=trust_coefficient, eps=eps
    )
    if min_coeff is not None:
        check_finite_nonnegative("scale_by_trust_ratio", min_coeff=min_coeff)
    if max_coeff is not None:  # may be infinite: no upper bound
        check_nonnegative("scale_by_trust_ratio", max_coeff=max_coeff)
    if min_coeff is not None and max_coeff is not None:
        check_ordered("scale_by_trust_ratio", min_coeff=min_coeff, max_coeff=max_coeff)

    def ratio(u, p):
        p_norm, u_norm = torch.linalg.vector_norm(p.float()), torch.linalg.vector_norm(u.float())
        settings = (min_norm, trust_coefficient, eps, min_coeff, max_coeff)
        return trust_ratio_of_norms(p_norm, u_norm, *settings).to(u.dtype)

    def scale(u, p):
        return u * ratio(u, p)

    def scale_in_place(u, p):
        return u.mul_(ratio(u, p)) if can_donate(u) else scale(u, p)

    return with_params("scale_by_trust_ratio", scale, scale_in_place)


def trust_ratio_of_norms(
    p_norm: torch.Tensor,
    u_norm: torch.Tensor,
    min_norm: float = 0.0,
    trust_coefficient: float = 1.0,
    eps: float = 0.0,
    min_coeff: float | None = None,
    max_coeff: float | None = None,
) -> torch.Tensor:
    """The 0-dim fp32 trust ratio of one leaf from the norms of its param and update (0-dim
    fp32, however they were summed: a sharded leaf's come from the sums of its shards), as
    :func:`scale_by_trust_ratio` defines it: the fallback 1 for a zero norm comes before the
    clamp, so it is clamped too."""
    p_norm = p_norm.clamp(min=min_norm)
    u_norm = u_norm.clamp(min=min_norm)
    ratio = trust_coefficient * p_norm / (u_norm + eps)
    ratio = torch.where((p_norm == 0) | (u_norm == 0), torch.ones_like(ratio), ratio)
    if min_coeff is not None or max_coeff is not None:
        ratio = ratio.clamp(min=min_coeff, max=max_coeff)
    return ratio
