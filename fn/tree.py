"""Pytree helpers over ``torch.utils._pytree``.

Params, gradients, updates and optimizer states are pytrees (dicts, lists, tuples, NamedTuples)
whose leaves are tensors. A ``None`` leaf stands for a parameter without a gradient (unused or
frozen): every helper here passes it through untouched, and multi-tree maps take the structure of
their first tree, so ``tree_map(f, grads, mu)`` returns ``None`` wherever ``grads`` has ``None``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "PyTree",
    "tree_leaves",
    "tree_flatten",
    "tree_unflatten",
    "tree_map",
    "tree_zeros_like",
    "tree_full_like",
    "tree_cast",
    "tree_add",
    "tree_sub",
    "tree_scale",
    "tree_vdot",
    "tree_sum_of_squares",
    "tree_l2_norm",
    "tree_numel",
    "tree_all_finite",
]

PyTree = Any


def _is_none(x: Any) -> bool:
    return x is None


def tree_flatten(tree: PyTree) -> tuple[list[Any], pytree.TreeSpec]:
    """Flattens ``tree`` into its leaves (``None`` leaves included) and a spec.

    Example:
        >>> leaves, spec = fn.tree.tree_flatten({"w": torch.tensor([1.0, 2.0]), "b": None})
        >>> leaves
        [tensor([1., 2.]), None]
        >>> fn.tree.tree_unflatten([leaves[0] * 2, None], spec)
        {'w': tensor([2., 4.]), 'b': None}
    """
    return pytree.tree_flatten(tree, is_leaf=_is_none)


def tree_unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> PyTree:
    """Inverse of :func:`tree_flatten`."""
    return pytree.tree_unflatten(leaves, spec)


def tree_leaves(tree: PyTree, *, keep_none: bool = False) -> list[Any]:
    """The leaves of ``tree`` in pytree order; ``None`` leaves are dropped unless ``keep_none``.

    Example:
        >>> grads = {"w": torch.tensor([1.0, 2.0]), "b": None}
        >>> fn.tree.tree_leaves(grads)
        [tensor([1., 2.])]
        >>> fn.tree.tree_leaves(grads, keep_none=True)
        [tensor([1., 2.]), None]
    """
    leaves = tree_flatten(tree)[0]
    return leaves if keep_none else [x for x in leaves if x is not None]


def tree_map(f: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Maps ``f`` over the leaves of ``tree`` and the matching leaves of ``rest``.

    The structure is ``tree``'s; wherever ``tree`` holds ``None`` the result holds ``None`` and
    ``f`` is not called (the matching leaves of ``rest`` may be anything, ``None`` included).

    Args:
        f: function of ``1 + len(rest)`` leaves.
        tree: the pytree that fixes the structure.
        *rest: pytrees with the same structure as ``tree``.

    Returns:
        The mapped pytree.

    Example:
        >>> import torch
        >>> import fn
        >>> grads = {"w": torch.tensor([1.0, 2.0]), "b": None}  # "b" has no gradient
        >>> fn.tree.tree_map(lambda g, m: g + m, grads, {"w": torch.ones(2), "b": torch.ones(1)})
        {'w': tensor([2., 3.]), 'b': None}
    """
    leaves, spec = tree_flatten(tree)
    others = [spec.flatten_up_to(r) for r in rest]
    out = [None if x is None else f(x, *(o[i] for o in others)) for i, x in enumerate(leaves)]
    return tree_unflatten(out, spec)


def tree_zeros_like(tree: PyTree, dtype: torch.dtype | None = None) -> PyTree:
    """Zeros shaped like every leaf, optionally in ``dtype``.

    Example:
        >>> fn.tree.tree_zeros_like({"w": torch.ones(2, dtype=torch.float16)}, torch.float32)
        {'w': tensor([0., 0.])}
    """
    return tree_map(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def tree_full_like(tree: PyTree, value: float, dtype: torch.dtype | None = None) -> PyTree:
    """``value`` everywhere, shaped like every leaf, optionally in ``dtype``.

    Example:
        >>> fn.tree.tree_full_like({"w": torch.zeros(2)}, 0.5)
        {'w': tensor([0.5000, 0.5000])}
    """
    return tree_map(lambda x: torch.full_like(x, value, dtype=dtype), tree)


def tree_cast(tree: PyTree, dtype: torch.dtype | None) -> PyTree:
    """Casts every floating-point leaf to ``dtype`` (``None`` leaves the tree as it is).

    Example:
        >>> fn.tree.tree_cast({"w": torch.ones(2), "steps": torch.tensor([3])}, torch.bfloat16)
        {'w': tensor([1., 1.], dtype=torch.bfloat16), 'steps': tensor([3])}
    """
    if dtype is None:
        return tree
    return tree_map(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    """``a + b`` leafwise.

    Example:
        >>> fn.tree.tree_add({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 4.0])})
        {'w': tensor([4., 6.])}
    """
    return tree_map(torch.add, a, b)


def tree_sub(a: PyTree, b: PyTree) -> PyTree:
    """``a - b`` leafwise.

    Example:
        >>> fn.tree.tree_sub({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 4.0])})
        {'w': tensor([-2., -2.])}
    """
    return tree_map(torch.sub, a, b)


def tree_scale(tree: PyTree, scalar: float | torch.Tensor) -> PyTree:
    """``scalar * tree`` leafwise.

    Example:
        >>> fn.tree.tree_scale({"w": torch.tensor([1.0, 2.0])}, 0.5)
        {'w': tensor([0.5000, 1.0000])}
    """
    return tree_map(lambda x: x * scalar, tree)


def tree_vdot(a: PyTree, b: PyTree) -> torch.Tensor:
    """``sum_i <a_i, b_i>`` over all leaves, as a 0-dim fp32 tensor.

    Example:
        >>> a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([1.0])}
        >>> fn.tree.tree_vdot(a, {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([-1.0])})
        tensor(10.)
    """
    parts = tree_leaves(tree_map(lambda x, y: (x.float() * y.float()).sum(), a, b))
    return torch.stack(parts).sum() if parts else torch.zeros(())


def tree_sum_of_squares(tree: PyTree) -> torch.Tensor:
    """``sum_i ||x_i||_2^2`` over all leaves, as a 0-dim fp32 tensor.

    Example:
        >>> fn.tree.tree_sum_of_squares({"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([2.0])})
        tensor(9.)
    """
    return tree_vdot(tree, tree)


def tree_l2_norm(tree: PyTree) -> torch.Tensor:
    """The global L2 norm ``sqrt(sum_i ||x_i||_2^2)`` of all leaves.

    Example:
        >>> fn.tree.tree_l2_norm({"w": torch.tensor([3.0]), "b": torch.tensor([4.0]), "c": None})
        tensor(5.)
    """
    return tree_sum_of_squares(tree).sqrt()


def tree_numel(tree: PyTree) -> int:
    """The total number of elements over all leaves.

    Example:
        >>> fn.tree.tree_numel({"w": torch.zeros(2, 3), "b": torch.zeros(3), "frozen": None})
        9
    """
    return sum(x.numel() for x in tree_leaves(tree))


def tree_all_finite(tree: PyTree) -> torch.Tensor:
    """A 0-dim bool tensor: every element of every leaf is finite.

    Example:
        >>> fn.tree.tree_all_finite({"w": torch.tensor([1.0, float("inf")])})
        tensor(False)
    """
    flags = [torch.isfinite(x).all() for x in tree_leaves(tree)]
    return torch.stack(flags).all() if flags else torch.tensor(True)
