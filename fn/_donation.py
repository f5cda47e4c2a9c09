"""Buffer donation: reading the ``donate`` keyword of a transform's ``update``.

The protocol is described in the docstring of :class:`fn.GradientTransformation`. These helpers
turn ``donate`` into the donated state and pick, leaf by leaf, the donated tensors that can
hold a result (same shape, dtype and device); a leaf that cannot is computed into a new tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from fn.tree import tree_flatten


def donating(donate: Any) -> bool:
    """Whether ``donate`` hands anything over (``None`` and ``False`` do not)."""
    return donate is not None and donate is not False


def donated_state(donate: Any, state: Any) -> Any:
    """The state whose tensors ``donate`` hands over: ``None`` (nothing donated), ``state``
    itself for ``donate=True``, else ``donate``.

    Raises:
        ValueError: ``donate`` is a state of another tree structure than ``state`` (where
            ``donate`` holds ``None``, that part of ``state`` is not donated).
    """
    if not donating(donate):
        return None
    if donate is True:
        return state
    try:  # a None in donate stands for a whole part of state that is not donated
        tree_flatten(donate)[1].flatten_up_to(state)
    except ValueError as err:
        raise ValueError(
            "donate must be True, None or a state of the same structure as state (None for a "
            f"part not donated), got a {type(donate).__name__} of another structure: {err}"
        ) from None
    return donate


def split_donated(name: str, donate: Any, count: int) -> list[Any]:
    """The donated members' states of a combinator whose state is a tuple of ``count`` member
    states: ``count`` times ``None`` or ``True``, or the entries of ``donate``.

    Raises:
        ValueError: a donated state with another number of entries.
    """
    if not donating(donate) or donate is True:
        return [donate if donate is True else None] * count
    if not isinstance(donate, (tuple, list)) or len(donate) != count:
        size = len(donate) if isinstance(donate, (tuple, list)) else type(donate).__name__
        raise ValueError(f"{name}: donate must be a state of {count} entries, got {size}")
    return list(donate)


def _matches(donated: Any, like: torch.Tensor) -> bool:
    return (
        isinstance(donated, torch.Tensor)
        and donated.is_contiguous()
        and donated.shape == like.shape
        and donated.dtype == like.dtype
        and donated.device == like.device
    )


def fits(donated: Any, like: torch.Tensor) -> bool:
    """Whether ``donated`` can hold a result like ``like``: a plain contiguous tensor of its
    shape, dtype and device, outside autograd."""
    return (
        _matches(donated, like)
        and not donated.requires_grad
        and not torch._C._functorch.is_functorch_wrapped_tensor(donated)
    )


def fitting(donated: Any, like: torch.Tensor) -> torch.Tensor | None:
    """``donated`` where it is a contiguous tensor of ``like``'s shape, dtype and device, else
    ``None`` (the caller allocates). Under vmap both may be batched: the collectives then
    compute purely and copy into it."""
    return donated if _matches(donated, like) else None


def eager(*tensors: torch.Tensor | None) -> bool:
    """Whether ``tensors`` are concrete: not under ``torch.compile``, none wrapped by vmap or
    another functorch transform (``None`` entries are ignored). Only then can fused kernels write
    into donated buffers; traced calls compute purely and copy."""
    if torch.compiler.is_compiling():
        return False
    return not any(
        t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors
    )


def can_donate(*tensors: torch.Tensor) -> bool:
    """Whether results can be written in place next to ``tensors``: eager, not under
    ``torch.compile``, and every tensor plain (:func:`fits` itself)."""
    return not torch.compiler.is_compiling() and all(fits(t, t) for t in tensors)


def buffer_like(donated: Any, like: torch.Tensor) -> torch.Tensor:
    """``donated`` where it :func:`fits` ``like``, else a new tensor like it (uninitialized)."""
    return donated if fits(donated, like) else torch.empty_like(like)


def donated_leaves(donated: Any, spec: Any) -> list[Any]:
    """The leaves of a donated subtree flattened like ``spec`` (its state's structure), or all
    ``None`` when nothing is donated or the structure differs."""
    if donated is None:
        return [None] * spec.num_leaves
    try:
        return spec.flatten_up_to(donated)
    except (TypeError, ValueError, RuntimeError):
        return [None] * spec.num_leaves


def storages_of(tree: Any) -> set[int]:
    """The addresses of the storages of the non-empty tensor leaves of ``tree`` (views of one
    tensor share one), to tell whether two trees share memory."""
    found = set()
    for leaf in torch.utils._pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.numel() > 0:
            try:
                found.add(leaf.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a tensor without storage (vmap)
                found.add(id(leaf))
    return found
