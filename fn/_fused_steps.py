"""The fused steps of :func:`fn.update_and_apply`: transforms that can write the params
directly register a step here, keyed by their ``update`` function (weakly: a transform that is
dropped takes its entry with it)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

_STEPS: weakref.WeakKeyDictionary[Callable, Callable] = weakref.WeakKeyDictionary()


def register_update_and_apply(tx: Any, step: Callable[..., tuple[Any, Any]]) -> Any:
    """Returns the GradientTransformation or CompressedOptimizer ``tx``, whose steps in
    :func:`fn.update_and_apply` run ``step(updates, state, params, donate=..., **extra) ->
    (params, state)``: the params updated in place, with the values of ``tx.update`` then
    ``apply_updates`` bit for bit. ``step`` must not reference ``tx``'s functions (they key it
    weakly)."""
    _STEPS[_key(tx)] = step
    return tx


def update_and_apply_step(tx: Any) -> Callable[..., tuple[Any, Any]] | None:
    """The step registered for ``tx`` by :func:`register_update_and_apply`, or ``None``."""
    return _STEPS.get(_key(tx))


def _key(tx: Any) -> Callable:
    # A CompressedOptimizer's update is a bound method, a new object at every access.
    return tx.compressed_update if hasattr(tx, "compressed_update") else tx.update


def update_functions(
    step: Callable[..., tuple[Any, Any]],
) -> tuple[Callable[..., tuple[Any, Any]], Callable[..., tuple[Any, Any]]]:
    """``(update_fn, update_and_apply_fn)`` of a transform whose update and fused step are one
    ``step(updates, state, params, donate, extra, apply)`` (``extra``: a dict of the other
    keywords, which ``step`` may change): ``update_fn`` runs it with ``apply=False`` and returns
    ``(updates, state)``; ``update_and_apply_fn``, the step to give
    :func:`register_update_and_apply`, runs it with ``apply=True`` and returns ``(params,
    state)``, the params updated in place."""

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        return step(updates, state, params, donate, extra, apply=False)

    def update_and_apply_fn(updates, state, params, *, donate, **extra):
        return step(updates, state, params, donate, extra, apply=True)

    return update_fn, update_and_apply_fn
