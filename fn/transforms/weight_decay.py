"""Weight decay added to the updates (L2 regularization, or decoupled when placed after the
preconditioner)."""

from __future__ import annotations

import torch

from fn.base import GradientTransformation, identity
from fn.errors import check_finite_nonnegative
from fn.transforms._leaves import with_params
from fn.tree import can_donate

__all__ = ["add_decayed_weights"]


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """Adds ``weight_decay * params`` to the updates.

    .. math:: u_t \\leftarrow u_t + \\lambda\\, p_{t-1}

    Placed before a preconditioner (``scale_by_adam``) this is L2 regularization, as in
    ``torch.optim.Adam``; placed after it, followed by ``scale_by_learning_rate``, it is the
    decoupled weight decay of AdamW (Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019).

    Args:
        weight_decay: the non-negative coefficient ``lambda``.

    Returns:
        A stateless GradientTransformation (:class:`fn.EmptyState`). ``update`` needs ``params``
        unless ``weight_decay`` is 0. ``None`` updates stay ``None``; with ``donate`` the
        updates take the sums in place.

    Example:
        >>> tx = fn.add_decayed_weights(0.5)
        >>> params = {"w": torch.tensor([2.0, -4.0])}
        >>> tx.update({"w": torch.tensor([1.0, 1.0])}, tx.init(params), params)[0]
        {'w': tensor([ 2., -1.])}
    """
    check_finite_nonnegative("add_decayed_weights", weight_decay=weight_decay)
    if weight_decay == 0.0:
        return identity()

    def decay(u, p):
        return torch.add(u, p, alpha=weight_decay)

    def decay_in_place(u, p):
        return u.add_(p, alpha=weight_decay) if can_donate(u, p) else decay(u, p)

    return with_params("add_decayed_weights", decay, decay_in_place)
