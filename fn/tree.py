"""Pytree helpers over ``torch.utils._pytree``.

Params, gradients, updates and optimizer states are pytrees (dicts, lists, tuples, NamedTuples)
whose leaves are tensors. A ``None`` leaf stands for a parameter without a gradient (unused or
frozen): every helper here passes it through untouched, and multi-tree maps take the structure of
their first tree, so ``tree_map(f, grads, mu)`` returns ``None`` wherever ``grads`` has ``None``.

Below the public helpers are the leaf plumbing that fn's packages share and that is not part of
the API: the walk over the leaves that have an update (``live_leaves``: flatten the trees
against one structure, skip ``None`` updates, check each leaf, rebuild the trees; every
transform's update goes through it), whether leaves can go through ``torch._foreach_*`` ops
(``foreach_ok``), and which tensors a step may write in place (``fits``, ``buffer_like``,
``storages_of``: the buffers of buffer donation, see :class:`fn.GradientTransformation`).

Example:
    >>> grads = {"w": torch.tensor([3.0, 4.0]), "b": None}  # "b" has no gradient
    >>> fn.tree.tree_scale(grads, 0.5), fn.tree.tree_l2_norm(grads)
    ({'w': tensor([1.5000, 2.0000]), 'b': None}, tensor(5.))
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

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
"""A nested structure of dicts, lists, tuples and NamedTuples whose leaves are tensors or
``None`` (a param without a gradient); any pytree ``torch.utils._pytree`` flattens.

Example:
    >>> fn.tree.tree_numel({"w": torch.zeros(2, 3), "state": (torch.zeros(4), None)})
    10
"""


def _is_none(x: Any) -> bool:
    return x is None


def tree_flatten(tree: PyTree) -> tuple[list[Any], pytree.TreeSpec]:
    """Flattens ``tree`` into its leaves (``None`` leaves included) and a spec.

    Args:
        tree: the pytree.

    Returns:
        ``(leaves, spec)``, the leaves in pytree order and the structure
        (:func:`tree_unflatten` rebuilds the tree from them).

    Example:
        >>> leaves, spec = fn.tree.tree_flatten({"w": torch.tensor([1.0, 2.0]), "b": None})
        >>> leaves
        [tensor([1., 2.]), None]
        >>> fn.tree.tree_unflatten([leaves[0] * 2, None], spec)
        {'w': tensor([2., 4.]), 'b': None}
    """
    return pytree.tree_flatten(tree, is_leaf=_is_none)


def tree_unflatten(leaves: list[Any], spec: pytree.TreeSpec) -> PyTree:
    """Inverse of :func:`tree_flatten`.

    Args:
        leaves: one leaf per position of ``spec``, in pytree order.
        spec: the structure, from :func:`tree_flatten`.

    Returns:
        The pytree of structure ``spec`` holding ``leaves``.

    Example:
        >>> _, spec = fn.tree.tree_flatten((torch.zeros(1), {"b": None}))
        >>> fn.tree.tree_unflatten([torch.ones(1), torch.ones(2)], spec)
        (tensor([1.]), {'b': tensor([1., 1.])})
    """
    return pytree.tree_unflatten(leaves, spec)


def tree_leaves(tree: PyTree, *, keep_none: bool = False) -> list[Any]:
    """The leaves of ``tree`` in pytree order; ``None`` leaves are dropped unless ``keep_none``.

    Args:
        tree: the pytree.
        keep_none: keep the ``None`` leaves.

    Returns:
        The list of leaves.

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

    Args:
        tree: the pytree.
        dtype: the leaves' dtype, or ``None`` for each leaf's own.

    Returns:
        A pytree of ``tree``'s structure (``None`` leaves stay ``None``).

    Example:
        >>> fn.tree.tree_zeros_like({"w": torch.ones(2, dtype=torch.float16)}, torch.float32)
        {'w': tensor([0., 0.])}
    """
    return tree_map(lambda x: torch.zeros_like(x, dtype=dtype), tree)


def tree_full_like(tree: PyTree, value: float, dtype: torch.dtype | None = None) -> PyTree:
    """``value`` everywhere, shaped like every leaf, optionally in ``dtype``.

    Args:
        tree: the pytree.
        value: the fill value.
        dtype: the leaves' dtype, or ``None`` for each leaf's own.

    Returns:
        A pytree of ``tree``'s structure (``None`` leaves stay ``None``).

    Example:
        >>> fn.tree.tree_full_like({"w": torch.zeros(2)}, 0.5)
        {'w': tensor([0.5000, 0.5000])}
    """
    return tree_map(lambda x: torch.full_like(x, value, dtype=dtype), tree)


def tree_cast(tree: PyTree, dtype: torch.dtype | None) -> PyTree:
    """Casts every floating-point leaf to ``dtype`` (``None`` leaves the tree as it is).

    Args:
        tree: the pytree.
        dtype: the floating-point dtype, or ``None``.

    Returns:
        ``tree`` with its floating-point leaves in ``dtype``; integer and bool leaves are kept.

    Example:
        >>> fn.tree.tree_cast({"w": torch.ones(2), "steps": torch.tensor([3])}, torch.bfloat16)
        {'w': tensor([1., 1.], dtype=torch.bfloat16), 'steps': tensor([3])}
    """
    if dtype is None:
        return tree
    return tree_map(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    """``a + b`` leafwise.

    Args:
        a: the first pytree (its ``None`` leaves stay ``None``).
        b: a pytree of the same structure.

    Returns:
        The pytree of sums.

    Example:
        >>> fn.tree.tree_add({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 4.0])})
        {'w': tensor([4., 6.])}
    """
    return tree_map(torch.add, a, b)


def tree_sub(a: PyTree, b: PyTree) -> PyTree:
    """``a - b`` leafwise.

    Args:
        a: the first pytree (its ``None`` leaves stay ``None``).
        b: a pytree of the same structure.

    Returns:
        The pytree of differences.

    Example:
        >>> fn.tree.tree_sub({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 4.0])})
        {'w': tensor([-2., -2.])}
    """
    return tree_map(torch.sub, a, b)


def tree_scale(tree: PyTree, scalar: float | torch.Tensor) -> PyTree:
    """``scalar * tree`` leafwise.

    Args:
        tree: the pytree.
        scalar: a number or a tensor that broadcasts against every leaf.

    Returns:
        The scaled pytree.

    Example:
        >>> fn.tree.tree_scale({"w": torch.tensor([1.0, 2.0])}, 0.5)
        {'w': tensor([0.5000, 1.0000])}
    """
    return tree_map(lambda x: x * scalar, tree)


def tree_vdot(a: PyTree, b: PyTree) -> torch.Tensor:
    """``sum_i <a_i, b_i>`` over all leaves, as a 0-dim fp32 tensor.

    Args:
        a: the first pytree (its ``None`` leaves are skipped).
        b: a pytree of the same structure.

    Returns:
        The inner product, computed in fp32 (``0.0`` without leaves; of complex leaves, the
        real part of ``<conj(a), b>``).

    Example:
        >>> a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([1.0])}
        >>> fn.tree.tree_vdot(a, {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([-1.0])})
        tensor(10.)
    """
    parts = tree_leaves(tree_map(lambda x, y: (_real(x) * _real(y)).sum(), a, b))
    return torch.stack(parts).sum() if parts else torch.zeros(())


def _real(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, a complex tensor as its real and imaginary parts (``Re <x, y>``)."""
    return (torch.view_as_real(x) if x.is_complex() else x).float()


def tree_sum_of_squares(tree: PyTree) -> torch.Tensor:
    """``sum_i ||x_i||_2^2`` over all leaves, as a 0-dim fp32 tensor.

    Args:
        tree: the pytree (its ``None`` leaves are skipped).

    Returns:
        The sum of squares, computed in fp32.

    Example:
        >>> fn.tree.tree_sum_of_squares({"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([2.0])})
        tensor(9.)
    """
    return tree_vdot(tree, tree)


def tree_l2_norm(tree: PyTree) -> torch.Tensor:
    """The global L2 norm ``sqrt(sum_i ||x_i||_2^2)`` of all leaves.

    Args:
        tree: the pytree (its ``None`` leaves are skipped).

    Returns:
        A 0-dim fp32 tensor.

    Example:
        >>> fn.tree.tree_l2_norm({"w": torch.tensor([3.0]), "b": torch.tensor([4.0]), "c": None})
        tensor(5.)
    """
    return tree_sum_of_squares(tree).sqrt()


def tree_numel(tree: PyTree) -> int:
    """The total number of elements over all leaves.

    Args:
        tree: the pytree (its ``None`` leaves count nothing).

    Returns:
        The number of elements, a Python ``int``.

    Example:
        >>> fn.tree.tree_numel({"w": torch.zeros(2, 3), "b": torch.zeros(3), "frozen": None})
        9
    """
    return sum(x.numel() for x in tree_leaves(tree))


def tree_all_finite(tree: PyTree) -> torch.Tensor:
    """A 0-dim bool tensor: every element of every leaf is finite.

    Args:
        tree: the pytree (its ``None`` leaves are skipped).

    Returns:
        ``tensor(True)`` when no leaf holds an inf or a NaN (also for a tree without leaves).

    Example:
        >>> fn.tree.tree_all_finite({"w": torch.tensor([1.0, float("inf")])})
        tensor(False)
    """
    flags = [torch.isfinite(x).all() for x in tree_leaves(tree)]
    return torch.stack(flags).all() if flags else torch.tensor(True)


# The leaf walk: the leaves of an update that are not None, with the matching leaves of the state.


class LiveLeaves(NamedTuple):
    """Trees flattened against one structure and the positions where the update has a leaf
    (:func:`live_leaves`)."""

    spec: pytree.TreeSpec  # the structure every tree was flattened against
    leaves: list[list[Any]]  # each tree's leaves, the update's first (all None for a None tree)
    live: list[int]  # the positions, in leaf order, where the update's leaf is not None

    def at_live(self, k: int) -> list[Any]:
        """Tree ``k``'s leaves at the live positions (``k = 0``: the update's)."""
        column = self.leaves[k]
        return [column[i] for i in self.live]

    def rebuild(self, values: Sequence[Any], fill: int | None = None) -> PyTree:
        """A tree of the structure holding ``values`` (one per live position, in order) at the
        live positions and tree ``fill``'s leaves elsewhere (``None`` when ``fill`` is
        ``None``): the new state field of a leafwise step keeps its leaves without an update."""
        out = [None] * self.spec.num_leaves if fill is None else list(self.leaves[fill])
        for i, value in zip(self.live, values, strict=True):
            out[i] = value
        return tree_unflatten(out, self.spec)


def live_leaves(
    update: PyTree,
    *trees: PyTree | None,
    structure: PyTree | None = None,
    check: Callable[..., None] | None = None,
) -> LiveLeaves:
    """The leaf walk of a transform's update: ``update`` and ``trees`` flattened against one
    structure, and the positions where ``update`` has a leaf. A ``None`` leaf of ``update`` (a
    param without gradient) is not live: its update stays ``None`` and its state is kept
    (:meth:`LiveLeaves.rebuild`).

    Args:
        update: the tree whose leaves that are not ``None`` are live (gradients, updates).
        *trees: trees like it (state fields, params, masks); ``None`` stands for a tree of
            ``None`` leaves.
        structure: the tree whose structure all take, ``update``'s by default; a state field,
            where the state decides which leaves exist. One of ``trees`` is flattened once.
        check: called as ``check(i, u, like)`` at each live position ``i`` in leaf order, with
            the update's leaf ``u`` and the leaf ``like`` of the first of ``trees`` there
            (``None`` without trees), before the walk is returned; it raises on a bad leaf
            (e.g. a shape that differs from the state's).

    Returns:
        ``LiveLeaves(spec, leaves, live)``: ``leaves[0]`` the update's leaves, ``leaves[k]``
        those of ``trees[k - 1]``; ``at_live(k)`` and ``rebuild`` read and rebuild them.

    Raises:
        Whatever ``check`` raises; ``ValueError`` or ``TypeError`` (torch's pytree) where a
        tree's structure differs from the structure's.

    Example:
        >>> grads = {"w": torch.tensor([1.0, 2.0]), "b": None}  # "b" has no gradient
        >>> mu = {"w": torch.zeros(2), "b": torch.zeros(1)}
        >>> walk = fn.tree.live_leaves(grads, mu)
        >>> walk.live, walk.at_live(1)
        ([0], [tensor([0., 0.])])
        >>> walk.rebuild([torch.ones(2)], fill=1)  # "b" keeps its state
        {'w': tensor([1., 1.]), 'b': tensor([0.])}
    """
    base = update if structure is None else structure
    base_leaves, spec = tree_flatten(base)

    def flat(tree: PyTree | None) -> list[Any]:
        if tree is None:
            return [None] * spec.num_leaves
        return base_leaves if tree is base else spec.flatten_up_to(tree)

    leaves = [flat(update), *(flat(tree) for tree in trees)]
    live = [i for i, u in enumerate(leaves[0]) if u is not None]
    if check is not None:
        likes = leaves[1] if trees else flat(None)
        for i in live:
            check(i, leaves[0][i], likes[i])
    return LiveLeaves(spec, leaves, live)


# Foreach ops: when the leaves of a tree can go through torch._foreach_* ops (one call per op).

_Result = TypeVar("_Result")

# Set while ``per_leaf`` runs a function: every foreach_ok inside it answers False.
_PER_LEAF = contextvars.ContextVar("fn_per_leaf", default=False)


def foreach_blocker(*leaves: torch.Tensor, scalars: tuple[torch.Tensor, ...] = ()) -> str | None:
    """Why the tensors cannot go through ``torch._foreach_*`` ops, or ``None`` when they can:
    eager, plain tensors outside autograd (see :func:`foreach_ok`)."""
    if not leaves:
        return "there are no tensors"
    if torch.compiler.is_compiling():
        return "it runs under torch.compile"
    if _PER_LEAF.get():
        return "per-leaf ops were asked for"
    operands = (*leaves, *scalars)
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if any(wrapped(t) for t in operands):
        return "it runs under a torch.func transform (vmap, grad, ...)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        return "a tensor requires grad and autograd is recording"
    return None


def foreach_ok(*leaves: torch.Tensor, scalars: tuple[torch.Tensor, ...] = ()) -> bool:
    """True for eager, plain tensors outside autograd: then one ``torch._foreach_*`` call per op
    over all leaves replaces a Python loop of per-leaf ops, as ``torch.optim``'s foreach Adam.
    Pass every tensor operand: the lists' ``leaves`` (none: False, the foreach ops take no empty
    list) and the ``scalars`` from the state, since under ``simulate`` a replicated state (e.g.
    the learning rate) can be batched while the updates are not.

    Otherwise callers go leaf by leaf: the foreach ops have no ``torch.func.vmap`` batching
    rules, in-place steps on fresh outputs that autograd saved (``sqrt``) would break the
    backward, and under ``torch.compile`` the per-leaf ops fuse anyway. Inside :func:`per_leaf`
    the answer is always False.
    """
    return foreach_blocker(*leaves, scalars=scalars) is None


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


# Buffers: which tensors a step may write in place.


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
