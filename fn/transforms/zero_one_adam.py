"""0/1 Adam (Lu et al. 2022) as a pure state transition."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fn import collectives
from fn.base import CompressedOptimizer, Params, Updates
from fn.collectives import ErrorFeedbackField
from fn.transforms._learning_rate import learning_rate_now
from fn.transforms._leaves import check_nonnegative
from fn.transforms._onebit_common import (
    LearningRate,
    check_betas,
    check_finite,
    check_nonnegative_int,
    check_shape,
    init_lr,
    leaves_or_nones,
    moving_average,
    moving_average_of_squares,
    require_params,
    resolve_plan,
)
from fn.transforms._onebit_schedules import ZeroOneAdamPlan, ZeroOneAdamSchedule
from fn.tree import PyTree, tree_flatten, tree_map, tree_unflatten

_LEAF_FIELDS = ("exp_avg", "exp_avg_sq", "momentum_accumulator", "worker_error", "server_error")


class ZeroOneAdamState(NamedTuple):
    count: torch.Tensor  # [] int64: updates made so far
    lr: torch.Tensor  # [] fp32: the learning rate of the last update (or the one to use next)
    exp_avg: PyTree  # like params, fp32: the momentum m
    exp_avg_sq: PyTree  # like params, fp32: the variance v
    momentum_accumulator: PyTree  # like params, fp32: a, the sum of local updates since a sync
    worker_error: ErrorFeedbackField  # per leaf [N_leaf] fp32: e_w of the leaf's allreduce
    server_error: ErrorFeedbackField  # per leaf [N_leaf / W] fp32: e_s
    var_interval: torch.Tensor  # [] int64: equals ZeroOneAdamSchedule.counters(count + 1)
    var_counter: torch.Tensor  # [] int64
    local_interval: torch.Tensor  # [] int64
    local_counter: torch.Tensor  # [] int64
    lrs: torch.Tensor  # [] fp32: sum of the learning rates of the local steps since a sync
    frozen: torch.Tensor  # [] bool: the variance is frozen (local steps and syncs)


def zero_one_adam(
    lr: LearningRate = 1e-3,
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

    Returns:
        A ``CompressedOptimizer``; both updates are ``(grads, state, params=None, *, step=None,
        plan=None, **extra)`` with either ``step=t`` (a Python int) or ``plan=opt.plan(t)``, a
        ``ZeroOneAdamPlan`` (for ``torch.compile``; at most five distinct plans: variance,
        1-bit, local and sync steps, and the last unfrozen update, which resets the errors).
        ``params`` is needed when ``weight_decay > 0``. The schedule counters in the state
        advance with the plan's decisions (they equal ``counters(t + 1)`` after update ``t``).

    Raises:
        ValueError: naming the argument: negative ``lr`` (a number), ``eps`` or ``weight_decay``;
            betas outside [0, 1); a negative ``var_freeze_step`` or a scaler/clipper < 1.

    Deviations from DeepSpeed, all deliberate: the schedule counters are global (DeepSpeed kept
    identical copies per param, and a param without a gradient skipped its own counter) and live
    in the state together with the errors and the accumulator, so a checkpoint continues bit for
    bit (DeepSpeed's ``load_state_dict`` dropped them and set an unused ``var_freeze_key`` instead
    of its ``freeze_key``); with one worker the 1-bit steps still update ``m`` with the local
    gradient (DeepSpeed skipped the momentum update there). A sync after local steps whose
    learning rates sum to zero sets ``m`` to zero instead of dividing by zero. There is no
    ``non_freeze`` option: DeepSpeed's 0/1 Adam had none.

    Policies: ``None`` gradient leaves get ``None`` updates and keep their state. Non-finite
    gradients raise ``ValueError`` with nothing updated: the variance step checks the averaged
    gradient, the 1-bit steps rely on the collective's check, local steps (no communication) check
    the local gradient, which on a real process group raises on the offending rank only.
    """
    b1, b2 = check_betas(betas)
    check_nonnegative("zero_one_adam", eps=eps, weight_decay=weight_decay)
    if not callable(lr):
        check_nonnegative("zero_one_adam", lr=lr)
    schedule = ZeroOneAdamSchedule(
        check_nonnegative_int("var_freeze_step", var_freeze_step),
        check_nonnegative_int("var_update_scaler", var_update_scaler, 1),
        check_nonnegative_int("local_step_scaler", local_step_scaler, 1),
        check_nonnegative_int("local_step_clipper", local_step_clipper, 1),
    )
    world = comm.world_size

    def car(x, ew, es, mask):
        if world > 1 and x.numel() > 0:
            x, ew, es = collectives.compressed_allreduce(x, ew, es, comm=comm)
        if mask is not None:
            x = x * mask
        return x, ew, es

    def advance(interval, counter, scaler, clipper=None):
        """One more event of a doubling schedule, in tensor ops (no host value is read): after
        ``scaler`` events the interval doubles (capped at ``clipper``) and the counter restarts."""
        counter = counter + 1
        wraps = counter == scaler
        doubled = 2 * interval if clipper is None else (2 * interval).clamp(max=clipper)
        return torch.where(wraps, doubled, interval), torch.where(wraps, 0, counter)

    def init_fn(params: Params) -> ZeroOneAdamState:
        def errors(p):
            return collectives.init_error_feedback(p.numel(), comm=comm, device=p.device)

        spec = tree_flatten(params)[1]
        pair_leaves = spec.flatten_up_to(tree_map(errors, params))
        counters = schedule.counters(1)

        def scalar(value, dtype=torch.int64):
            return torch.tensor(value, dtype=dtype)

        return ZeroOneAdamState(
            count=scalar(0),
            lr=init_lr(lr),
            exp_avg=tree_map(lambda p: torch.zeros_like(p, dtype=torch.float32), params),
            exp_avg_sq=tree_map(lambda p: torch.zeros_like(p, dtype=torch.float32), params),
            momentum_accumulator=tree_map(
                lambda p: torch.zeros_like(p, dtype=torch.float32), params
            ),
            worker_error=tree_unflatten([None if e is None else e[0] for e in pair_leaves], spec),
            server_error=tree_unflatten([None if e is None else e[1] for e in pair_leaves], spec),
            var_interval=scalar(counters.var_interval),
            var_counter=scalar(counters.var_counter),
            local_interval=scalar(counters.local_interval),
            local_counter=scalar(counters.local_counter),
            lrs=scalar(0.0, torch.float32),
            frozen=scalar(counters.frozen, torch.bool),
        )

    def make_update(compressed: bool):
        def update_fn(
            grads: Updates,
            state: ZeroOneAdamState,
            params: Params | None = None,
            *,
            step: int | None = None,
            plan: ZeroOneAdamPlan | None = None,
            **extra: Any,
        ) -> tuple[Updates, ZeroOneAdamState]:
            del extra
            kind = "compressed" if compressed else "variance (warmup)"
            plan = resolve_plan(step, plan, schedule.plan, ZeroOneAdamPlan, compressed, kind)
            if weight_decay > 0:
                require_params(params, "weight_decay > 0")
            frozen, sync, reset = plan.frozen, plan.sync, plan.reset_errors
            spec = tree_flatten(state.exp_avg)[1]
            g_leaves = spec.flatten_up_to(grads)
            old = {k: spec.flatten_up_to(getattr(state, k)) for k in _LEAF_FIELDS}
            p_leaves = leaves_or_nones(params, spec)
            mask_leaves = leaves_or_nones(exp_avg_mask, spec)
            eta = learning_rate_now(lr, state.count, state.lr)
            lrs = state.lrs + eta if frozen else state.lrs

            updates, new = [], {k: [] for k in _LEAF_FIELDS}
            for i, g in enumerate(g_leaves):
                m, v, a, ew, es = (old[k][i] for k in _LEAF_FIELDS)
                if g is None:
                    if reset:  # every leaf's errors, gradient or not
                        ew, es = torch.zeros_like(ew), torch.zeros_like(es)
                    updates.append(None)
                    for k, x in zip(_LEAF_FIELDS, (m, v, a, ew, es), strict=True):
                        new[k].append(x)
                    continue
                g = check_shape(g, m, i)
                if not compressed:
                    g = check_finite(comm.all_reduce(g, op="mean"), "the averaged gradient")
                    v = moving_average_of_squares(v, b2, g)
                    m = moving_average(m, b1, g)
                elif not frozen:
                    if world == 1:
                        g = check_finite(g, "the gradient")
                    g, ew, es = car(g, ew, es, mask_leaves[i])
                    m = b1 * m + (1 - b1) * g
                else:
                    m = b1 * m + (1 - b1) * check_finite(g, "the local gradient")
                denom = v.sqrt() + eps
                u = m / denom
                if weight_decay > 0:
                    u = u + weight_decay * p_leaves[i].float()
                upd = -eta * u
                if frozen:
                    a = a + upd
                if sync:
                    upd = upd - a
                    a, ew, es = car(a * denom, ew, es, mask_leaves[i])
                    m = torch.where(lrs != 0, -a / lrs, torch.zeros_like(a))
                    upd = upd + a / denom
                    a = torch.zeros_like(a)
                if reset:
                    ew, es = torch.zeros_like(ew), torch.zeros_like(es)
                updates.append(upd)
                for k, x in zip(_LEAF_FIELDS, (m, v, a, ew, es), strict=True):
                    new[k].append(x)

            var = (state.var_interval, state.var_counter)
            if plan.variance:
                var = advance(*var, var_update_scaler)
            local = (state.local_interval, state.local_counter)
            if frozen:
                local = advance(*local, local_step_scaler, local_step_clipper)
            new_state = ZeroOneAdamState(
                count=state.count + 1,
                lr=eta,
                **{k: tree_unflatten(new[k], spec) for k in _LEAF_FIELDS},
                var_interval=var[0],
                var_counter=var[1],
                local_interval=local[0],
                local_counter=local[1],
                lrs=torch.zeros_like(lrs) if sync else lrs,
                frozen=torch.full_like(state.frozen, frozen or reset),
            )
            return tree_unflatten(updates, spec), new_state

        return update_fn

    return CompressedOptimizer(
        init_fn, make_update(False), make_update(True), schedule.is_compressed, schedule.plan
    )
