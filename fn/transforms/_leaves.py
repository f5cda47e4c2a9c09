"""Leafwise helpers shared by the transforms: the None-update policy and devices."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fn.errors import check_shapes
from fn.tree import PyTree, tree_leaves, tree_map


def update_state_leaves(
    name: str,
    f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    state: PyTree,
    updates: PyTree,
) -> PyTree:
    """``f(s, u)`` leafwise; a leaf whose update is ``None`` keeps its state ``s`` unchanged."""

    def leaf(s, u):
        if u is None:
            return s
        check_shapes(name, s, u)
        return f(s, u)

    return tree_map(leaf, state, updates)


def map_with_params(
    name: str,
    f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    updates: PyTree,
    params: PyTree | None,
) -> PyTree:
    """``f(u, p)`` leafwise for a stateless transform that reads the params; a ``None`` update
    stays ``None``. Raises ``ValueError`` without ``params``, for a ``None`` param under an
    update, or for an update whose shape differs from its param's."""
    if params is None:
        raise ValueError(f"{name}: update() needs params")

    def leaf(u, p):
        if p is None:
            raise ValueError(f"{name}: a param is None where its update is not")
        check_shapes(name, p, u)
        return f(u, p)

    return tree_map(leaf, updates, params)


def device_of(params: PyTree) -> torch.device:
    """The device of the first tensor leaf of ``params`` (CPU for a tree without tensors)."""
    leaves = tree_leaves(params)
    return leaves[0].device if leaves else torch.device("cpu")
