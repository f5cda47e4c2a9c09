"""Leafwise helpers shared by the transforms: the checks of the leaf walk and devices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fn.base import EmptyState, GradientTransformation, donating
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


def with_params(
    name: str,
    f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    in_place: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> GradientTransformation:
    """A stateless transform whose update is ``f(u, p)`` leafwise (``in_place(u, p)`` when the
    updates are donated); a ``None`` update stays ``None``. The update raises ``ValueError``
    without ``params``, for a ``None`` param under an update, or for an update whose shape
    differs from its param's."""

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        del extra
        leaf = in_place if donating(donate) else f
        if params is None:
            raise ValueError(f"{name}: update() needs params")
        check = matching(name, "a param is None where its update is not")
        walk = live_leaves(updates, params, check=check)
        pairs = zip(walk.at_live(0), walk.at_live(1), strict=True)
        return walk.rebuild([leaf(u, p) for u, p in pairs]), state

    return GradientTransformation(init_fn, update_fn)


def refuse_complex(name: str, params: PyTree) -> None:
    """Raises ``TypeError`` naming ``name`` if a leaf of ``params`` is complex: Adam's second
    moment needs ``|g|^2`` where ``g * g`` is complex, the trust ratio and the 1-bit
    compression read real values (``torch.optim`` treats a complex param as
    ``torch.view_as_real``'s pairs; train those)."""
    if any(x.is_complex() for x in tree_leaves(params) if isinstance(x, torch.Tensor)):
        raise TypeError(
            f"{name}: complex params are not supported; train torch.view_as_real(p) (the real "
            "and imaginary parts as real values, as torch.optim does)"
        )


def in_dtypes_of(grads: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient in the dtype of its state leaf in ``like`` (cast only where it differs):
    a bf16 gradient on fp32 params is read in fp32, and the state never changes dtype."""
    return [g if g.dtype == x.dtype else g.to(x.dtype) for g, x in zip(grads, like, strict=True)]


def device_of(params: PyTree) -> torch.device:
    """The device of the first tensor leaf of ``params`` (CPU for a tree without tensors)."""
    leaves = tree_leaves(params)
    return leaves[0].device if leaves else torch.device("cpu")
