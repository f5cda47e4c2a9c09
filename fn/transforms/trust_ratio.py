"""The layer-wise trust ratio of LARS/LAMB."""

from __future__ import annotations

import torch

from fn.base import EmptyState, GradientTransformation
from fn.transforms._leaves import check_nonnegative, check_ordered, check_shapes
from fn.tree import tree_map

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
        ``params``. ``None`` updates stay ``None``.
    """
    check_nonnegative(
        "scale_by_trust_ratio", min_norm=min_norm, trust_coefficient=trust_coefficient, eps=eps
    )
    if min_coeff is not None and max_coeff is not None:
        check_ordered("scale_by_trust_ratio", min_coeff=min_coeff, max_coeff=max_coeff)

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del extra
        if params is None:
            raise ValueError("scale_by_trust_ratio: update() needs params")

        def leaf(u, p):
            if p is None:
                raise ValueError("scale_by_trust_ratio: a param is None where its update is not")
            check_shapes("scale_by_trust_ratio", p, u)
            p_norm = torch.linalg.vector_norm(p.float()).clamp(min=min_norm)
            u_norm = torch.linalg.vector_norm(u.float()).clamp(min=min_norm)
            ratio = trust_coefficient * p_norm / (u_norm + eps)
            ratio = torch.where((p_norm == 0) | (u_norm == 0), torch.ones_like(ratio), ratio)
            if min_coeff is not None or max_coeff is not None:
                ratio = ratio.clamp(min=min_coeff, max=max_coeff)
            return u * ratio.to(u.dtype)

        return tree_map(leaf, updates, params), state

    return GradientTransformation(init_fn, update_fn)
