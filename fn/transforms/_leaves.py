"""Leafwise helpers shared by the transforms: None-gradient policy, shape checks, devices."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

import torch

from fn.tree import PyTree, tree_leaves, tree_map


def check_shapes(name: str, state_leaf: torch.Tensor, update: torch.Tensor) -> None:
    """Raises ValueError when an update and its state leaf differ in shape (no broadcasting)."""
    if update.shape != state_leaf.shape:
        raise ValueError(
            f"{name}: update of shape {tuple(update.shape)} does not match the state's "
            f"{tuple(state_leaf.shape)}"
        )


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


def device_of(params: PyTree) -> torch.device:
    """The device of the first tensor leaf of ``params`` (CPU for a tree without tensors)."""
    leaves = tree_leaves(params)
    return leaves[0].device if leaves else torch.device("cpu")


def check_betas(name: str, betas: tuple[float, float]) -> tuple[float, float]:
    b1, b2 = betas
    for i, b in enumerate((b1, b2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name}: betas[{i}] must be in [0, 1), got {b}")
    return float(b1), float(b2)


def check_nonnegative(name: str, **values: float) -> None:
    for key, v in values.items():
        if not v >= 0.0:  # also rejects NaN
            raise ValueError(f"{name}: {key} must be >= 0, got {v}")


def check_fraction(name: str, **values: float) -> None:
    """Raises ValueError unless every value lies in [0, 1) (an EMA coefficient)."""
    for key, v in values.items():
        if not 0.0 <= v < 1.0:  # also rejects NaN
            raise ValueError(f"{name}: {key} must be in [0, 1), got {v}")


def check_ordered(name: str, **bounds: float) -> None:
    """Raises ValueError unless the values, in the order given, do not decrease (e.g.
    ``min_coeff=a, max_coeff=b`` needs ``a <= b``)."""
    for (low_key, low), (high_key, high) in pairwise(bounds.items()):
        if not low <= high:  # also rejects NaN
            raise ValueError(f"{name}: {low_key} ({low}) must be <= {high_key} ({high})")
