"""Clipping by the global norm, as ``torch.nn.utils.clip_grad_norm_`` (optax's
``clip_by_global_norm``): the gradient ``g`` of every param at once is scaled by

.. math::
    \\min\\Big(1, \\frac{c}{\\lVert g \\rVert_2 + 10^{-6}}\\Big),

``c`` the largest norm allowed. The optimizers' ``max_grad_norm`` (``fn.optim``'s 1-bit
family, ``fn.fsdp.OnebitAdam`` and ``OnebitLamb``) is this rule, on a norm that their ranks
share (docs/algorithms.md, "Accumulation and clipping on FSDP2 and HSDP"): the setting's check
(:func:`check_max_norm`), the squared norm (:func:`squared_norm`) and the factor
(:func:`clip_factor`) are defined here once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["CLIP_EPS", "check_max_norm", "clip_factor", "squared_norm"]

CLIP_EPS = 1e-6
"""In the factor's denominator, as ``torch.nn.utils.clip_grad_norm_``'s."""


def check_max_norm(who: str, max_norm: Any) -> float | None:
    """``max_norm`` (an optimizer's ``max_grad_norm``), checked.

    Args:
        who: what takes it, which starts the message (``"fn.optim.OnebitAdam"``).
        max_norm: the norm to clip to, or ``None`` (no clipping).

    Returns:
        ``max_norm`` as given.

    Raises:
        ValueError: ``max_norm`` is neither ``None`` nor a positive, finite number (a bool is
            not one).

    Example:
        >>> from fn.transforms.clipping import check_max_norm
        >>> check_max_norm("clip", 1.0)
        1.0
        >>> check_max_norm("clip", 0)
        Traceback (most recent call last):
        ...
        ValueError: clip: max_grad_norm must be a positive, finite number or None, got 0
    """
    if max_norm is None:
        return None
    number = isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool)
    if not number or not 0 < max_norm < math.inf:
        raise ValueError(
            f"{who}: max_grad_norm must be a positive, finite number or None, got {max_norm!r}"
        )
    return max_norm


def squared_norm(tensors: Iterable[torch.Tensor | None]) -> float:
    """The squared L2 norm of ``tensors`` together (``None`` left out): each one's sum of
    squares in fp64, summed in order as a Python float (the same bits for the same tensors in
    the same order, on every rank).

    Example:
        >>> from fn.transforms.clipping import squared_norm
        >>> squared_norm([torch.tensor([3.0]), None, torch.tensor([4.0])])
        25.0
    """
    return sum((float(x.double().square().sum()) for x in tensors if x is not None), 0.0)


def clip_factor(square_norm: float, max_norm: float | None) -> float:
    """The factor that clips a gradient of squared norm ``square_norm`` to ``max_norm``:
    ``min(1, max_norm / (sqrt(square_norm) + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``;
    ``1.0`` without ``max_norm``, and for a norm that is not finite (the update then refuses
    the gradient that is not finite).

    Example:
        >>> from fn.transforms.clipping import clip_factor
        >>> clip_factor(25.0, 1.0) == 1.0 / (5.0 + 1e-6), clip_factor(25.0, None)
        (True, 1.0)
    """
    norm = math.sqrt(float(square_norm))
    if max_norm is None or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + CLIP_EPS))
