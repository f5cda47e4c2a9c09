"""The allocation-free compressed steps of 1-bit Adam and 0/1 Adam: the fast path beside the
pure per-leaf rules of ``onebit_adam_transform`` and ``zero_one_adam_transform``.

A donated compressed update (``donate=``, and ``fn.update_and_apply``) runs one of the steps
here: straight-line kernel and communication calls, in two passes over the leaves. The first
pass compresses, exchanges and checks every leaf (``compressed_allreduce_exchange``, which
writes nothing; a leaf the fast path does not fit runs its pure rule, which writes nothing
either); the second writes: the new errors into the donated state's buffers, then the update
into the gradients' buffers, or (``apply``) added to the param in place by
``fn.kernels.adam_apply``. 1-bit Adam's new momentum is the exchange's packed signs, kept as
they are, and the kernels read the previous one from its signs; 0/1 Adam's is written into the
donated state. So a failure on any rank and any leaf leaves every buffer intact, and the bits
are those of the pure rule (the tests compare them leaf by leaf).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fn import kernels
from fn.collectives import PackedSigns
from fn.collectives.onebit import (
    CompressedExchange,
    compressed_allreduce_exchange,
    write_errors,
    write_result,
)
from fn.errors import check_finite
from fn.transforms._leafwise import LeafInputs, Leaves, error_feedback
from fn.transforms._onebit_state import OnebitSettings, momentum
from fn.tree import eager, fits, fitting

# (g, leaf, *input_leaves) -> (update, new_leaf): the pure rule of the step
Rule = Callable[..., tuple[torch.Tensor | None, Any]]


def onebit_adam_step(
    h: OnebitSettings, rule: Rule, leaves: Leaves, eta: torch.Tensor, apply: bool
) -> list[tuple[torch.Tensor | None, Any]]:
    """1-bit Adam's compressed update (``rule``'s bits) of ``leaves`` (:func:`leaves_of` with
    the donated state) into the buffers of the donated state and the gradients (see the module
    docstring); with ``apply``, every fp32 param gets its update added in place and its update
    is ``None``. The new momentum is kept as the exchange's packed signs. Returns the
    ``(update, new_leaf)`` of every leaf with a gradient, for :func:`rebuilt`."""
    exchanges, pure = [], []
    for x in leaves.with_grad:  # compress, exchange, check: nothing written
        kept, v, ew, es = x.leaf
        mask, dense = x.inputs[1:]
        exchange = None
        if not bool(dense):
            errors = error_feedback(ew, es, x.g, h)
            previous = kept if mask is None else momentum(kept, v, mask)  # the kernels read signs
            exchange = compressed_allreduce_exchange(
                previous, *errors, comm=h.comm, grad=x.g, beta=h.b1,
                local_world_size=h.local_world_size,
            )  # fmt: skip
        exchanges.append(exchange)
        pure.append(rule(x.g, x.leaf, *x.inputs) if exchange is None else None)
    return [
        result if exchange is None else _write_onebit_adam_leaf(h, exchange, x, eta, apply)
        for x, exchange, result in zip(leaves.with_grad, exchanges, pure, strict=True)
    ]


def _write_onebit_adam_leaf(
    h: OnebitSettings, exchange: CompressedExchange, x: LeafInputs, eta: torch.Tensor, apply: bool
) -> tuple[torch.Tensor | None, Any]:
    """Writes one leaf of :func:`onebit_adam_step`: the errors (into the donated state's
    buffers), then the update into the gradient's buffer or, with ``apply``, added to the param
    (the gradient's buffer, read by the exchange, is then the kernels' scratch). The momentum
    is the exchange's packed signs: its values are written only where the update needs them
    as a tensor (into the gradient's buffer)."""
    _, v, _, _ = x.leaf
    p, mask, _ = x.inputs
    ew_new, es_new = _new_errors(exchange, x.spare)
    kept = PackedSigns(exchange.packed, exchange.scales)
    new_leaf = type(x.leaf)(kept, v, ew_new, es_new)
    # update_and_apply has checked that autograd records no param
    target = p.detach() if apply and isinstance(p, torch.Tensor) else None
    applies = target is not None and fits(target, v)
    settings = dict(eps=h.eps, bound=h.clip, weight_decay=h.weight_decay)
    scratch = fitting(x.g, v)
    if applies and mask is None:  # the momentum is read from its signs
        kernels.adam_apply(None, v, eta, target, root=scratch, signs=kept, **settings)
        return None, new_leaf
    m = write_result(exchange, torch.empty_like(v) if scratch is None else scratch)
    if mask is not None:
        m = masked(m, mask)
    if applies:
        kernels.adam_apply(m, v, eta, target, root=m, **settings)
        return None, new_leaf
    return adam_update_into(m, m, v, p, eta, **settings), new_leaf


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
                x.g, *error_feedback(ew, es, x.g, h), comm=h.comm,
                local_world_size=h.local_world_size,
            )  # fmt: skip
        elif fits_buffers and eager(x.g, m, v, a, x.spare.exp_avg):
            check_finite(x.g, "the local gradient")
            local = True
        fast.append(exchange is not None or local)
        exchanges.append(exchange)
        pure.append(None if fast[-1] else rule(x.g, x.leaf, *x.inputs))
    return [
        _write_zero_one_adam_leaf(h, exchange, x, frozen, eta) if is_fast else result
        for x, is_fast, exchange, result in zip(
            leaves.with_grad, fast, exchanges, pure, strict=True
        )
    ]


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
        ew, es = _new_errors(exchange, x.spare)
        mean = write_result(exchange, x.g)
        if mask is not None:
            mean = masked(mean, mask)
    # moving_average's rounding, into the donated buffer; the mean's buffer is scratch
    mean.mul_(1 - h.b1)
    m_new = torch.mul(m, h.b1, out=x.spare.exp_avg).add_(mean)
    update = adam_update_into(
        x.g, m_new, v, p, eta, eps=h.eps, bound=h.clip, weight_decay=h.weight_decay
    )
    a_new = a
    if frozen:
        a_out = fitting(x.spare.momentum_accumulator, a)
        a_new = a + update if a_out is None else torch.add(a, update, out=a_out)
    return update, type(x.leaf)(m_new, v, a_new, ew, es)


def _new_errors(
    exchange: CompressedExchange, spare: Any
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The new errors of ``exchange``, written into the error buffers of the donated leaf
    ``spare`` where they fit."""
    ew, es = exchange.worker_error, exchange.server_error
    return write_errors(exchange, fitting(spare.worker_error, ew), fitting(spare.server_error, es))


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
