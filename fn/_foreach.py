"""When the leaves of a tree can go through ``torch._foreach_*`` ops (one call per op)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TypeVar

import torch

_Result = TypeVar("_Result")

# Set while ``per_leaf`` runs a function: every foreach_ok inside it answers False.
_PER_LEAF = contextvars.ContextVar("fn_per_leaf", default=False)


def foreach_blocker(*leaves: torch.Tensor) -> str | None:
    """Why the tensors cannot go through ``torch._foreach_*`` ops, or ``None`` when they can:
    eager, plain tensors outside autograd (see :func:`foreach_ok`)."""
    if not leaves:
        return "there are no tensors"
    if torch.compiler.is_compiling():
        return "it runs under torch.compile"
    if _PER_LEAF.get():
        return "per-leaf ops were asked for"
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if any(wrapped(t) for t in leaves):
        return "it runs under a torch.func transform (vmap, grad, ...)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in leaves):
        return "a tensor requires grad and autograd is recording"
    return None


def foreach_ok(*leaves: torch.Tensor) -> bool:
    """True for eager, plain tensors outside autograd: then one ``torch._foreach_*`` call per op
    over all leaves replaces a Python loop of per-leaf ops, as ``torch.optim``'s foreach Adam.
    Pass every tensor operand, scalars from the state included: under ``simulate`` a replicated
    state (e.g. the learning rate) can be batched while the updates are not.

    Otherwise callers go leaf by leaf: the foreach ops have no ``torch.func.vmap`` batching
    rules, in-place steps on fresh outputs that autograd saved (``sqrt``) would break the
    backward, and under ``torch.compile`` the per-leaf ops fuse anyway. Inside :func:`per_leaf`
    the answer is always False.
    """
    return foreach_blocker(*leaves) is None


def per_leaf(f: Callable[..., _Result], *args: object, **kwargs: object) -> _Result:
    """``f(*args, **kwargs)`` with :func:`foreach_ok` False throughout: eager code then runs the
    per-leaf ops that vmap, autograd and ``torch.compile`` run, with their rounding."""
    if torch.compiler.is_compiling():  # foreach_ok is False there already
        return f(*args, **kwargs)
    token = _PER_LEAF.set(True)
    try:
        return f(*args, **kwargs)
    finally:
        _PER_LEAF.reset(token)
