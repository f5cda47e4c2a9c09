"""0/1 Adam (Lu et al. 2022) as a pure state transition."""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import torch

from fn.base import CompressedOptimizer, PerRankField, SecondMomentField
from fn.collectives import ErrorFeedbackField
from fn.errors import check_finite, check_int
from fn.transforms import _leafwise as leafwise
from fn.transforms import _onebit_state as onebit_state
from fn.transforms._onebit_schedules import AutoFreeze, ZeroOneAdamPlan, ZeroOneAdamSchedule
from fn.transforms.onebit_fast import zero_one_adam_step
from fn.tree import PyTree, tree_map, tree_zeros_like


class ZeroOneAdamState(NamedTuple):
    """The state of :func:`zero_one_adam` (``N_leaf`` a leaf's padded size, ``W`` ranks, ``L``
    ranks per node).

    Attributes:
        count: ``[]`` int64 tensor, the number of updates made so far.
        lr: ``[]`` fp32 tensor, the learning rate of the last update (or the one to use next).
        exp_avg: like params, fp32: the momentum :math:`m` (each rank's own when frozen).
        exp_avg_sq: like params, fp32: the variance :math:`v`.
        momentum_accumulator: like params, fp32: :math:`a`, the local updates since a sync.
        worker_error: per leaf ``[N_leaf / L]`` (``L = 1`` flat) in ``error_dtype``: the worker
            error :math:`e_w`.
        server_error: per leaf ``[N_leaf / W]`` in ``error_dtype``: the server error :math:`e_s`.
        var_interval: ``[]`` int64 tensor, the variance refreshes' interval; with the three
            counters below, ``ZeroOneAdamSchedule.counters(count + 1)``.
        var_counter: ``[]`` int64 tensor, the refreshes counted toward its next doubling.
        local_interval: ``[]`` int64 tensor, the updates from one sync to the next.
        local_counter: ``[]`` int64 tensor, the frozen updates counted toward its next doubling.
        lrs: ``[]`` fp32 tensor, the sum of the learning rates of the local steps since a sync.
        frozen: ``[]`` bool tensor, whether the variance is frozen (local steps and syncs).

    Example:
        >>> opt = fn.zero_one_adam(lr=1e-3, var_freeze_step=2, comm=fn.collectives.Local())
        >>> state = opt.init({"w": torch.zeros(2)})
        >>> state.frozen, state.var_interval, state.local_interval
        (tensor(False), tensor(1), tensor(1))
    """

    count: torch.Tensor
    lr: torch.Tensor
    exp_avg: PerRankField
    exp_avg_sq: SecondMomentField
    momentum_accumulator: PerRankField
    worker_error: ErrorFeedbackField
    server_error: ErrorFeedbackField
    var_interval: torch.Tensor
    var_counter: torch.Tensor
    local_interval: torch.Tensor
    local_counter: torch.Tensor
    lrs: torch.Tensor
    frozen: torch.Tensor


# The fields with one value for all leaves: the schedule counters and the sum of learning rates.
_SCHEDULE = ("var_interval", "var_counter", "local_interval", "local_counter", "lrs", "frozen")
_Leaf = leafwise.leaf_type(ZeroOneAdamState, shared=_SCHEDULE)


def zero_one_adam(
    lr: leafwise.LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    var_freeze_step: int = 100000,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
    *,
    comm: Any,
    exp_avg_mask: PyTree | None = None,
    safeguard: bool = True,
    local_world_size: int | None = None,
    error_dtype: torch.dtype = torch.float32,
) -> CompressedOptimizer:
    r"""0/1 Adam: Adam with an adaptively frozen variance, 1-bit communication and local steps.

    Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam"
    (https://arxiv.org/abs/2202.06009); DeepSpeed 0.18.9's ``ZeroOneAdam``. No bias correction.
    Per leaf, at update :math:`t` with :math:`c = t + 1` and the host schedule
    (``ZeroOneAdamSchedule``), on every rank with its LOCAL gradient :math:`g_r`:

    .. math::
        \text{variance step}:&\quad g = \mathrm{mean}_r\, g_r,\ v \leftarrow \beta_2 v +
            (1-\beta_2) g^2,\ m \leftarrow \beta_1 m + (1-\beta_1) g \\
        \text{1-bit step}:&\quad m \leftarrow \beta_1 m + (1-\beta_1)\,
            \mathrm{CAR}(g_r) \odot \text{mask} \\
        \text{frozen (local) step}:&\quad m \leftarrow \beta_1 m + (1-\beta_1) g_r,\
            \ell \leftarrow \ell + \eta \\
        \text{all}:&\quad u = m / (\sqrt{v} + \epsilon) + \lambda p,\ p \leftarrow p - \eta u,
            \text{ and when frozen } a \leftarrow a - \eta u \\
        \text{sync step}:&\quad p \leftarrow p - a,\ a \leftarrow \mathrm{CAR}(a (\sqrt{v} +
            \epsilon)) \odot \text{mask},\ m \leftarrow -a / \ell,\
            p \leftarrow p + a / (\sqrt{v} + \epsilon),\ a \leftarrow 0,\ \ell \leftarrow 0

    CAR is ``fn.collectives.compressed_allreduce`` with the leaf's own errors (identity with one
    worker); the error buffers are zeroed after update ``max(var_freeze_step, 1)``, when the
    variance freezes (from then on they track the accumulator, not the gradient).

    ``warmup_update`` is the variance step (the only dense allreduce); ``compressed_update`` is
    every other update: the 1-bit steps before the freeze, then the local steps and syncs.

    The updates returned are ``p_new - p`` in fp32 (``-lr * u``; on a sync step
    ``-lr * u - a + CAR(...) / (sqrt(v) + eps)``), so ``fn.apply_updates`` reproduces the rule
    above up to fp32 rounding. Between syncs the ranks' params differ (local steps); a sync makes
    them equal again up to fp32 rounding (``p - a`` is the last synchronized point only up to
    rounding; DeepSpeed behaves the same).

    Args:
        lr: learning rate, or a schedule of the 0-dim int64 update count (see ``onebit_adam``);
            kept in the state as ``lr``.
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`.
        weight_decay: :math:`\lambda`, added to the update.
        var_freeze_step: the variance is frozen after update ``var_freeze_step``.
        var_update_scaler: variance refreshes per interval before ``var_interval`` doubles
            (the paper's kappa).
        local_step_scaler: frozen updates per local interval before it doubles.
        local_step_clipper: the largest local interval (the paper's H).
        comm: the ``fn.collectives`` Comm.
        exp_avg_mask: optional pytree like params of masks, applied after every compressed
            allreduce (of the gradient and of the accumulator); ``None`` leaves: no mask.
        safeguard, local_world_size, error_dtype: as ``fn.onebit_adam``'s (the safeguard: see
            below).

    Memory: unlike 1-bit Adam, 0/1 Adam keeps its momentum in fp32 throughout (its local steps
    move it with each rank's own gradient, so it is not the 1-bit allreduce's result that
    packed signs could hold), and its error buffers from ``init`` on (its 1-bit updates start
    among the first updates, between the variance refreshes).

    Returns:
        A ``CompressedOptimizer``; both updates are ``(grads, state, params=None, *, step=None,
        plan=None, **extra)`` with either ``step=t`` (a Python int) or ``plan=opt.plan(t)``, a
        ``ZeroOneAdamPlan`` (for ``torch.compile``; at most five distinct plans: variance,
        1-bit, local and sync steps, and the last unfrozen update, which resets the errors).
        ``params`` is needed when ``weight_decay > 0``. The schedule counters in the state
        advance with the plan's decisions (they equal ``counters(t + 1)`` after update ``t``).

    Raises:
        ValueError: naming the argument: negative ``lr`` (a number), ``eps`` or ``weight_decay``;
            betas outside [0, 1); a negative ``var_freeze_step`` or a scaler/clipper < 1; an
            ``error_dtype`` other than fp32, bf16 or fp16.
        NotImplementedError: ``var_freeze_step="auto"`` (see ``docs/algorithms.md``,
            "Automatic freeze and momentum mask", for why 0/1 Adam has none).

    Deviations from DeepSpeed, all deliberate: the schedule counters are global (DeepSpeed kept
    identical copies per param, and a param without a gradient skipped its own counter) and live
    in the state together with the errors and the accumulator, so a checkpoint continues bit for
    bit (DeepSpeed's ``load_state_dict`` dropped them and set an unused ``var_freeze_key`` instead
    of its ``freeze_key``); with one worker the 1-bit steps still update ``m`` with the local
    gradient (DeepSpeed skipped the momentum update there). A sync after local steps whose
    learning rates sum to zero sets ``m`` to zero instead of dividing by zero. There is no
    ``non_freeze`` option: DeepSpeed's 0/1 Adam had none.

    Safeguard (``safeguard=True``, a deliberate deviation from DeepSpeed; the failure and the
    bound :math:`B = (1-\beta_1) / \sqrt{(1-\beta_2)(1-\beta_1^2/\beta_2)}` on dense Adam's
    :math:`|m / \sqrt v|` are explained in ``onebit_adam``): every
    :math:`m / (\sqrt v + \epsilon)` is clipped to :math:`[-B, B]` (from the first 1-bit step
    on, :math:`m` carries compressed gradients, so the variance steps need it too) and the
    synchronized :math:`a / d` to :math:`[-\ell B, \ell B]`, since :math:`a` sums local steps
    of at most :math:`\eta B` each (measured in docs/algorithms.md, "Safeguard against
    near-zero frozen variance"). The freeze reports and a never-warmed-up state raises as in
    ``onebit_adam``.

    Policies: ``None`` gradient leaves get ``None`` updates and keep their state. Non-finite
    gradients raise ``ValueError`` with nothing updated: the variance step checks the averaged
    gradient, the 1-bit steps rely on the collective's check, local steps (no communication) check
    the local gradient, which on a real process group raises on the offending rank only.

    Buffer donation: both updates take the extra keyword ``donate`` (``None``, ``True`` or a
    state like ``state``). The 1-bit and local steps then write the new momentum, accumulator
    and errors into the donated state's buffers and the updates into the gradients' buffers
    (fp32, contiguous; ``grads`` are donated with the state) and return the variance as the
    same tensor, without full-size temporaries on several ranks and with the bits of the pure
    update; every check runs before the first write. Variance steps, sync steps and one
    worker's 1-bit steps stay pure (they allocate).

    The exact rules, step by step, are in docs/algorithms.md, "0/1 Adam".

    Example:
        One worker: the variance is refreshed at updates 1 and 2, then frozen (local steps).

        >>> import torch
        >>> import fn
        >>> from fn.collectives import Local
        >>> opt = fn.zero_one_adam(lr=1e-2, var_freeze_step=2, comm=Local())
        >>> params = {"w": torch.ones(3)}
        >>> state = opt.init(params)
        >>> for t in range(1, 6):
        ...     grads = {"w": torch.tensor([0.5, -1.0, 2.0])}
        ...     updates, state = opt.update(grads, state, params, step=t)
        ...     params = fn.apply_updates(params, updates)
        >>> [opt.plan(t).variance for t in range(1, 6)]
        [True, True, False, False, False]
        >>> bool(state.frozen), int(state.count)
        (True, 5)
    """
    name = "zero_one_adam"
    settings = leafwise.onebit_settings(
        name, lr, betas, eps, weight_decay, comm, safeguard, local_world_size, error_dtype
    )
    schedule = _schedule(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)

    def update(grads, state, params, plan, eta, donated=None):  # the settings in its closure
        return _update(settings, schedule, exp_avg_mask, grads, state, params, plan, eta, donated)

    return leafwise.compressed_optimizer(
        name,
        lr,
        ZeroOneAdamState,
        partial(_init_fields, settings, schedule),
        update,
        schedule.is_compressed,
        schedule.plan,
        ZeroOneAdamPlan,
        params_needed_for="weight_decay > 0" if weight_decay > 0 else None,
        warmup_phase="variance (warmup)",
    )._replace(
        param_agreement=schedule.param_agreement,
        check_state=partial(onebit_state.checked_state, name, settings),
        full_state=partial(onebit_state.full_state, settings, exp_avg_mask),
    )


def _schedule(
    var_freeze_step: Any, var_update_scaler: Any, local_step_scaler: Any, local_step_clipper: Any
) -> ZeroOneAdamSchedule:
    """The schedule of :func:`zero_one_adam`, its settings checked (ValueError naming one; no
    ``"auto"``: NotImplementedError)."""
    if isinstance(var_freeze_step, (str, AutoFreeze)):
        raise NotImplementedError(
            "zero_one_adam: var_freeze_step has no 'auto': the variance refreshes grow rare on "
            "their own (about 200 dense updates in 100000), so a late freeze costs little "
            "bandwidth, and when local steps become safe depends on the learning rate, not on "
            "the variance having settled; pass an int (docs/algorithms.md, 'Automatic freeze "
            "and momentum mask')"
        )
    return ZeroOneAdamSchedule(
        check_int("var_freeze_step", var_freeze_step),
        check_int("var_update_scaler", var_update_scaler, 1),
        check_int("local_step_scaler", local_step_scaler, 1),
        check_int("local_step_clipper", local_step_clipper, 1),
    )


def _update(h, schedule, exp_avg_mask, grads, state, params, plan, eta, donated=None):
    """An update of :func:`zero_one_adam`: the rule on every leaf (its fast step into the
    ``donated`` state, but on a sync); at the freeze, the report of the frozen variance and
    every leaf's errors reset; the schedule counters advanced."""
    lrs = state.lrs + eta if plan.frozen else state.lrs
    rule = partial(_rule, h, plan=plan, eta=eta, lrs=lrs)
    inputs = (params, exp_avg_mask)
    if donated is None or plan.sync:
        updates, state = leafwise.map_leaves("zero_one_adam", rule, grads, state, _Leaf, *inputs)
    else:
        leaves = leafwise.leaves_of("zero_one_adam", grads, state, _Leaf, *inputs, donated=donated)
        results = zero_one_adam_step(h, rule, leaves, plan.frozen, eta)
        updates, state = leafwise.rebuilt(leaves, results, state)
    if plan.reset_errors:  # every leaf's errors, gradient or not; the variance freezes
        leafwise.report_frozen_variance("zero_one_adam", state, h, mask=exp_avg_mask)
        state = state._replace(
            worker_error=tree_map(torch.zeros_like, state.worker_error),
            server_error=tree_map(torch.zeros_like, state.server_error),
        )
    return updates, _advanced(state, plan, lrs, schedule)


def _rule(h: leafwise.OnebitSettings, g, leaf, p, mask, *, plan, eta, lrs):
    """0/1 Adam's update of one leaf (the rules in ``zero_one_adam``'s docstring)."""
    m, v, a, ew, es = leaf
    if plan.variance:
        m, v = leafwise.dense_moments(g, m, v, h.b1, h.b2, h.comm)
    elif not plan.frozen:
        g, ew, es = _one_bit_mean(h, g, ew, es, mask, "the gradient")
        m = leafwise.moving_average(m, h.b1, g)
    else:
        m = leafwise.moving_average(m, h.b1, check_finite(g, "the local gradient"))
    denom = leafwise.adam_denominator(v, h.eps)
    direction = leafwise.adam_direction(m, denom, p, bound=h.clip, weight_decay=h.weight_decay)
    update = direction.mul_(-eta)
    if plan.frozen:
        a = a + update
    if plan.sync:
        update = update - a
        a, ew, es = _one_bit_mean(h, a * denom, ew, es, mask)
        m = torch.where(lrs != 0, -a / lrs, torch.zeros_like(a))
        averaged = a / denom
        if h.clip is not None and math.isfinite(h.clip):  # |a| <= lrs * bound: lrs-weighted
            averaged = torch.minimum(torch.maximum(averaged, -lrs * h.clip), lrs * h.clip)
        update = update + averaged
        a = torch.zeros_like(a)
    return update, _Leaf(m, v, a, ew, es)


def _one_bit_mean(h, x, ew, es, mask, local_check=None):
    x, ew, es = leafwise.compressed_mean(x, ew, es, h, local_check)
    return (x if mask is None else x * mask), ew, es


def _advanced(state, plan, lrs, schedule):
    """``state`` with the schedule counters and the sum of learning rates after the update
    ``plan`` (they equal ``schedule.counters(t + 1)`` after update ``t``)."""
    var = (state.var_interval, state.var_counter)
    if plan.variance:
        var = _advance(*var, schedule.var_update_scaler)
    local = (state.local_interval, state.local_counter)
    if plan.frozen:
        local = _advance(*local, schedule.local_step_scaler, schedule.local_step_clipper)
    return state._replace(
        var_interval=var[0],
        var_counter=var[1],
        local_interval=local[0],
        local_counter=local[1],
        lrs=torch.zeros_like(lrs) if plan.sync else lrs,
        frozen=torch.full_like(state.frozen, plan.frozen or plan.reset_errors),
    )


def _advance(interval, counter, scaler, clipper=None):
    """One more event of a doubling schedule, in tensor ops (no host value is read): after
    ``scaler`` events the interval doubles (capped at ``clipper``) and the counter restarts."""
    counter = counter + 1
    wraps = counter == scaler
    doubled = 2 * interval if clipper is None else (2 * interval).clamp(max=clipper)
    return torch.where(wraps, doubled, interval), torch.where(wraps, 0, counter)


def _init_fields(
    h: leafwise.OnebitSettings, schedule: ZeroOneAdamSchedule, params: PyTree
) -> dict[str, Any]:
    """The fields of the initial state after ``count`` and ``lr``; the counters of update 1."""
    worker_error, server_error = leafwise.init_error_feedback_per_leaf(params, h)
    return dict(
        exp_avg=tree_zeros_like(params, torch.float32),
        exp_avg_sq=tree_zeros_like(params, torch.float32),
        momentum_accumulator=tree_zeros_like(params, torch.float32),
        worker_error=worker_error,
        server_error=server_error,
        **{f: torch.tensor(x) for f, x in schedule.counters(1)._asdict().items()},
        lrs=torch.tensor(0.0, dtype=torch.float32),
    )
