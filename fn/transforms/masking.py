"""Applying a transform to a subset of the leaves."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from fn.base import GradientTransformation, OptState, donated_state, donating, stateless
from fn.tree import PyTree, tree_flatten, tree_map, tree_unflatten

__all__ = ["MaskedState", "masked", "set_to_zero"]


class MaskedState(NamedTuple):
    """The state of :func:`masked`.

    Attributes:
        inner_state: the inner transform's state, ``None`` at every masked-out leaf.

    Example:
        >>> tx = fn.masked(fn.sgd(0.1, momentum=0.9), {"w": True, "b": False})
        >>> state = tx.init({"w": torch.zeros(2), "b": torch.zeros(1)})
        >>> state.inner_state[1].trace  # the momentum of "w" only
        {'w': tensor([0., 0.]), 'b': None}
    """

    inner_state: OptState


def _select(tree: PyTree, mask_leaves: list[bool]) -> PyTree:
    """``tree`` with ``None`` at every leaf whose mask is False."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(
        [x if m else None for x, m in zip(leaves, mask_leaves, strict=True)], spec
    )


def masked(
    inner: GradientTransformation, mask: PyTree | Callable[[PyTree], PyTree]
) -> GradientTransformation:
    """Applies ``inner`` only to the leaves where ``mask`` is True.

    .. math::
        u_i \\leftarrow \\mathrm{inner}(u)_i \\ \\text{if } \\mathrm{mask}_i
        \\ \\text{else} \\ u_i

    ``inner`` sees the params and updates with ``None`` in place of every masked-out leaf, so
    its state covers only the selected leaves (``None`` elsewhere) and global reductions inside
    it (norms) see only them. Masked-out updates come out unchanged. A typical use: weight decay
    on matrices only, ``masked(add_decayed_weights(0.01), lambda p: tree_map(lambda x: x.ndim
    > 1, p))``.

    A donated :class:`MaskedState` (``donate=``) hands its ``inner_state`` to ``inner``.

    Args:
        inner: the transform to apply.
        mask: a pytree of Python bools with the params' structure, or a function
            ``params -> mask`` (called with ``params`` in ``init`` and with ``params``, or the
            updates if no params are given, in ``update``).

    Returns:
        A GradientTransformation with state :class:`MaskedState`.

    Example:
        Weight decay on the matrices only:

        >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> matrices = lambda p: fn.tree.tree_map(lambda x: x.ndim > 1, p)
        >>> tx = fn.masked(fn.add_decayed_weights(0.1), matrices)
        >>> grads = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
        >>> updates, _ = tx.update(grads, tx.init(params), params)
        >>> updates
        {'w': tensor([[0.1000, 0.1000],
                [0.1000, 0.1000]]), 'b': tensor([0., 0.])}
    """

    def mask_leaves(tree: PyTree) -> list[bool]:
        tree_mask = mask(tree) if callable(mask) else mask
        flags = tree_flatten(tree)[1].flatten_up_to(tree_mask)
        for flag in flags:
            if not isinstance(flag, bool):
                raise TypeError(f"masked: mask leaves must be Python bools, got {flag!r}")
        return flags

    def init_fn(params):
        return MaskedState(inner.init(_select(params, mask_leaves(params))))

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        flags = mask_leaves(params if params is not None else updates)
        inner_params = None if params is None else _select(params, flags)
        if donating(donate):  # the inner state's part
            extra["donate"] = True if donate is True else donated_state(donate, state).inner_state
        new, inner_state = inner.update(
            _select(updates, flags), state.inner_state, inner_params, **extra
        )
        new_leaves = tree_flatten(new)[0]
        old_leaves, spec = tree_flatten(updates)
        out = [n if m else o for n, o, m in zip(new_leaves, old_leaves, flags, strict=True)]
        return tree_unflatten(out, spec), MaskedState(inner_state)

    return GradientTransformation(init_fn, update_fn)


def set_to_zero() -> GradientTransformation:
    """Replaces every update by zeros (``None`` stays ``None``): with :func:`masked`, freezes
    the selected params, ``masked(set_to_zero(), frozen_mask)``.

    .. math:: u \\leftarrow 0

    Returns:
        A stateless GradientTransformation (:class:`fn.EmptyState`).

    Example:
        SGD that leaves the bias where it is:

        >>> params = {"w": torch.ones(2), "b": torch.ones(2)}
        >>> tx = fn.chain(fn.sgd(lr=1.0), fn.masked(fn.set_to_zero(), {"w": False, "b": True}))
        >>> updates, _ = tx.update({"w": torch.ones(2), "b": torch.ones(2)}, tx.init(params))
        >>> fn.apply_updates(params, updates)
        {'w': tensor([0., 0.]), 'b': tensor([1., 1.])}
    """

    return stateless(lambda updates, params: tree_map(torch.zeros_like, updates))
