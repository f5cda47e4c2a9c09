"""The functional core: gradient transformations, compressed optimizers and their composition.

A :class:`GradientTransformation` is a pair of pure functions, as in optax:

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = apply_updates(params, updates)

Nothing is changed in place and no state is hidden: everything that persists between steps is in
``state``, a pytree of NamedTuples whose leaves are tensors.

A :class:`CompressedOptimizer` adds a second update (``compressed_update``) and a host-side
schedule that picks the update for step ``t`` from ``t`` alone; both updates take each rank's
LOCAL gradients and communicate through the ``Comm`` they were built with. Its ``plan(t)`` holds
every host-side decision of update ``t`` as Python bools: pass ``plan=opt.plan(t)`` instead of
``step=t`` into a ``torch.compile``'d step so that it compiles once per plan, not once per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from fn._foreach import foreach_ok
from fn._validation import check_step
from fn.tree import PyTree, tree_flatten, tree_unflatten

__all__ = [
    "Params",
    "Updates",
    "OptState",
    "TransformInitFn",
    "TransformUpdateFn",
    "GradientTransformation",
    "CompressedOptimizer",
    "EmptyState",
    "StagedState",
    "identity",
    "chain",
    "apply_updates",
    "staged",
    "set_hyperparams",
    "get_hyperparam",
]

Params = PyTree
Updates = PyTree
OptState = Any


class TransformInitFn(Protocol):
    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure optimizer building block: ``init(params) -> state`` and
    ``update(updates, state, params=None, **extra) -> (updates, state)``.

    ``update`` must accept and ignore keyword arguments it does not know (``chain`` forwards every
    extra keyword, such as ``step``, to every member).
    """

    init: TransformInitFn
    update: TransformUpdateFn


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


class CompressedOptimizer(NamedTuple):
    """An optimizer with a full-precision and a compressed phase.

    Attributes:
        init: ``init(params) -> state``.
        warmup_update: the full-precision update: averages the LOCAL gradients with a dense
            allreduce, then updates.
        compressed_update: the compressed update: 1-bit collectives inside.
        is_compressed: the host-side schedule, ``is_compressed(t) -> bool`` for the 1-based update
            count ``t``; a pure function of ``t``, never of tensor values.
        plan: ``plan(t)``, every host-side decision of update ``t`` as a hashable NamedTuple of
            Python bools with a ``compressed`` attribute equal to ``is_compressed(t)`` (e.g.
            ``fn.transforms.ZeroOneAdamPlan``). ``None`` (the default) for an optimizer whose
            updates only take ``step``.

    Both updates have the signature ``(grads, state, params=None, *, step=None, plan=None,
    **extra)`` and take exactly one of ``step``, the 1-based count of the update being made (a
    Python ``int``), and ``plan=opt.plan(step)``; both give the same result, bit for bit.

    Compiling a training step: ``torch.compile`` guards Python ints by value (a recompile for
    every new ``t``, then a silent fall-back to eager) or turns them into symbolic ints the
    schedules cannot branch on. Pass the plan into the compiled function instead of ``t``: a
    plan is a few bools, so the step compiles once per distinct plan (at most 2 for 1-bit Adam,
    4 for 1-bit LAMB, 5 for 0/1 Adam), however many steps are run::

        opt = fn.zero_one_adam(lr=1e-3, var_freeze_step=1000, comm=comm)

        @torch.compile
        def train_step(params, state, batch, plan):
            grads = torch.func.grad(loss_fn)(params, batch)
            updates, state = opt.update(grads, state, params, plan=plan)
            return fn.apply_updates(params, updates), state

        for t, batch in enumerate(batches, start=1):
            params, state = train_step(params, state, batch, opt.plan(t))

    With ``Simulated`` ranks, compile ``simulate(train_step, comm)`` (or call
    ``simulate(opt.update, comm)`` inside the compiled function) the same way.
    """

    init: TransformInitFn
    warmup_update: TransformUpdateFn
    compressed_update: TransformUpdateFn
    is_compressed: Callable[[int], bool]
    plan: Callable[[int], Any] | None = None

    def update(
        self,
        grads: Updates,
        state: OptState,
        params: Params | None = None,
        *,
        step: int | None = None,
        plan: Any = None,
        **extra: Any,
    ) -> tuple[Updates, OptState]:
        """Runs the update that the schedule picks for the 1-based update count ``step``, or the
        one ``plan = self.plan(step)`` says (``plan.compressed``). Give exactly one of them.

        Raises:
            TypeError: if neither or both are given, ``step`` is a tensor, or a plan is given to
                an optimizer without ``plan``.
            ValueError: if ``step`` is not an int >= 1.
        """
        if (step is None) == (plan is None):
            raise TypeError(
                "pass exactly one of step=t (the 1-based update count) and plan=opt.plan(t)"
            )
        if plan is None:
            step = check_step(step)
            phase = self.compressed_update if self.is_compressed(step) else self.warmup_update
            return phase(grads, state, params, step=step, **extra)
        if self.plan is None:
            raise TypeError("this CompressedOptimizer has no plan function: pass step=t")
        phase = self.compressed_update if plan.compressed else self.warmup_update
        return phase(grads, state, params, plan=plan, **extra)


def identity() -> GradientTransformation:
    """The transformation that returns its updates unchanged."""

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        return updates, state

    return GradientTransformation(init_fn, update_fn)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` one after the other; the state is the tuple of their states.

    Args:
        *transforms: gradient transformations, applied left to right.

    Returns:
        A GradientTransformation whose state is ``tuple(tx.init(params) for tx in transforms)``.
        Every extra keyword given to ``update`` is forwarded to every member.
    """

    def init_fn(params):
        return tuple(tx.init(params) for tx in transforms)

    def update_fn(updates, state, params=None, **extra):
        if len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transforms got a state of {len(state)} entries"
            )
        new_state = []
        for tx, s in zip(transforms, state, strict=True):
            updates, s = tx.update(updates, s, params, **extra)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init_fn, update_fn)


def apply_updates(params: Params, updates: Updates) -> Params:
    """Returns ``params + updates`` leafwise, cast back to each param's dtype.

    A ``None`` update leaves its param as it is. Inputs are not modified.
    """

    p_leaves, spec = tree_flatten(params)
    u_leaves = spec.flatten_up_to(updates)
    pairs = [(i, p, u) for i, (p, u) in enumerate(zip(p_leaves, u_leaves, strict=True))]
    pairs = [(i, p, u) for i, p, u in pairs if p is not None and u is not None]
    ps = [p for _, p, _ in pairs]
    us = [u for _, _, u in pairs]
    sums = torch._foreach_add(ps, us) if foreach_ok(*ps, *us) else map(torch.add, ps, us)
    out = list(p_leaves)
    for (i, p, _), s in zip(pairs, sums, strict=True):
        out[i] = s.to(p.dtype)
    return tree_unflatten(out, spec)


class StagedState(NamedTuple):
    count: torch.Tensor  # [] int64: updates made so far
    inner: OptState


def staged(opt: CompressedOptimizer) -> GradientTransformation:
    """A :class:`CompressedOptimizer` as a plain :class:`GradientTransformation`.

    The state adds an update counter. ``update`` uses the ``step`` or ``plan`` keyword when one
    is given (see :class:`CompressedOptimizer`); otherwise it reads the counter on the host
    (``count + 1``), which needs a concrete tensor (eager mode, Local or ProcessGroup comms).
    Under ``Simulated`` (vmap) pass ``step=t``; under ``torch.compile`` pass ``plan=opt.plan(t)``.
    """

    def init_fn(params):
        return StagedState(torch.zeros((), dtype=torch.int64), opt.init(params))

    def update_fn(updates, state, params=None, *, step=None, plan=None, **extra):
        if step is None and plan is None:
            try:
                step = int(state.count) + 1
            except RuntimeError as err:  # a batched or traced counter has no host value
                raise RuntimeError(
                    "staged(): the step count is not readable on the host here; "
                    "pass update(..., step=t)"
                ) from err
        updates, inner = opt.update(updates, state.inner, params, step=step, plan=plan, **extra)
        return updates, StagedState(state.count + 1, inner)

    return GradientTransformation(init_fn, update_fn)


def _map_hyperparams(state: OptState, visit: Callable[[Any], Any]) -> OptState:
    """Rebuilds ``state`` bottom-up, calling ``visit`` on every NamedTuple in it."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        state = type(state)(*(_map_hyperparams(s, visit) for s in state))
        return visit(state)
    if isinstance(state, (tuple, list)):
        return type(state)(_map_hyperparams(s, visit) for s in state)
    if isinstance(state, dict):
        return {k: _map_hyperparams(v, visit) for k, v in state.items()}
    return state


def set_hyperparams(state: OptState, **values: float | torch.Tensor) -> OptState:
    """Returns ``state`` with every state field named like a keyword set to its value.

    Hyperparameters that schedulers change (``lr``) are kept in the state as tensors, so a new
    value needs no rebuild and no recompilation. The new value is broadcast to the stored
    tensor's shape (a ``Simulated`` state carries a rank axis) and keeps its dtype and device.

    Example: ``state = fn.set_hyperparams(state, lr=3e-4)``.

    Raises:
        KeyError: if no state field has one of the names.
    """
    found = set()

    def visit(nt):
        hits = {k: v for k, v in values.items() if k in nt._fields}
        if not hits:
            return nt
        found.update(hits)
        new = {}
        for k, v in hits.items():
            old = getattr(nt, k)
            new[k] = torch.as_tensor(v, dtype=old.dtype, device=old.device).expand_as(old).clone()
        return nt._replace(**new)

    state = _map_hyperparams(state, visit)
    missing = set(values) - found
    if missing:
        raise KeyError(f"no state field named {sorted(missing)}")
    return state


def get_hyperparam(state: OptState, name: str) -> torch.Tensor:
    """The first state field named ``name`` (in pytree order).

    Raises:
        KeyError: if no state field has that name.
    """
    hits = []

    def visit(nt):
        if name in nt._fields:
            hits.append(getattr(nt, name))
        return nt

    _map_hyperparams(state, visit)
    if not hits:
        raise KeyError(f"no state field named {name!r}")
    return hits[0]
