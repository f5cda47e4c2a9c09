"""The allocation-free compressed steps of 1-bit Adam and 0/1 Adam: the fast path beside the
pure per-leaf rules of ``onebit_adam_transform`` and ``zero_one_adam_transform``.

A donated compressed update (``donate=``, and ``fn.update_and_apply``) runs one of the steps
here: straight-line kernel and communication calls, in two passes over the leaves. The first
pass compresses, exchanges and checks every leaf (``compressed_allreduce_exchange``, which
writes nothing; a leaf the fast path does not fit runs its pure rule, which writes nothing
either); the second writes: the new errors, then the momentum and the update into the donated
state's and the gradients' buffers, or (``apply``) the update added to the param in place by
``fn.kernels.adam_apply``. So a failure on any rank and any leaf leaves every buffer intact, and
the bits are those of the pure rule (the tests compare them leaf by leaf).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fn import kernels
from fn.collectives.onebit import (
    CompressedExchange,
    compressed_allreduce_exchange,
    write_errors,
    write_result,
)
from fn.errors import check_finite
from fn.transforms._leafwise import LeafInputs, Leaves, OnebitSettings
from fn.tree import eager, fits, fitting

# (g, leaf, *input_leaves) -> (update, new_leaf): the pure rule of the step
Rule = Callable[..., tuple[torch.Tensor | None, Any]]


def onebit_adam_step(
    h: OnebitSettings, rule: Rule, leaves: Leaves, eta: torch.Tensor, apply: bool
) -> list[tuple[torch.Tensor | None, Any]]:
    """1-bit Adam's compressed update (``rule``'s bits) of ``leaves`` (:func:`leaves_of` with
    the donated state) into the buffers of the donated state and the gradients (see the module
    docstring); with ``apply``, every fp32 param gets its update added in place and its update
    is ``None``. Returns the ``(update, new_leaf)`` of every leaf with a gradient, for
    :func:`rebuilt`."""
    exchanges, pure = [], []
    for x in leaves.with_grad:  # compress, exchange, check: nothing written
        m, _, ew, es = x.leaf
        dense = x.inputs[2]
        exchange = None
        if not bool(dense):
            exchange = compressed_allreduce_exchange(
                m, ew, es, comm=h.comm, grad=x.g, beta=h.b1, local_world_size=h.local_world_size
            )
        exchanges.append(exchange)
        pure.append(rule(x.g, x.leaf, *x.inputs) if exchange is None else None)
    results = []
    for x, exchange, result in zip(leaves.with_grad, exchanges, pure, strict=True):
        if exchange is None:
            results.append(result)
        else:
            results.append(_write_onebit_adam_leaf(h, exchange, x, eta, apply))
    return results


def _write_onebit_adam_leaf(
    h: OnebitSettings, exchange: CompressedExchange, x: LeafInputs, eta: torch.Tensor, apply: bool
) -> tuple[torch.Tensor | None, Any]:
    """Writes one leaf of :func:`onebit_adam_step`: the errors, then the momentum and the
    update (the gradient's buffer) or, with ``apply``, the momentum as the update is added to
    the param (the gradient's buffer, read by the exchange, is the kernel's scratch)."""
    m, v, ew, es = x.leaf
    p, mask, _ = x.inputs
    spare = x.spare
    ew_new, es_new = write_errors(
        exchange, fitting(spare.worker_error, ew), fitting(spare.server_error, es)
    )
    m_new = fitting(spare.exp_avg, m)
    m_new = torch.empty_like(m) if m_new is None else m_new
    # update_and_apply has checked that autograd records no param
    target = p.detach() if apply and isinstance(p, torch.Tensor) else None
    applies = target is not None and fits(target, m)
    settings = dict(eps=h.eps, bound=h.clip, weight_decay=h.weight_decay)
    if applies and mask is None:  # the momentum is written by the pass that adds the update
        signs = (exchange.packed, exchange.scales)
        kernels.adam_apply(m_new, v, eta, target, root=fitting(x.g, m), signs=signs, **settings)
        return None, type(x.leaf)(m_new, v, ew_new, es_new)
    m_new = write_result(exchange, m_new)
    if mask is not None:
        m_new = masked(m_new, mask)
    new_leaf = type(x.leaf)(m_new, v, ew_new, es_new)
    if applies:
        kernels.adam_apply(m_new, v, eta, target, root=fitting(x.g, m_new), **settings)
        return None, new_leaf
    return adam_update_into(fitting(x.g, m_new), m_new, v, p, eta, **settings), new_leaf


def zero_one_adam_step(
    h: OnebitSettings, rule: Rule, leaves: Leaves, frozen: bool, eta: torch.Tensor
) -> list[tuple[torch.Tensor, Any]]:
    """0/1 Adam's 1-bit step (``frozen=False``) or local step (``frozen=True``), ``rule``'s
    bits, of ``leaves`` (:func:`leaves_of` with the donated state) into the buffers of the
    donated state and the gradients (see the module docstring). Returns the ``(update,
    new_leaf)`` of every leaf with a gradient, for :func:`rebuilt`."""
    fast, exchanges, pure = [], [], []
    for x in leaves.with_grad:  # compress, exchange, check: nothing written
        m, v, a, ew, es = x.leaf
        fits_buffers = fitting(x.spare.exp_avg, m) is not None and fits(x.g, m)
        exchange, local = None, False
        if fits_buffers and not frozen:
            exchange = compressed_allreduce_exchange(
                x.g, ew, es, comm=h.comm, local_world_size=h.local_world_size
            )
        elif fits_buffers and eager(x.g, m, v, a, x.spare.exp_avg):
            check_finite(x.g, "the local gradient")
            local = True
        fast.append(exchange is not None or local)
        exchanges.append(exchange)
        pure.append(None if fast[-1] else rule(x.g, x.leaf, *x.inputs))
    results = []
    for x, is_fast, exchange, result in zip(leaves.with_grad, fast, exchanges, pure, strict=True):
        if is_fast:
            result = _write_zero_one_adam_leaf(h, exchange, x, frozen, eta)
        results.append(result)
    return results


def _write_zero_one_adam_leaf(
    h: OnebitSettings,
    exchange: CompressedExchange | None,
    x: LeafInputs,
    frozen: bool,
    eta: torch.Tensor,
) -> tuple[torch.Tensor, Any]:
    """Writes one leaf of :func:`zero_one_adam_step`: the errors and the gradient's mean (into
    the gradient's buffer; a local step uses the gradient itself), the momentum, the update
    (into the gradient's buffer) and, on a local step, the accumulator."""
    m, v, a, ew, es = x.leaf
    p, mask = x.inputs
    mean = x.g
    if exchange is not None:
        spare = x.spare
        ew, es = write_errors(
            exchange, fitting(spare.worker_error, ew), fitting(spare.server_error, es)
        )
        mean = write_result(exchange, x.g)
        if mask is not None:
            mean = masked(mean, mask)
    m_new = moving_average_into(x.spare.exp_avg, m, h.b1, mean)
    update = adam_update_into(
        x.g, m_new, v, p, eta, eps=h.eps, bound=h.clip, weight_decay=h.weight_decay
    )
    a_new = a
    if frozen:
        a_out = fitting(x.spare.momentum_accumulator, a)
        a_new = a + update if a_out is None else torch.add(a, update, out=a_out)
    return update, type(x.leaf)(m_new, v, a_new, ew, es)


def moving_average_into(
    out: torch.Tensor, x: torch.Tensor, beta: float, y: torch.Tensor
) -> torch.Tensor:
    """:func:`moving_average` (``beta * x + (1 - beta) * y``, the same rounding) written into
    ``out`` (which may be ``x``), with ``y``'s buffer as scratch: ``y`` is overwritten by
    ``(1 - beta) * y``. No temporary."""
    y.mul_(1 - beta)
    return torch.mul(x, beta, out=out).add_(y)


def adam_update_into(
    out: torch.Tensor | None,
    m: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor | None,
    eta: torch.Tensor,
    *,
    eps: float,
    bound: float | None,
    weight_decay: float,
) -> torch.Tensor:
    """The 1-bit family's Adam update ``-eta * (clamp(m / (sqrt(v) + eps), -bound, bound) +
    weight_decay * p)`` (no clamp for ``bound=None``) written into ``out`` (a fresh tensor
    when ``None``) by ``fn.kernels.adam_direction``: the bits of the torch expression."""
    out = torch.empty_like(m) if out is None else out
    decayed = p.float() if weight_decay > 0 else None
    return kernels.adam_direction(
        m, v, eta, out, eps=eps, bound=bound, weight_decay=weight_decay, p=decayed
    )


def masked(m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``m * mask``, written into ``m`` where the product has ``m``'s shape and dtype (the
    same bits)."""
    if (
        torch.result_type(m, mask) == m.dtype
        and torch.broadcast_shapes(m.shape, mask.shape) == m.shape
    ):
        return m.mul_(mask)
    return m * mask
