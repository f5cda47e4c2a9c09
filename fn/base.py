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

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple, Protocol

import torch

from fn.errors import check_finite_nonnegative, check_step_or_plan
from fn.tree import PyTree, foreach_ok, storages_of, tree_flatten, tree_map, tree_unflatten

__all__ = [
    "Params",
    "Updates",
    "OptState",
    "SecondMoment",
    "SecondMomentField",
    "PerRank",
    "PerRankField",
    "marked_fields",
    "TransformInitFn",
    "TransformUpdateFn",
    "FastStepFn",
    "GradientTransformation",
    "CompressedOptimizer",
    "EmptyState",
    "StagedState",
    "identity",
    "stateless",
    "stateless_with_tree_map",
    "chain",
    "apply_updates",
    "update_and_apply",
    "staged",
    "set_hyperparams",
    "get_hyperparam",
]

Params = PyTree
"""The params a transform updates, a pytree of tensors (``fn.tree.PyTree``).

Example:
    >>> params: fn.base.Params = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    >>> fn.tree.tree_numel(params)
    9
"""
Updates = PyTree
"""Gradients or updates, a pytree like the params (``None`` where a param has none).

Example:
    >>> tx, params = fn.sgd(0.1), {"w": torch.zeros(2), "b": torch.zeros(1)}
    >>> grads: fn.base.Updates = {"w": torch.ones(2), "b": None}  # "b" is frozen
    >>> tx.update(grads, tx.init(params))[0]
    {'w': tensor([-0.1000, -0.1000]), 'b': None}
"""
OptState = Any
"""A transform's state, the pytree its ``init`` returns and its ``update`` threads (usually
NamedTuples whose leaves are tensors).

Example:
    >>> state: fn.base.OptState = fn.trace(decay=0.9).init({"w": torch.zeros(2)})
    >>> state
    TraceState(count=tensor(0), trace={'w': tensor([0., 0.])})
"""


class SecondMoment:
    """The mark of :data:`SecondMomentField` in a state field's annotation.

    Example:
        >>> fn.base.marked_fields(fn.ScaleByAdamState, fn.base.SecondMoment)
        frozenset({'nu'})
    """


@functools.cache
def marked_fields(cls: type, mark: Any) -> frozenset[str]:
    """The fields of the class ``cls`` (a state ``NamedTuple``) annotated ``Annotated[...,
    mark]``, as :data:`SecondMomentField` and ``fn.collectives.ErrorFeedbackField`` are.

    Args:
        cls: the class.
        mark: the annotation's mark, e.g. :class:`SecondMoment`.

    Returns:
        The names of the marked fields; none where the annotations do not resolve.

    Example:
        >>> sorted(fn.base.marked_fields(fn.transforms.ScaleByAdamState, fn.base.SecondMoment))
        ['nu']
    """
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except (NameError, TypeError):
        return frozenset()
    return frozenset(
        name
        for name, hint in hints.items()
        if typing.get_origin(hint) is Annotated and mark in hint.__metadata__
    )


SecondMomentField = Annotated[PyTree, SecondMoment]
"""The annotation of a state field whose pytree holds second moments (means of squares, never
negative). An example is ``nu: SecondMomentField`` in ``fn.transforms.ScaleByAdamState``;
``fn.optim`` rejects a checkpoint in which one is negative.

Example:
    >>> from typing import NamedTuple
    >>> from fn.base import SecondMoment, SecondMomentField
    >>> class MyState(NamedTuple):
    ...     count: torch.Tensor
    ...     nu: SecondMomentField
    >>> fn.base.marked_fields(MyState, SecondMoment)
    frozenset({'nu'})
"""


class PerRank:
    """The mark of :data:`PerRankField` in a state field's annotation.

    Example:
        >>> sorted(fn.base.marked_fields(fn.ZeroOneAdamState, fn.base.PerRank))
        ['exp_avg', 'momentum_accumulator']
    """


PerRankField = Annotated[PyTree, PerRank]
"""The annotation of a state field whose values may differ between ranks by design (e.g. 0/1
Adam's momentum and accumulator between its synchronizations). ``fn.optim.PerRankState`` saves
such a field under each rank's own name, as it does error feedback, instead of once for all
ranks.

Example:
    >>> from typing import NamedTuple
    >>> from fn.base import PerRank, PerRankField
    >>> class MyState(NamedTuple):
    ...     count: torch.Tensor
    ...     local: PerRankField
    >>> fn.base.marked_fields(MyState, PerRank)
    frozenset({'local'})
"""


class TransformInitFn(Protocol):
    """A transform's ``init``: ``init(params) -> state``, the state of the first update.

    Any callable of this signature implements it (a function, a lambda); the state it returns
    is usually built from the params' shapes, dtypes and devices.

    Example:
        >>> def init(params):  # a buffer like every param
        ...     return fn.tree.tree_zeros_like(params)
        >>> tx = fn.GradientTransformation(init, fn.identity().update)
        >>> tx.init({"w": torch.ones(2)})
        {'w': tensor([0., 0.])}
    """

    def __call__(self, params: Params) -> OptState: ...


class TransformUpdateFn(Protocol):
    """A transform's ``update``: ``update(updates, state, params=None, **extra) -> (updates,
    state)``, pure (see :class:`GradientTransformation` for ``donate``).

    Any callable of this signature implements it. It should accept and ignore the keyword
    arguments it does not know (``step``, ``plan``, ``donate``), as the ``**extra`` below does;
    ``fn.chain`` passes a member without ``**extra`` only the keywords it names.

    Example:
        >>> def update(updates, state, params=None, **extra):  # extra keywords: ignored
        ...     return fn.tree.tree_scale(updates, 2.0), state
        >>> tx = fn.GradientTransformation(lambda params: fn.EmptyState(), update)
        >>> tx.update({"w": torch.ones(2)}, tx.init(None), step=3)
        ({'w': tensor([2., 2.])}, EmptyState())
    """

    def __call__(
        self, updates: Updates, state: OptState, params: Params | None = None, **extra: Any
    ) -> tuple[Updates, OptState]: ...


class FastStepFn(Protocol):
    """A transform's fast step: ``update`` then ``apply_updates`` in one in-place step.

    A transform implements it by setting the ``fast_step`` field of its
    :class:`GradientTransformation` to a callable of this signature that returns the params
    (updated in place) and the new state with the bits of the two calls; :func:`update_and_apply`
    then runs it.

    Example:
        >>> fn.adam(lr=0.1).fast_step is not None, fn.sgd(lr=0.1).fast_step
        (True, None)
    """

    def __call__(
        self, updates: Updates, state: OptState, params: Params, *, donate: Any, **extra: Any
    ) -> tuple[Params, OptState]: ...


class GradientTransformation(NamedTuple):
    """A pure optimizer building block: ``init(params) -> state`` and
    ``update(updates, state, params=None, **extra) -> (updates, state)``.

    ``update`` should accept and ignore keyword arguments it does not know, as optax's do;
    ``chain`` forwards an extra keyword (such as ``step``) to every member that takes it, so a
    member without ``**extra`` works there too.

    Buffer donation (the extra keyword ``donate``): by default ``update`` writes nothing it was
    given. A caller that no longer needs its old state may hand its tensors over, as JAX's
    ``donate_argnums`` does, so that the new state and updates are written into them instead of
    into fresh tensors (on CPU every fresh full-size tensor pays a page fault per 4 KiB page):

    - ``donate=None`` (the default) or ``False``: pure.
    - ``donate=True``: the same as ``donate=state``, i.e. in place.
    - ``donate=old``, a state of ``state``'s structure: the caller hands over the tensors of
      ``old`` AND of ``updates``. The new state may be written into ``old``'s tensors (each
      into the same field and leaf, where shape, dtype and device fit) and the new updates into
      the ``updates`` tensors, and those tensors returned. A donated leaf may be the very tensor
      of the same leaf of ``state``; it must not alias any other leaf of ``state``,
      ``updates`` or ``params``. ``None`` in place of a part of ``old`` (e.g. one ``chain``
      member's state) donates nothing there; a state of another tree structure raises
      ``ValueError``.
    - Results are bit for bit those of the pure call. A leaf the update leaves unchanged is
      returned as the same tensor. After the call the caller reaches the donated tensors only
      through the returned values; if it raises, they may hold anything (fn's compressed
      collectives check their inputs before they write).
    - Donation is permission, never obligation: a transform that does not take ``donate``
      never sees it (``chain``, ``masked``, ``staged`` and ``CompressedOptimizer.update``
      forward it, splitting a donated state as they split ``state``) and allocates as before.

    :func:`apply_updates` takes ``donate=True`` too (``params`` updated in place), and
    :func:`update_and_apply` runs both in one step.

    Fast step (the optional third field ``fast_step``): a transform whose ``update`` then
    ``apply_updates`` can run as one in-place pass declares it here, as
    ``fast_step(updates, state, params, *, donate, **extra) -> (params, state)`` with the
    params updated in place and the bits of the two calls (:func:`update_and_apply` states the
    contract). ``None`` (the default): :func:`update_and_apply` runs ``update`` and
    ``apply_updates``. ``fn.adam`` and ``fn.adamw`` declare one.

    Attributes:
        init: ``init(params) -> state``, the state of the first update.
        update: ``update(updates, state, params=None, **extra) -> (updates, state)``.
        fast_step: ``None``, or the in-place ``update`` plus ``apply_updates`` described above.

    Example:
        >>> import torch, fn
        >>> tx = fn.sgd(lr=0.1, momentum=0.9)
        >>> params, grads = {"w": torch.ones(2)}, {"w": torch.full((2,), 0.5)}
        >>> state = tx.init(params)
        >>> pure_updates, pure_state = tx.update(dict(grads), state, params)
        >>> trace = state[1].trace["w"]
        >>> updates, state = tx.update({"w": grads["w"].clone()}, state, params, donate=True)
        >>> state[1].trace["w"] is trace  # the momentum was written in place
        True
        >>> torch.equal(updates["w"], pure_updates["w"])
        True
        >>> new = fn.apply_updates(params, updates, donate=True)
        >>> new["w"] is params["w"], params["w"]
        (True, tensor([0.9500, 0.9500]))
    """

    init: TransformInitFn
    update: TransformUpdateFn
    fast_step: FastStepFn | None = None


class EmptyState(NamedTuple):
    """The state of a stateless transform: a NamedTuple without fields.

    Example:
        >>> fn.identity().init({"w": torch.ones(2)})
        EmptyState()
    """


class CompressedOptimizer(NamedTuple):
    """An optimizer with a full-precision and a compressed phase.

    Attributes:
        init: ``init(params) -> state``.
        warmup_update: the full-precision update: averages the LOCAL gradients with a dense
            allreduce, then updates.
        compressed_update: the compressed update: 1-bit collectives inside.
        is_compressed: the host-side schedule, ``is_compressed(t) -> bool`` for the 1-based
            update count ``t``: a pure function of ``t``, never of tensor values; with
            ``reads_state``, ``is_compressed(t, state=None)``, which may also read the state
            (``freeze_step="auto"`` of 1-bit Adam and 1-bit LAMB reads the switch decided in
            it: one host read of a CPU scalar; the state is then required). Ask
            :meth:`compressed_at`, which passes the state where the schedule takes it.
        plan: ``plan(t)`` (with ``reads_state``, ``plan(t, state=None)``), every host-side
            decision of update ``t`` as a hashable NamedTuple of Python bools with a
            ``compressed`` attribute equal to ``compressed_at(t, state)`` (e.g.
            ``fn.transforms.ZeroOneAdamPlan``). ``None`` (the default) for an optimizer whose
            updates only take ``step``.
        param_agreement: ``param_agreement(t)``, how closely the ranks' params agree after
            update ``t`` (``t = 0``: the params it starts from), a pure function of ``t``:
            ``0.0`` bit for bit (the default), ``r > 0`` up to a relative ``r`` of their sums,
            ``None`` not at all (0/1 Adam's local steps, where the ranks differ by design).
            ``fn.optim`` compares the ranks' params only where they agree.
        fast_step: ``None``, or the in-place step that :func:`update_and_apply` runs instead of
            ``update`` then ``apply_updates`` (see :class:`GradientTransformation`); it takes
            ``step`` or ``plan`` as ``update`` does.
        check_state: ``None``, or ``check_state(state) -> state`` for an optimizer whose state
            fields change form with its phase (a buffer ``None`` until it is needed, a momentum
            kept as ``fn.collectives.PackedSigns``): it checks a state from elsewhere (a
            checkpoint), whose fields may be in any form its updates take, and returns it with
            its buffers in the dtypes the optimizer keeps; ``ValueError`` naming the field
            otherwise. ``fn.optim`` loads checkpoints through it.
        full_state: ``None``, or ``full_state(state) -> state`` for such an optimizer: the
            state in one layout at every update count (every buffer allocated, zero where none
            was yet; the momentum as tensors), from which the updates continue bit for bit.
            ``fn.optim.PerRankState`` saves and loads through it, since
            ``torch.distributed.checkpoint`` loads in place into a layout fixed beforehand.
        first_compressed: ``None``, or ``first_compressed(state=None) -> int``, the first
            compressed update as the host knows it (with ``freeze_step="auto"``, the one decided
            in ``state``, or while undecided the latest it can be);
            :meth:`first_compressed_update` scans ``is_compressed`` without it.
        reads_state: whether ``is_compressed`` and ``plan`` take the state as their second
            argument (``False``, the default: they take ``t`` alone).

    Both updates have the signature ``(grads, state, params=None, *, step=None, plan=None,
    **extra)`` and take exactly one of ``step``, the 1-based count of the update being made (a
    Python ``int``), and ``plan=opt.plan(step)``; both give the same result, bit for bit.

    Compiling a training step: pass the plan into the compiled function instead of ``t``: a
    plan is a few bools, so the step compiles once per distinct plan (at most 3 for 1-bit Adam,
    4 for 1-bit LAMB, 5 for 0/1 Adam), however many steps are run. (Dynamo makes a ``t`` passed
    in a symbolic int after its first value and guards on the plan's decisions: one graph more
    than the plans for 1-bit Adam and 1-bit LAMB; 0/1 Adam's doubling intervals keep adding
    guards until dynamo's recompile limit.)::

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

    Example:
        >>> opt = fn.onebit_adam(lr=1e-2, freeze_step=2, comm=fn.collectives.Local())
        >>> params = {"w": torch.ones(3)}
        >>> state = opt.init(params)
        >>> for t in (1, 2):  # update 1 warms up, update 2 is compressed
        ...     updates, state = opt.update({"w": torch.ones(3)}, state, params, step=t)
        >>> opt.compressed_at(1), opt.compressed_at(2), opt.plan(2).compressed
        (False, True, True)
    """

    init: TransformInitFn
    warmup_update: TransformUpdateFn
    compressed_update: TransformUpdateFn
    is_compressed: Callable[..., bool]
    plan: Callable[..., Any] | None = None
    param_agreement: Callable[[int], float | None] = lambda t: 0.0
    fast_step: FastStepFn | None = None
    check_state: Callable[[Any], Any] | None = None
    full_state: Callable[[Any], Any] | None = None
    first_compressed: Callable[[Any], int] | None = None
    reads_state: bool = False

    def compressed_at(self, t: int, state: Any = None) -> bool:
        """Whether update ``t`` is compressed: ``is_compressed(t)``, or ``is_compressed(t,
        state)`` for a schedule that reads the state (``reads_state``).

        Args:
            t: the 1-based update count.
            state: the optimizer's state (needed where the schedule reads it).

        Returns:
            ``True`` for a compressed update, ``False`` for a warmup update.

        Example:
            >>> opt = fn.onebit_adam(1e-3, freeze_step=3, comm=fn.collectives.Local())
            >>> [opt.compressed_at(t) for t in (1, 2, 3)]
            [False, False, True]
        """
        return self.is_compressed(t, state) if self.reads_state else self.is_compressed(t)

    def first_compressed_update(self, last: int, state: Any = None) -> int | None:
        """The first update count ``t`` in ``1..last`` whose update is compressed, or ``None``
        when updates ``1..last`` all run the full-precision warmup. With
        ``freeze_step="auto"``: the switch decided in ``state``, or, while undecided or without
        a state, the latest it can be (``max_updates + 1``).

        Args:
            last: the last update count to look at.
            state: the optimizer's state (read by ``freeze_step="auto"``).

        Returns:
            The update count, or ``None``.

        Example:
            >>> opt = fn.onebit_adam(1e-3, freeze_step=100, comm=fn.collectives.Local())
            >>> opt.first_compressed_update(1000), opt.first_compressed_update(99)
            (100, None)
        """
        if self.first_compressed is not None:
            first = self.first_compressed(state)
            return first if first <= last else None
        return next((t for t in range(1, last + 1) if self.compressed_at(t, state)), None)

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

        Args:
            grads: this rank's local gradients.
            state: the optimizer's state.
            params: the params (needed for weight decay and by some rules).
            step: the 1-based count of the update being made.
            plan: ``self.plan(step)``, in place of ``step`` (for ``torch.compile``).
            **extra: passed on to the update (e.g. ``donate``).

        Returns:
            ``(updates, new_state)``.

        Raises:
            TypeError: if neither or both are given, ``step`` is a tensor, or a plan is given to
                an optimizer without ``plan``.
            ValueError: if ``step`` is not an int >= 1.
        """
        if check_step_or_plan(step, plan) is not None:
            compressed = self.compressed_at(step, state)
            phase = self.compressed_update if compressed else self.warmup_update
            return _without_unknown_donate(phase, extra)(grads, state, params, step=step, **extra)
        if self.plan is None:
            raise TypeError("this CompressedOptimizer has no plan function: pass step=t")
        phase = self.compressed_update if plan.compressed else self.warmup_update
        return _without_unknown_donate(phase, extra)(grads, state, params, plan=plan, **extra)


# Buffer donation: reading the ``donate`` keyword (the protocol is in GradientTransformation's
# docstring; fn.tree decides, leaf by leaf, which donated tensors can hold a result).


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


def _without_unknown_donate(update: TransformUpdateFn, extra: dict) -> TransformUpdateFn:
    """``update``, or, when ``extra`` donates, a wrapper that drops the keywords ``update``
    does not take (a phase without ``donate`` stays pure)."""
    return update if extra.get("donate") is None else _taking_extras(update)


def stateless(f: Callable[[Updates, Params | None], Updates]) -> GradientTransformation:
    """A transform without state from a function of the whole trees, ``f(updates, params)``.

    Args:
        f: ``f(updates, params) -> updates``; ``params`` is ``None`` when ``update`` gets none.

    Returns:
        A GradientTransformation whose state is :class:`EmptyState` and whose ``update`` returns
        ``f(updates, params)`` and the state it was given; extra keywords are ignored.

    Example:
        >>> import torch, fn
        >>> def clip_by_global_norm(updates, params):
        ...     norm = fn.tree.tree_l2_norm(updates)
        ...     return fn.tree.tree_scale(updates, 1 / norm.clamp(min=1.0))
        >>> clip = fn.stateless(clip_by_global_norm)
        >>> updates, state = clip.update({"w": torch.tensor([3.0, 4.0])}, clip.init(None))
        >>> updates["w"], state
        (tensor([0.6000, 0.8000]), EmptyState())
    """

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, **extra):
        del extra
        return f(updates, params), state

    return GradientTransformation(init_fn, update_fn)


def stateless_with_tree_map(
    f: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> GradientTransformation:
    """A transform without state from a function of one leaf, ``f(update, param)``.

    ``f`` is mapped over the update leaves with the matching param leaves (``None`` for every
    leaf when ``update`` gets no params); a ``None`` update stays ``None`` and ``f`` is not
    called for it.

    Args:
        f: ``f(update, param) -> update`` for one leaf.

    Returns:
        A GradientTransformation whose state is :class:`EmptyState` (see :func:`stateless`).

    Example:
        >>> import torch, fn
        >>> halve = fn.stateless_with_tree_map(lambda u, p: u / 2)
        >>> grads = {"w": torch.tensor([1.0, -3.0]), "frozen": None}
        >>> updates, _ = halve.update(grads, halve.init(grads))
        >>> updates
        {'w': tensor([ 0.5000, -1.5000]), 'frozen': None}
    """

    def map_leaves(updates, params):
        if params is None:
            return tree_map(lambda u: f(u, None), updates)
        return tree_map(f, updates, params)

    return stateless(map_leaves)


def identity() -> GradientTransformation:
    """The transformation that returns its updates unchanged.

    Returns:
        A stateless GradientTransformation (state :class:`EmptyState`).

    Example:
        >>> import torch, fn
        >>> tx = fn.identity()
        >>> updates, state = tx.update({"w": torch.ones(2)}, tx.init(None))
        >>> updates, state
        ({'w': tensor([1., 1.])}, EmptyState())
    """
    return stateless(lambda updates, params: updates)


def _taking_extras(update: TransformUpdateFn) -> TransformUpdateFn:
    """``update`` itself when it takes ``**extra`` (or has no signature to read); otherwise a
    wrapper that passes on only the extra keywords ``update`` names (optax's
    ``with_extra_args_support``)."""
    try:
        parameters = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):
        return update
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return update
    named = frozenset(
        p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )

    def update_fn(updates, state, params=None, **extra):
        return update(updates, state, params, **{k: v for k, v in extra.items() if k in named})

    return update_fn


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` one after the other; the state is the tuple of their states.

    .. math:: (u, s_1, \\dots, s_n) \\mapsto (T_n \\circ \\dots \\circ T_1)(u)

    Every extra keyword given to ``update`` (such as ``step``) goes to every member whose
    ``update`` takes ``**extra`` or names that keyword; the others do not see it. Each member's
    signature is read once, here. ``donate`` (see :class:`GradientTransformation`) is split
    like the state: member ``i`` gets ``donate[i]`` (or ``True``). Once a member returns
    updates that are tensors of its state, of an earlier member's state or of ``params`` (a
    momentum returned as the update, say), the members after it get no ``donate``: they would
    write into those tensors.

    Args:
        *transforms: gradient transformations, applied left to right.

    Returns:
        A GradientTransformation whose state is ``tuple(tx.init(params) for tx in transforms)``.

    Example:
        >>> import torch, fn
        >>> tx = fn.chain(fn.add_decayed_weights(0.5), fn.scale_by_learning_rate(0.1))
        >>> params = {"w": torch.tensor([2.0])}
        >>> updates, state = tx.update({"w": torch.tensor([1.0])}, tx.init(params), params)
        >>> updates["w"]  # -0.1 * (g + 0.5 * p)
        tensor([-0.2000])
    """
    updates_fns = [_taking_extras(tx.update) for tx in transforms]

    def init_fn(params):
        return tuple(tx.init(params) for tx in transforms)

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        if len(state) != len(transforms):
            raise ValueError(
                f"chain of {len(transforms)} transforms got a state of {len(state)} entries"
            )
        donated = split_donated("chain", donate, len(transforms))
        passing = donating(donate)
        kept = storages_of(params) if passing else set()
        new_state = []
        for update, s, d in zip(updates_fns, state, donated, strict=True):
            if passing and d is not None:
                updates, s = update(updates, s, params, donate=d, **extra)
            else:
                updates, s = update(updates, s, params, **extra)
            if passing:
                kept |= storages_of(s)
                # updates that hold state or params must not be written by the next members
                passing = kept.isdisjoint(storages_of(updates))
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init_fn, update_fn)


def apply_updates(params: Params, updates: Updates, *, donate: bool = False) -> Params:
    """Returns ``params + updates`` leafwise, cast back to each param's dtype.

    .. math:: p \\leftarrow p + u

    A ``None`` update leaves its param as it is. Inputs are not modified, unless ``donate``.

    Args:
        params: the params pytree.
        updates: a pytree of the same structure (``None`` leaves allowed).
        donate: add in place into the params' tensors (``p.add_(u)``, the same values) and
            return those tensors (buffer donation, see :class:`GradientTransformation`). The
            params must not require grad while autograd records.

    Returns:
        The new params, with each param's dtype.

    Example:
        >>> import torch, fn
        >>> params = {"w": torch.ones(2, dtype=torch.bfloat16), "frozen": torch.ones(1)}
        >>> fn.apply_updates(params, {"w": torch.tensor([0.5, -0.25]), "frozen": None})
        {'w': tensor([1.5000, 0.7500], dtype=torch.bfloat16), 'frozen': tensor([1.])}
    """

    p_leaves, spec = tree_flatten(params)
    u_leaves = spec.flatten_up_to(updates)
    pairs = [(i, p, u) for i, (p, u) in enumerate(zip(p_leaves, u_leaves, strict=True))]
    pairs = [(i, p, u) for i, p, u in pairs if p is not None and u is not None]
    ps = [p for _, p, _ in pairs]
    us = [u for _, _, u in pairs]
    if donate:
        same_dtypes = all(p.dtype == u.dtype for p, u in zip(ps, us, strict=True))
        if same_dtypes and foreach_ok(*ps, *us):
            torch._foreach_add_(ps, us)
        else:
            for p, u in zip(ps, us, strict=True):
                p.add_(u)
        return params
    sums = torch._foreach_add(ps, us) if foreach_ok(*ps, *us) else map(torch.add, ps, us)
    out = list(p_leaves)
    for (i, p, _), s in zip(pairs, sums, strict=True):
        out[i] = s.to(p.dtype)
    return tree_unflatten(out, spec)


def update_and_apply(
    tx: GradientTransformation,
    updates: Updates,
    state: OptState,
    params: Params,
    *,
    donate: Any = True,
    **extra: Any,
) -> tuple[Params, OptState]:
    """One optimizer step that updates the params in place.

    It is the same as::

        updates, state = tx.update(updates, state, params, donate=donate, **extra)
        params = fn.apply_updates(params, updates, donate=True)

    bit for bit (two exceptions: a param of ``-0.0`` whose step is exactly zero may stay ``-0.0``
    where the two calls give ``+0.0``, the values being equal; ``fn.adamw``'s fused step gives
    ``torch.optim.AdamW(fused=True)``'s params, those of the two calls wherever a step moves a
    param by less than half of it), with one pass over the params where ``tx`` has a fused step:
    ``fn.adam`` and ``fn.adamw`` where their fused kernel runs (see :func:`fn.adam`) write the
    new params and moments directly, reading the params, gradients and moments once as
    ``torch.optim.Adam(fused=True)`` does, instead of writing the updates and reading them back;
    ``fn.onebit_adam``'s donated compressed updates (several ranks, fp32 params) add the Adam
    direction to the params in the pass that writes the new momentum
    (``fn.kernels.adam_apply``), with the gradients' buffers as scratch, instead of writing the
    updates there.
    Other transforms run the two lines above.

    Args:
        tx: the transformation.
        updates: the incoming updates (gradients), donated as by ``tx.update(...,
            donate=...)``: their tensors may be written.
        state: ``tx``'s state.
        params: the params, updated in place and returned (the same tensors). They must not
            share memory with ``updates`` or ``state``.
        donate: the donated state, ``True`` (``state`` is written in place) or a state of
            ``state``'s structure (see :class:`GradientTransformation`).
        **extra: passed on to ``tx.update`` (e.g. ``step``).

    Returns:
        ``(params, new_state)``.

    Raises:
        ValueError: ``donate`` is ``None`` or ``False`` (this step writes the state: use
            ``tx.update`` for a pure one), ``params`` is ``None``, a param requires grad while
            autograd records, or the params share memory with the updates or the state.

    Example:
        >>> import torch, fn
        >>> tx = fn.adam(lr=0.1)
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> state = tx.init(params)
        >>> w, grads = params["w"], {"w": torch.tensor([0.5, -0.25])}
        >>> params, state = fn.update_and_apply(tx, grads, state, params)
        >>> params["w"] is w, w  # the first step is -lr * sign(g)
        (True, tensor([ 0.9000, -1.9000]))
    """
    if donate is None or donate is False:
        raise ValueError(
            "update_and_apply: donate must be True or a donated state (the step writes the "
            f"state), got {donate!r}; use tx.update and fn.apply_updates for a pure step"
        )
    if params is None:
        raise ValueError("update_and_apply: params are required (they are updated in place)")
    p_leaves = [p for p in tree_flatten(params)[0] if isinstance(p, torch.Tensor)]
    if torch.is_grad_enabled() and any(p.requires_grad for p in p_leaves):
        raise ValueError(
            "update_and_apply: a param requires grad while autograd records; run the step "
            "under torch.no_grad() or pass detached params"
        )
    if not storages_of(p_leaves).isdisjoint(storages_of((updates, state))):
        raise ValueError("update_and_apply: params share memory with the updates or the state")
    fast_step = getattr(tx, "fast_step", None)  # absent from a transform of another library
    if fast_step is not None:
        return fast_step(updates, state, params, donate=donate, **extra)
    updates, state = tx.update(updates, state, params, donate=donate, **extra)
    return apply_updates(params, updates, donate=True), state


class StagedState(NamedTuple):
    """The state of :func:`staged`.

    Attributes:
        count: ``[]`` int64 tensor, the number of updates made so far.
        inner: the compressed optimizer's own state.

    Example:
        >>> tx = fn.staged(fn.onebit_adam(lr=1e-2, freeze_step=3, comm=fn.collectives.Local()))
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> state.count, type(state.inner).__name__
        (tensor(0), 'OnebitAdamState')
    """

    count: torch.Tensor
    inner: OptState


def staged(opt: CompressedOptimizer) -> GradientTransformation:
    """A :class:`CompressedOptimizer` as a plain :class:`GradientTransformation`.

    The state adds an update counter. ``update`` uses the ``step`` or ``plan`` keyword when one
    is given (see :class:`CompressedOptimizer`); otherwise it reads the counter on the host
    (``count + 1``), which needs a concrete tensor (eager mode, Local or ProcessGroup comms).
    Under ``Simulated`` (vmap) pass ``step=t``; under ``torch.compile`` pass ``plan=opt.plan(t)``.
    A donated :class:`StagedState` (``donate=``) hands its ``inner`` state to the optimizer.

    Args:
        opt: the compressed optimizer.

    Returns:
        A GradientTransformation with state :class:`StagedState` (``count``, and ``inner``, the
        optimizer's state).

    Example:
        >>> import torch, fn
        >>> from fn.collectives import Local
        >>> params = {"w": torch.zeros(3)}
        >>> tx = fn.staged(fn.onebit_adam(lr=1e-2, freeze_step=3, comm=Local()))
        >>> state = tx.init(params)
        >>> for _ in range(3):  # updates 1 and 2 warm up, update 3 is compressed
        ...     updates, state = tx.update({"w": torch.ones(3)}, state, params)
        >>> int(state.count)
        3
    """

    def init_fn(params):
        return StagedState(torch.zeros((), dtype=torch.int64), opt.init(params))

    def update_fn(updates, state, params=None, *, step=None, plan=None, donate=None, **extra):
        if donating(donate):  # the inner state's part
            extra["donate"] = True if donate is True else donated_state(donate, state).inner
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

    Args:
        state: an optimizer state.
        **values: new values by field name, e.g. ``lr=3e-4``.

    Returns:
        The new state; ``state`` itself is not modified.

    Raises:
        KeyError: if no state field has one of the names.
        ValueError: an ``lr`` given as a Python number that is negative, NaN or infinite (as
            the optimizers' constructors refuse it; a tensor is not read on the host).

    Example:
        >>> import torch, fn
        >>> tx = fn.adam(lr=1e-3)
        >>> state = fn.set_hyperparams(tx.init({"w": torch.zeros(2)}), lr=0.25)
        >>> fn.get_hyperparam(state, "lr")
        tensor(0.2500)
    """
    if "lr" in values and not isinstance(values["lr"], torch.Tensor):
        check_finite_nonnegative("set_hyperparams", lr=values["lr"])
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

    Args:
        state: an optimizer state.
        name: a field name of one of its NamedTuples, e.g. ``"lr"`` or ``"count"``.

    Returns:
        That field's value.

    Raises:
        KeyError: if no state field has that name.

    Example:
        >>> import torch, fn
        >>> state = fn.adamw(lr=0.01).init({"w": torch.zeros(2)})
        >>> fn.get_hyperparam(state, "lr"), fn.get_hyperparam(state, "count")
        (tensor(0.0100), tensor(0))
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
