"""Momentum (``trace``) and stochastic gradient descent as ``torch.optim.SGD``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from fn.base import GradientTransformation, chain, donated_state
from fn.errors import check_finite_nonnegative, check_lr
from fn.transforms._leaves import device_of, in_dtypes_of, matching
from fn.transforms.learning_rate import Schedule, scale_by_learning_rate
from fn.transforms.weight_decay import add_decayed_weights
from fn.tree import (
    PyTree,
    buffer_like,
    can_donate,
    donated_leaves,
    live_leaves,
    tree_leaves,
    tree_zeros_like,
)

__all__ = ["TraceState", "trace", "sgd"]


class TraceState(NamedTuple):
    """The state of :func:`trace` (and of ``fn.sgd`` with momentum: its ``state[1]``).

    Attributes:
        count: ``[]`` int64 tensor, the number of updates made so far.
        trace: like params, the momentum buffer :math:`b`.

    Example:
        >>> fn.trace(decay=0.9).init({"w": torch.zeros(2)})
        TraceState(count=tensor(0), trace={'w': tensor([0., 0.])})
    """

    count: torch.Tensor
    trace: PyTree


def trace(
    decay: float, nesterov: bool = False, *, dampening: float = 0.0
) -> GradientTransformation:
    """Heavy-ball momentum, as in ``torch.optim.SGD``.

    .. math::
        b_1 = g_1, \\qquad b_t = \\mu\\, b_{t-1} + (1 - \\tau)\\, g_t \\ (t > 1), \\qquad
        u_t = g_t + \\mu\\, b_t \\ \\text{(Nesterov)} \\ \\text{or} \\ u_t = b_t

    with momentum ``mu = decay`` and dampening ``tau``. The buffer starts as the first
    gradient, so dampening does not apply to the first update (``torch.optim.SGD``'s rule; with
    ``tau = 0`` this equals starting from zeros). The first update is the first of the shared
    counter: a leaf whose update is ``None`` keeps its buffer unchanged.

    References: Polyak, "Some methods of speeding up the convergence of iteration methods",
    1964; Sutskever et al., "On the importance of initialization and momentum in deep
    learning", ICML 2013 (Nesterov form).

    Args:
        decay: momentum ``mu`` >= 0.
        nesterov: use Nesterov momentum (needs ``decay > 0`` and ``dampening == 0``).
        dampening: ``tau`` >= 0.

    Returns:
        A GradientTransformation with state :class:`TraceState`.

    Example:
        >>> tx = fn.trace(0.9)
        >>> grads = {"w": torch.tensor([0.5, 0.5])}
        >>> state = tx.init(grads)
        >>> updates, state = tx.update(grads, state)  # b_1 = g_1
        >>> updates, state = tx.update(grads, state)  # b_2 = 0.9 b_1 + g_2
        >>> updates, state.count
        ({'w': tensor([0.9500, 0.9500])}, tensor(2))
    """
    check_finite_nonnegative("trace", decay=decay, dampening=dampening)
    if nesterov and (decay <= 0.0 or dampening != 0.0):
        raise ValueError("trace: Nesterov momentum requires a momentum and zero dampening")

    def init_fn(params):
        count = torch.zeros((), dtype=torch.int64, device=device_of(params))
        return TraceState(count, tree_zeros_like(params))

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        del params, extra
        check = matching("trace", "an update where the state has no momentum buffer")
        walk = live_leaves(updates, state.trace, structure=state.trace, check=check)
        donated = donated_state(donate, state)
        if donated is not None and can_donate(*tree_leaves((updates, state))):
            return _trace_donated(walk, state, donated.trace, decay, nesterov, dampening)
        first = state.count == 0 if dampening != 0.0 else None
        gs, bs = walk.at_live(0), walk.at_live(1)
        gs = in_dtypes_of(gs, bs)  # the momentum keeps its dtype, the params'
        new_bs = [trace_leaf(b, g, decay, dampening, first) for g, b in zip(gs, bs, strict=True)]
        out = new_bs
        if nesterov:
            out = [torch.add(g, b, alpha=decay) for g, b in zip(gs, new_bs, strict=True)]
        return walk.rebuild(out), TraceState(state.count + 1, walk.rebuild(new_bs, fill=1))

    return GradientTransformation(init_fn, update_fn)


def trace_leaf(b, g, decay, dampening=0.0, first=None):
    """One leaf's momentum buffer after the update ``g``: ``b * decay + g``, or with
    dampening ``b * decay + (1 - dampening) * g`` and ``g`` itself at the first update
    (``first``: a 0-dim bool tensor). :func:`trace` returns it, or ``g + decay * b`` (Nesterov),
    as the update."""
    if dampening == 0.0:
        return torch.add(b * decay, g)
    return torch.where(first, g, torch.add(b * decay, g, alpha=1.0 - dampening))


def _trace_donated(walk, state, donated, decay, nesterov, dampening):
    """:func:`trace`'s update on the leaf walk ``walk`` (of the updates and the momentum) with
    the ops of :func:`trace_leaf` written into the donated buffers (each new momentum into its
    donated leaf, where it fits) and the updates into their own tensors, so that no update is a
    tensor of the state."""
    spares = donated_leaves(donated, walk.spec)
    first = state.count == 0
    new_bs, out = [], []
    for i, g, b in zip(walk.live, walk.at_live(0), walk.at_live(1), strict=True):
        new = torch.mul(b, decay, out=buffer_like(spares[i], b))
        if dampening == 0.0:
            new.add_(g)
        else:
            torch.where(first, g, new.add_(g, alpha=1.0 - dampening), out=new)
        new_bs.append(new)
        out.append(g.add_(new, alpha=decay) if nesterov else g.copy_(new))
    return walk.rebuild(out), TraceState(state.count + 1, walk.rebuild(new_bs, fill=1))


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    dampening: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    .. math::
        g_t \\leftarrow g_t + \\lambda p_{t-1}, \\qquad
        p_t = p_{t-1} - \\eta\\, u_t

    with ``u_t`` the :func:`trace` of ``g_t`` (or ``g_t`` itself without momentum).
    ``chain(add_decayed_weights(weight_decay), trace(momentum, nesterov, dampening=dampening),
    scale_by_learning_rate(lr))``; the ``trace`` is left out when ``momentum == 0``.

    Reference: Robbins & Monro, "A Stochastic Approximation Method", 1951.

    Args:
        lr: learning rate ``eta`` (float or schedule; in the state as ``lr``).
        momentum: ``mu`` >= 0.
        nesterov: Nesterov momentum.
        weight_decay: L2 coefficient ``lambda`` added to the gradient.
        dampening: momentum dampening ``tau``.

    Returns:
        The chained GradientTransformation.

    Raises:
        ValueError: naming the argument: ``lr`` that is neither a schedule nor a finite real
            number >= 0, a negative ``momentum``, ``weight_decay`` or ``dampening``; Nesterov
            momentum without a momentum or with dampening.

    Example:
        >>> import torch
        >>> import fn
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> grads = {"w": torch.tensor([0.5, 0.5])}
        >>> tx = fn.sgd(lr=0.1, momentum=0.9)
        >>> state = tx.init(params)
        >>> updates, state = tx.update(grads, state, params)
        >>> params = fn.apply_updates(params, updates)
        >>> updates, state = tx.update(grads, state, params)  # momentum 0.9 * 0.5 + 0.5
        >>> updates
        {'w': tensor([-0.0950, -0.0950])}
    """
    check_lr("sgd", lr)
    check_finite_nonnegative("sgd", momentum=momentum, dampening=dampening)
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError("sgd: Nesterov momentum requires a momentum and zero dampening")
    momentum_tx = [trace(momentum, nesterov, dampening=dampening)] if momentum != 0.0 else []
    return chain(add_decayed_weights(weight_decay), *momentum_tx, scale_by_learning_rate(lr))
