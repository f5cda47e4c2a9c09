"""DiLoCo's outer rule: Nesterov SGD on the averaged pseudo-gradient."""

from __future__ import annotations

from fn.base import GradientTransformation
from fn.collectives.header import compressor_chain
from fn.transforms import sgd

__all__ = ["nesterov"]


def nesterov(
    compression: GradientTransformation, lr: float = 0.7, momentum: float = 0.9
) -> GradientTransformation:
    """DiLoCo's outer rule: the compressor's mean of the pseudo-gradients, then Nesterov SGD.

    .. math::
        \\hat\\Delta = C(\\delta_r), \\qquad b' = \\mu b + \\hat\\Delta, \\qquad
        u = -\\eta (\\hat\\Delta + \\mu b')

    ``chain(compression, fn.sgd(lr, momentum, nesterov=True))``: ``torch.optim.SGD`` with
    Nesterov momentum stepping the anchor, with the mean pseudo-gradient as its gradient. The
    defaults are DiLoCo's (Douillard et al. 2023, arXiv:2311.08105). ``momentum=0`` is plain
    outer SGD; with ``lr=1`` and an exact compressor the new anchor is the mean of the ranks'
    parameters. The momentum is the same on every rank. Where the compressor is a
    ``fn.collectives.Compressor`` (every kind of ``fn.diloco.compression``), so is the rule: its
    ``exchange`` sends the compressor's messages with the outer step's flag in their header
    (:func:`fn.diloco.outer_update`).

    Args:
        compression: the outer compressor (``fn.diloco.compression(...)``).
        lr: the outer learning rate ``eta``.
        momentum: ``mu`` >= 0.

    Returns:
        A GradientTransformation from this rank's pseudo-gradient to the anchor's update; its
        state is ``(compressor state, sgd state)``.

    Example:
        >>> from fn.collectives import Local
        >>> outer = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=Local()))
        >>> delta = {"w": torch.tensor([1.0])}
        >>> state = outer.init(delta)
        >>> outer.update(delta, state)[0]["w"]  # -0.7 (1 + 0.9 * 1)
        tensor([-1.3300])
    """
    return compressor_chain(compression, sgd(lr, momentum, nesterov=momentum > 0))
