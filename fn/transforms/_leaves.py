"""Leafwise helpers shared by the transforms: the checks of the leaf walk and devices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fn.errors import check_shapes
from fn.tree import PyTree, live_leaves, tree_leaves


def matching(name: str, missing: str) -> Callable[..., None]:
    """A ``check`` for :func:`fn.tree.live_leaves`: at every live position the update's leaf
    ``u`` has the shape of the first tree's leaf ``like`` (``fn.errors.check_shapes``); where
    ``like`` is ``None``, ``ValueError("{name}: {missing}")``."""

    def check(i: int, u: torch.Tensor, like: Any) -> None:
        del i
        if like is None:
            raise ValueError(f"{name}: {missing}")
        check_shapes(name, like, u)

    return check


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
    check = matching(name, "a param is None where its update is not")
    walk = live_leaves(updates, params, check=check)
    return walk.rebuild([f(u, p) for u, p in zip(walk.at_live(0), walk.at_live(1), strict=True)])


def device_of(params: PyTree) -> torch.device:
    """The device of the first tensor leaf of ``params`` (CPU for a tree without tensors)."""
    leaves = tree_leaves(params)
    return leaves[0].device if leaves else torch.device("cpu")
