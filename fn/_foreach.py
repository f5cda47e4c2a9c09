"""When the leaves of a tree can go through ``torch._foreach_*`` ops (one call per op)."""

from __future__ import annotations

import torch


def foreach_ok(*leaves: torch.Tensor) -> bool:
    """True for eager, plain tensors outside autograd: then one ``torch._foreach_*`` call per op
    over all leaves replaces a Python loop of per-leaf ops, as ``torch.optim``'s foreach Adam.
    Pass every tensor operand, scalars from the state included: under ``simulate`` a replicated
    state (e.g. the learning rate) can be batched while the updates are not.

    Otherwise callers go leaf by leaf: the foreach ops have no ``torch.func.vmap`` batching
    rules, in-place steps on fresh outputs that autograd saved (``sqrt``) would break the
    backward, and under ``torch.compile`` the per-leaf ops fuse anyway.
    """
    if not leaves or torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return not any((grad and t.requires_grad) or wrapped(t) for t in leaves)
