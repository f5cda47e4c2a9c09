"""The shared driver of the compressed optimizers (1-bit Adam, 0/1 Adam, 1-bit LAMB).

Each optimizer is its state, its pure per-leaf rules (taking the shared
:class:`OnebitSettings`, from :func:`onebit_settings`) and, where the algorithm needs one, a
step over all leaves at once (1-bit LAMB's fused allreduce, 0/1 Adam's schedule counters); the
allocation-free steps of its donated updates live beside the rules in
``fn.transforms.onebit_fast``. This module does the rest the same way for all three:

- :func:`compressed_optimizer` builds the ``CompressedOptimizer``: it resolves the plan of the
  update (from exactly one of ``step`` and ``plan``), checks that ``params`` are given where the
  rule needs them, reads the learning rate of the update and advances the counter.
- :func:`map_leaves` runs the per-leaf rule on the state's leaves (:func:`leaf_type`, one
  NamedTuple per leaf derived from the state's fields): :func:`leaves_of` walks the leaves with
  a gradient (``fn.tree.live_leaves``) and checks their shapes, :func:`rebuilt` makes the
  trees again; a fast step takes the same leaves and returns the same results.
- The pieces the rules share: :func:`moving_average`, :func:`dense_moments` (the warmup's dense
  step), :func:`adam_denominator` and :func:`adam_direction` (with the safeguard's clip,
  :func:`adam_ratio_bound`), :func:`report_frozen_variance`.

Nothing here communicates except :func:`compressed_mean` and :func:`dense_moments`, which call
``fn.collectives``. The exact rules are in ``docs/algorithms.md``.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from fn import collectives, kernels
from fn.base import CompressedOptimizer, Params, Updates, apply_updates, donated_state
from fn.collectives import PackedSigns
from fn.errors import (
    check_betas,
    check_finite,
    check_finite_nonnegative,
    check_lr,
    check_shapes,
    check_step_or_plan,
    require_params,
)
from fn.transforms import _onebit_state as onebit_state
from fn.transforms._learning_rate import learning_rate_now
from fn.transforms._leaves import refuse_complex
from fn.transforms._onebit_state import OnebitSettings
from fn.tree import LiveLeaves, PyTree, live_leaves, tree_flatten, tree_map

logger = logging.getLogger("fn.transforms")
# More than this fraction of a frozen variance below the safe range is no longer the few dead
# units a healthy run has: the updates of most elements would be clipped.
_RISKY_FRACTION = 0.5

LearningRate = float | Callable[[torch.Tensor], torch.Tensor]

# (grads, state, params, plan, lr of this update) -> (updates, state without count and lr)
UpdateRule = Callable[[Updates, Any, Params | None, Any, torch.Tensor], tuple[Updates, Any]]


def compressed_optimizer(
    name: str,
    lr: LearningRate,
    state_type: type[NamedTuple],
    init_fields: Callable[[Params], dict[str, Any]],
    update: UpdateRule,
    is_compressed: Callable[..., bool],
    plan_for: Callable[..., Any],
    plan_type: type,
    *,
    params_needed_for: str | None,
    warmup_phase: str = "warmup",
    fused_apply: bool = False,
    first_compressed: Callable[[Any], int] | None = None,
    keywords: tuple[str, ...] = (),
) -> CompressedOptimizer:
    """A ``CompressedOptimizer`` whose two updates run ``update`` on the plan of the update.
    A compressed update on a state with no update made raises (:func:`check_warmed_up`, after
    the update's own checks; the update is pure, so nothing changes; when donating, before it).

    Both updates take the extra keyword ``donate`` (buffer donation: ``None``, ``True`` for
    the state itself, or a state like ``state``). The compressed update passes the donated
    state to ``update`` as ``donated=``; the warmup update ignores it (it allocates).

    Args:
        name: the optimizer, for error messages.
        lr: the learning rate or schedule; the state holds it as the 0-dim fp32 field ``lr``.
        state_type: the state NamedTuple; its first fields are ``count`` and ``lr``.
        init_fields: the other fields of the initial state, by name, for the params.
        update: ``(grads, state, params, plan, lr, *, donated=None) -> (updates, state)``; the
            plan is a ``plan_type`` whose ``compressed`` matches the phase, ``lr`` the learning
            rate of this update, ``donated`` the donated state (compressed updates only). The
            ``count`` and ``lr`` of the state it returns are set here.
        is_compressed: the host schedule, ``CompressedOptimizer.is_compressed``: ``(t, state)``
            (the optimizer ``reads_state``).
        plan_for: the plan of the 1-based update ``t``, ``(t, state)``.
        plan_type: the type of the plans.
        params_needed_for: what needs the params (e.g. ``"weight_decay > 0"``), or ``None`` when
            the updates work without them.
        warmup_phase: the name of the phase of ``warmup_update`` in error messages.
        fused_apply: register a step for :func:`fn.update_and_apply` whose donated compressed
            updates call ``update(..., donated=..., apply=True)``: ``update`` then adds the
            update of every leaf it can to its param in place and returns ``None`` there (the
            other leaves' updates are added by ``apply_updates``). Other updates run
            ``update`` and ``apply_updates``.
        first_compressed: ``CompressedOptimizer.first_compressed``, or ``None``.
        keywords: the extra keywords of the updates that are passed on to ``update`` (when
            given); other extra keywords are ignored.

    Returns:
        ``CompressedOptimizer(init, warmup_update, compressed_update, is_compressed, plan_for)``.
    """

    def init_fn(params: Params) -> Any:
        refuse_complex(name, params)
        count = torch.zeros((), dtype=torch.int64)
        eta = torch.as_tensor(lr(count) if callable(lr) else float(lr), dtype=torch.float32)
        return state_type(count=count, lr=eta, **init_fields(params))

    def phase_step(compressed: bool):
        phase = "compressed" if compressed else warmup_phase

        def step_fn(grads, state, params, step, plan, donate, apply, **passed):
            plan = _resolve_plan(
                step, plan, partial(plan_for, state=state), plan_type, compressed, phase
            )
            if params_needed_for is not None:
                require_params(params, params_needed_for)
            eta = learning_rate_now(lr, state.count, state.lr)
            donated = donated_state(_same_forms(donate, state), state)
            if compressed and donated is not None:
                check_warmed_up(name, state.count)  # before any donated buffer is written
                passed |= {"donated": donated, "apply": True} if apply else {"donated": donated}
            updates, new_state = update(grads, state, params, plan, eta, **passed)
            if compressed:  # after the update's own checks (of the gradients); nothing is kept
                check_warmed_up(name, state.count)
                freezes = bool(getattr(plan, "freezes", False))
                _announce_compressed(
                    name, partial(is_compressed, state=state), state.count, freezes
                )
            return updates, new_state._replace(count=state.count + 1, lr=eta)

        return step_fn

    warmup_step, compressed_step = phase_step(False), phase_step(True)

    opt = CompressedOptimizer(
        init_fn,
        _update_fn(warmup_step, keywords),
        _update_fn(compressed_step, keywords),
        is_compressed,
        plan_for,
        first_compressed=first_compressed,
        reads_state=True,
    )
    if not fused_apply:
        return opt
    return opt._replace(
        fast_step=_fast_step(is_compressed, plan_type, warmup_step, compressed_step)
    )


def _fast_step(
    is_compressed: Callable[[int], bool], plan_type: type, warmup_step: Any, compressed_step: Any
) -> Any:
    """The ``fast_step`` of :func:`compressed_optimizer` with ``fused_apply``: the update of
    the phase with ``apply=True``, then ``apply_updates`` of the leaves it did not apply."""

    def fast_step(grads, state, params, *, donate, step=None, plan=None, **extra):
        del extra
        if check_step_or_plan(step, plan) is not None:
            compressed = is_compressed(step, state)
        else:  # a wrong plan: the compressed step's check raises
            compressed = not isinstance(plan, plan_type) or plan.compressed
        phase_fn = compressed_step if compressed else warmup_step
        updates, new_state = phase_fn(grads, state, params, step, plan, donate, apply=True)
        return apply_updates(params, updates, donate=True), new_state

    return fast_step


def _update_fn(step_fn: Callable[..., tuple[Updates, Any]], keywords: tuple[str, ...]) -> Any:
    """An update of :func:`compressed_optimizer`, running the phase's ``step_fn`` with the
    extra keywords named in ``keywords`` (the others are ignored)."""

    def update_fn(
        grads: Updates,
        state: Any,
        params: Params | None = None,
        *,
        step: int | None = None,
        plan: Any = None,
        donate: Any = None,
        **extra: Any,
    ) -> tuple[Updates, Any]:
        passed = {k: extra[k] for k in keywords if k in extra}
        return step_fn(grads, state, params, step, plan, donate, apply=False, **passed)

    return update_fn


def _same_forms(donated: Any, state: Any) -> Any:
    """``donated`` (a state of ``state``'s type, or ``None`` / ``True``) with ``None`` for every
    field kept in another form than in ``state`` (e.g. a momentum packed in one, fp32 in the
    other, as between the states before and after the freeze): such a field is not donated."""
    if not isinstance(donated, type(state)):
        return donated
    fields = {
        field: None
        for field, mine in zip(state._fields, state, strict=True)
        if tree_flatten(getattr(donated, field))[1] != tree_flatten(mine)[1]
    }
    return donated._replace(**fields)


def _announce_compressed(
    name: str, is_compressed: Callable[[int], bool], count: torch.Tensor, freezes: bool
) -> None:
    """Logs the run's first compressed update (where the count is on the host), so that a run
    whose compressed phase starts late, or never, can be told from the log: the update after
    the warmup's last, or one whose plan ``freezes`` (a state carried over from Adam's past
    ``freeze_step``, as ``fn.fsdp.OnebitAdam.load_adam_state`` makes)."""
    made = host_count(count)  # the updates made before this one
    if made is None:
        return
    if not freezes and made > 0 and is_compressed(made):
        return  # not a switch from the warmup (rare, so the scan below is too)
    first = next((t for t in range(1, made + 2) if is_compressed(t)), None)
    if freezes or first == made + 1:
        logger.info("%s: compressed updates start at update %d", name, made + 1)


class LeafInputs(NamedTuple):
    """One leaf with a gradient, as :func:`leaves_of` hands it to a rule or a fast step."""

    g: torch.Tensor  # the gradient, fp32
    leaf: Any  # the leaf_type of the leaf's state
    inputs: tuple[Any, ...]  # the leaf's entry of each further tree (params, masks)
    spare: Any  # the leaf_type of the donated state's leaves, or None


class Leaves(NamedTuple):
    """The leaves of an update (:func:`leaves_of`); :func:`rebuilt` makes the trees again."""

    walk: LiveLeaves  # the gradients, then the leaf_type's fields, the inputs, the donated fields
    leaf_type: type[NamedTuple]
    with_grad: list[LeafInputs]  # the leaves with a gradient, in leaf order


def leaves_of(
    name: str,
    grads: Updates,
    state: Any,
    leaf_type: type[NamedTuple],
    *inputs: PyTree | None,
    donated: Any = None,
) -> Leaves:
    """Flattens every per-leaf state field, ``grads``, ``inputs`` and the ``donated`` state
    against the structure of the variance ``exp_avg_sq`` (:func:`fn.tree.live_leaves`), which
    every optimizer of the family keeps for every param, in its shape (a momentum may be a
    :class:`fn.collectives.PackedSigns`, an error buffer ``None``), and checks the gradient
    shapes against it.

    Raises:
        ValueError: naming the leaf, if a gradient's shape differs from its state's.
    """
    fields = leaf_type._fields
    trees = [*(getattr(state, field) for field in fields), *inputs]
    if donated is not None:
        trees += [getattr(donated, field) for field in fields]
    walk = gradient_leaves(name, grads, state.exp_avg_sq, *trees)
    n, m = len(fields), len(inputs)
    with_grad = []
    for g, _, *row in zip(*(walk.at_live(k) for k in range(len(walk.leaves))), strict=True):
        leaf, extra = leaf_type._make(row[:n]), tuple(row[n : n + m])
        spare = None if donated is None else leaf_type._make(row[n + m :])
        with_grad.append(LeafInputs(g.float(), leaf, extra, spare))
    return Leaves(walk, leaf_type, with_grad)


def gradient_leaves(
    name: str, grads: Updates, variance: PyTree, *trees: PyTree | None
) -> LiveLeaves:
    """``fn.tree.live_leaves(grads, variance, *trees)`` against the structure of the variance,
    with every gradient's shape checked against its variance's.

    Raises:
        ValueError: naming the leaf, if a gradient's shape differs from its state's.
    """

    def check(i, g, like):
        if like is None or g.shape != like.shape:  # named only on error: naming costs a walk
            what = f"gradient leaf {_leaf_name(variance, i)}"
            if like is None:
                raise ValueError(f"{name}: {what} has no state (its param was None at init)")
            check_shapes(name, like, g, what)

    return live_leaves(grads, variance, *trees, structure=variance, check=check)


def rebuilt(
    leaves: Leaves, results: list[tuple[torch.Tensor | None, Any]], state: Any
) -> tuple[Updates, Any]:
    """The updates and ``state`` with its per-leaf fields rebuilt from ``results``, one
    ``(update, new_leaf)`` per leaf with a gradient (a leaf without one gets a ``None`` update
    and keeps its state; a field whose leaves are all unchanged stays the same tree)."""
    walk = leaves.walk
    new_fields = {}
    for k, field in enumerate(leaves.leaf_type._fields):
        new = [leaf[k] for _, leaf in results]
        if any(a is not x.leaf[k] for a, x in zip(new, leaves.with_grad, strict=True)):
            new_fields[field] = walk.rebuild(new, fill=2 + k)  # after the gradients, variance
    return walk.rebuild([update for update, _ in results]), state._replace(**new_fields)


def map_leaves(
    name: str,
    rule: Callable[..., tuple[torch.Tensor | None, Any]],
    grads: Updates,
    state: Any,
    leaf_type: type[NamedTuple],
    *inputs: PyTree | None,
) -> tuple[Updates, Any]:
    """Runs ``rule(g, leaf, *input_leaves) -> (update, new_leaf)`` on every leaf with a gradient.

    Args:
        name: the optimizer, for error messages.
        rule: the per-leaf rule. ``g`` is the leaf's gradient as fp32, ``leaf`` a ``leaf_type``
            of the leaf's state, ``input_leaves`` the leaf's entry of each of ``inputs``.
        grads: the gradients, a tree like the params; ``None`` leaves have no gradient.
        state: the optimizer state.
        leaf_type: a NamedTuple whose fields name the per-leaf fields of ``state`` (trees like
            the params). All of them, ``grads`` and ``inputs`` are flattened against the spec of
            the first one.
        *inputs: further trees like the params (params, masks), or ``None`` (``None`` at every
            leaf).

    Returns:
        The updates (``None`` where the gradient is ``None``) and ``state`` with the fields of
        ``leaf_type`` rebuilt from the new leaves (:func:`rebuilt`).

    Raises:
        ValueError: naming the leaf, if a gradient's shape differs from its state's.
    """
    leaves = leaves_of(name, grads, state, leaf_type, *inputs)
    results = [rule(x.g, x.leaf, *x.inputs) for x in leaves.with_grad]
    return rebuilt(leaves, results, state)


def moving_average(
    x: torch.Tensor, beta: float, y: torch.Tensor, *, square: bool = False
) -> torch.Tensor:
    """``beta * x + (1 - beta) * y``, or with ``square`` ``beta * x + (1 - beta) * y * y``,
    rounded as written (``(beta * x) + (((1 - beta) * y) * y)``). The sum and the second product
    go in place into fresh products: the same rounding, fewer full-size temporaries."""
    new = (1 - beta) * y
    if square:
        new.mul_(y)
    return (beta * x).add_(new)


def onebit_settings(
    name: str,
    lr: LearningRate,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    comm: Any,
    safeguard: bool,
    local_world_size: int | None = None,
    error_dtype: torch.dtype = torch.float32,
) -> OnebitSettings:
    """Checks the hyperparameters that the 1-bit family shares and returns its settings; the
    safeguard's clip is :func:`adam_ratio_bound` of the betas (``None`` without ``safeguard``).

    Raises:
        ValueError: naming the argument: ``lr`` (unless a schedule) or ``eps`` that is not a
            finite real number >= 0; ``weight_decay`` that is not a real number >= 0;
            ``betas`` that is not a pair of real numbers in [0, 1); an ``error_dtype`` other
            than fp32, bf16 or fp16; a ``local_world_size`` that is not a positive divisor of
            the world size (or, on a ``ProcessGroup``, differs between ranks: its node groups
            are built here, a collective call).
    """
    b1, b2 = check_betas(name, betas)
    check_finite_nonnegative(name, eps=eps)
    check_finite_nonnegative(name, weight_decay=weight_decay)
    check_lr(name, lr)
    collectives.check_error_dtype(name, error_dtype)
    clip = adam_ratio_bound(b1, b2) if safeguard else None
    if local_world_size is not None:
        comm.split(local_world_size)
    return OnebitSettings(comm, b1, b2, eps, clip, weight_decay, local_world_size, error_dtype)


def leaf_type(state_type: type[NamedTuple], *, shared: tuple[str, ...] = ()) -> type[NamedTuple]:
    """The NamedTuple of one leaf of the per-leaf fields of ``state_type`` (trees like the
    params): every field but ``count``, ``lr`` and the ``shared`` ones (one value for all
    leaves), in the state's order. :func:`map_leaves` hands it to a rule, which returns one.

    Example:
        >>> leaf_type(fn.OnebitLambState, shared=("worker_error", "server_error"))._fields[:3]
        ('exp_avg', 'exp_avg_sq', 'exp_avg_sq_fresh')
    """
    unknown = [field for field in shared if field not in state_type._fields]
    if unknown:
        raise TypeError(f"{state_type.__name__} has no fields {unknown}")
    skipped = ("count", "lr", *shared)
    fields = [(field, torch.Tensor) for field in state_type._fields if field not in skipped]
    return NamedTuple(f"{state_type.__name__}Leaf", fields)


def dense_moments(
    g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, b1: float, b2: float, comm: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The warmup (dense) step of the moments: ``g`` averaged over the ranks by a dense
    allreduce and checked to be finite (on every rank at once), then ``m`` and ``v`` moved
    towards it and its square (:func:`moving_average`)."""
    g = check_finite(comm.all_reduce(g, op="mean"), "the averaged gradient")
    return moving_average(m, b1, g), moving_average(v, b2, g, square=True)


def adam_denominator(v: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(v) + eps`` with the square root correctly rounded (``fn.kernels.sqrt_rn``: the
    same bits on every device)."""
    return kernels.sqrt_rn(v) + eps


def adam_direction(
    m: torch.Tensor,
    denom: torch.Tensor,
    p: torch.Tensor | None,
    *,
    bound: float | None,
    weight_decay: float,
) -> torch.Tensor:
    """The 1-bit family's Adam direction ``clamp(m / denom, -bound, bound) + weight_decay * p``
    (no clamp for ``bound=None``: the safeguard off, or the variance not frozen), a fresh
    tensor; ``denom`` is :func:`adam_denominator`."""
    u = m / denom
    if bound is not None:
        u = u.clamp(-bound, bound)
    if weight_decay > 0:
        u = u.add_(weight_decay * p.float())
    return u


def init_error_feedback_per_leaf(params: Params, h: OnebitSettings) -> tuple[PyTree, PyTree]:
    """The worker and server errors of one compressed allreduce per leaf (trees like the
    params, ``None`` where a param is ``None``), at ``h``'s level, in ``h.error_dtype``."""
    walk = live_leaves(params)
    pairs = [h.zero_errors(p.numel(), p.device) for p in walk.at_live(0)]
    return walk.rebuild([pair[0] for pair in pairs]), walk.rebuild([pair[1] for pair in pairs])


def no_error_feedback(params: Params) -> PyTree:
    """The error feedback of a fresh state: ``None`` at every leaf (a tree like the params).
    The buffers are allocated by the first compressed update (:func:`error_feedback`)."""
    return tree_map(lambda p: None, params)


def error_feedback(
    worker_error: torch.Tensor | None,
    server_error: torch.Tensor | None,
    x: torch.Tensor,
    h: OnebitSettings,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The error buffers of a compressed allreduce of ``x``: the given ones, or zeros of the
    level's shapes in ``h.error_dtype`` where they are not allocated yet (``None``) and the
    allreduce compresses (several ranks, ``x`` not empty); else ``None`` stays ``None``."""
    if worker_error is not None or h.comm.world_size == 1 or x.numel() == 0:
        return worker_error, server_error
    return h.zero_errors(x.numel(), x.device)


def compressed_mean(
    x: torch.Tensor,
    worker_error: torch.Tensor | None,
    server_error: torch.Tensor | None,
    h: OnebitSettings,
    local_check: str | None = None,
    out: Any = None,
    packed: bool = False,
) -> tuple[torch.Tensor | PackedSigns, torch.Tensor | None, torch.Tensor | None]:
    """``fn.collectives.compressed_allreduce(x, worker_error, server_error, out=out,
    packed=packed)`` at ``h``'s comm and level: the 1-bit mean of ``x`` over the ranks (with
    ``packed``, as the :class:`~fn.collectives.PackedSigns` it arrives as) and the new errors
    (written into the buffers of ``out`` where given; allocated by :func:`error_feedback` where
    ``None``). With one worker there is nothing to compress: ``x`` comes back as it is,
    checked to be finite (naming ``local_check``) unless that is ``None``; an empty ``x`` comes
    back unchanged."""
    comm = h.comm
    worker_error, server_error = error_feedback(worker_error, server_error, x, h)
    if comm.world_size > 1 and x.numel() > 0:
        return collectives.compressed_allreduce(
            x,
            worker_error,
            server_error,
            comm=comm,
            local_world_size=h.local_world_size,
            out=out,
            packed=packed,
        )
    if comm.world_size == 1 and local_check is not None:
        x = check_finite(x, local_check)
    return x, worker_error, server_error


def _resolve_plan(
    step: int | None,
    plan: Any,
    plan_for: Callable[[int], Any],
    plan_type: type,
    compressed: bool,
    phase: str,
) -> Any:
    """The plan of the update being made, from exactly one of ``step`` (turned into
    ``plan_for(step)`` on the host) and ``plan`` (``opt.plan(t)``); both give the same update.

    Raises:
        TypeError: if neither or both are given, ``step`` is a tensor or ``plan`` is not a
            ``plan_type``.
        ValueError: if ``step`` is not an int >= 1, or the plan is not one of ``phase``.
    """
    given_step = check_step_or_plan(step, plan) is not None
    if given_step:
        # Python bools, also for a symbolic step under torch.compile: dynamo then guards on
        # each decision (e.g. t >= freeze_step), not on the value of t.
        plan = plan_for(step)
        plan = type(plan)(*(True if decided else False for decided in plan))
    elif not isinstance(plan, plan_type):
        raise TypeError(f"plan must be a {plan_type.__name__} (opt.plan(t)), got {plan!r}")
    if plan.compressed != compressed:
        # formatted here only: a step given to a compiled function may be a symbolic int
        where = f"update {step}" if given_step else f"the update planned as {plan}"
        raise ValueError(f"{where} is not a {phase} update")
    return plan


def _leaf_name(tree: PyTree, index: int) -> str:
    """The key path of leaf ``index`` of ``tree`` (e.g. ``['w']``), for error messages."""
    paths = pytree.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return pytree.keystr(paths[index][0])


def adam_ratio_bound(b1: float, b2: float) -> float:
    r"""The largest :math:`|m / \sqrt{v}|` that Adam without bias correction reaches, over all
    gradient sequences: :math:`B = (1-\beta_1) / \sqrt{(1-\beta_2)(1-\beta_1^2/\beta_2)}`
    (``inf`` when :math:`\beta_1^2 \ge \beta_2`); 7.27 for the default betas (0.9, 0.999).

    From zero, :math:`m = (1-\beta_1)\sum_j \beta_1^j g_{t-j}` and
    :math:`v = (1-\beta_2)\sum_j \beta_2^j g_{t-j}^2`; Cauchy-Schwarz on
    :math:`\sum_j (\beta_1/\sqrt{\beta_2})^j \cdot \sqrt{\beta_2}^j g_{t-j}` gives
    :math:`|m| \le (1-\beta_1) \sqrt{v / (1-\beta_2)} \sqrt{\sum_j (\beta_1^2/\beta_2)^j}`,
    and the geometric sum is below :math:`1 / (1 - \beta_1^2/\beta_2)`. The bound is reached by
    gradients growing like :math:`(\beta_1/\beta_2)^{-j}`, so dense Adam never exceeds it.
    """
    ratio = b1 * b1 / b2 if b2 > 0 else math.inf
    if ratio >= 1:
        return math.inf
    return (1 - b1) / math.sqrt((1 - b2) * (1 - ratio))


def host_count(count: torch.Tensor) -> int | None:
    """The update count as a Python int where it can be read without tracing or a device sync:
    eager, on the CPU (where ``init`` puts it); under ``Simulated`` (vmap) the largest over the
    ranks. ``None`` under ``torch.compile``, other functorch transforms or on an accelerator."""
    value = host_tensor(count)
    if value is None or value.device.type != "cpu" or value.numel() == 0:
        return None
    return int(value.max())


def check_warmed_up(name: str, count: torch.Tensor) -> None:
    """Raises ``ValueError`` if a compressed update gets a state with no update made (count 0),
    whose variance was never estimated (checked where :func:`host_count` can read the count)."""
    if host_count(count) == 0:
        raise ValueError(
            f"{name}: a compressed update on a state that never warmed up (count 0): the "
            "variance it divides by was never estimated. Run the warmup updates first (step=1, "
            "2, ...) or restore the state saved with the params; nothing was updated"
        )


def report_frozen_variance(
    name: str,
    state: Any,
    h: OnebitSettings,
    *,
    skip: PyTree | None = None,
    mask: PyTree | None = None,
) -> None:
    """Reports the frozen variance's elements that are zero or below the safe range
    ``sqrt(v) + eps < rms(m) / bound`` of their leaf. Once compressed, each element of the
    momentum has about its leaf's RMS magnitude, so there ``m / (sqrt(v) + eps)`` would exceed any
    update dense Adam can make. Called once, at the freeze; silent where the counts cannot be
    read on the host (under ``torch.compile`` or a functorch transform other than vmap).

    Healthy runs have a few percent to a fifth of their elements below the range (the safeguard
    clips them), so the counts go to the ``fn.transforms`` logger at INFO. A ``RuntimeWarning``
    is raised only where training is at risk: an element at exactly zero that will be updated
    (outside ``mask``), more than half of the elements below the range, or any element below it
    when nothing bounds the updates (``safeguard=False``, or betas with ``b1^2 >= b2``).

    Args:
        name: the optimizer, for the message.
        state: the state whose ``exp_avg`` (m) and ``exp_avg_sq`` (v) freeze.
        h: the optimizer's settings (``h.clip`` is ``None`` when the updates are not bounded).
        skip: optional tree like the params; leaves that are ``True`` do not freeze.
        mask: optional tree like the params of 0/1 masks (``exp_avg_mask``); an element masked
            to 0 is never updated, so its variance at zero is no risk.
    """
    if torch.compiler.is_compiling():
        return
    eps, bound, safeguard = h.eps, adam_ratio_bound(h.b1, h.b2), h.clip is not None
    zero = below = total = 0
    walk = live_leaves(state.exp_avg_sq, state.exp_avg, skip, mask)  # the leaves with a variance
    for v, m, skipped, kept in zip(*(walk.at_live(k) for k in range(4)), strict=True):
        if skipped:
            continue
        rms = onebit_state.momentum(m, v, kept).square().mean().sqrt()
        at_zero = v <= 0
        zero = zero + (at_zero if kept is None else at_zero & (kept != 0)).sum()
        below = below + ((v > 0) & (v.sqrt().add_(eps).mul_(bound) < rms)).sum()
        total += v.numel()
    if total == 0:
        return
    zero, below = host_tensor(zero), host_tensor(below)
    if zero is None or below is None:
        return
    zero, below = int(zero.max()), int(below.max())
    unbounded = not safeguard or math.isinf(bound)
    if not safeguard:
        consequence = "with safeguard=False (DeepSpeed's rule) their updates can blow up"
    elif math.isinf(bound):
        consequence = "betas with b1^2 >= b2 leave the safeguard no bound, so they can blow up"
    else:
        consequence = f"the safeguard bounds their updates at {bound:.3g} * lr"
    message = (
        f"{name}: the variance froze with {zero} of {total} elements at zero and {below} below "
        f"the safe range sqrt(v) + eps >= rms(m) / {bound:.3g} of their leaf (e.g. units or "
        f"embedding rows without gradient during the warmup); {consequence}"
    )
    at_risk = zero > 0 or below > _RISKY_FRACTION * total or (unbounded and below > 0)
    if at_risk:
        fixes = ['exp_avg_mask="auto" keeps elements without gradient still'] if zero else []
        if below > _RISKY_FRACTION * total:
            fixes.append(
                "a compression scale per tensor (the torch.optim adapter's flatten=False) or a "
                "longer warmup brings more into the range"
            )
        fixes.append('see docs/troubleshooting.md, "The variance froze"')
        warnings.warn(f"{message}. {'; '.join(fixes)}", RuntimeWarning, stacklevel=2)
    else:
        logger.info(message)


def host_tensor(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` as a plain tensor, unwrapped from every vmap level (``Simulated``): one entry per
    rank; ``None`` under ``torch.compile`` or another functorch transform (e.g. ``grad``)."""
    if torch.compiler.is_compiling():
        return None
    while torch._C._functorch.is_batchedtensor(x):
        x = torch._C._functorch.get_unwrapped(x)
    if torch._C._functorch.is_functorch_wrapped_tensor(x):
        return None
    return x
