"""1-bit Adam (Tang et al. 2021) as a pure state transition."""

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
from fn.transforms._onebit_schedules import FreezeSchedule, OnebitAdamPlan
from fn.tree import PyTree, tree_flatten, tree_map, tree_unflatten


class OnebitAdamState(NamedTuple):
    count: torch.Tensor  # [] int64: updates made so far
    lr: torch.Tensor  # [] fp32: the learning rate of the last update (or the one to use next)
    exp_avg: PyTree  # like params, fp32: the momentum m
    exp_avg_sq: PyTree  # like params, fp32: the variance v (frozen once compressed)
    worker_error: ErrorFeedbackField  # per leaf [N_leaf] fp32: e_w of the leaf's allreduce
    server_error: ErrorFeedbackField  # per leaf [N_leaf / W] fp32: e_s


def onebit_adam(
    lr: LearningRate = 1e-3,
    freeze_step: int = 100000,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    comm: Any,
    exp_avg_mask: PyTree | None = None,
    non_freeze: PyTree | None = None,
) -> CompressedOptimizer:
    r"""1-bit Adam: Adam whose momentum is communicated with 1 bit per element once the variance
    is frozen.

    Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed" (https://arxiv.org/abs/2102.02888); DeepSpeed 0.18.9's ``OnebitAdam``.
    No bias correction. At update :math:`t` (1-based), on every rank :math:`r` with its LOCAL
    gradient :math:`g_r`:

    .. math::
        \text{warmup } (t < F):&\quad g = \mathrm{mean}_r\, g_r,\ m \leftarrow \beta_1 m +
            (1-\beta_1) g,\ v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        \text{compressed } (t \ge F):&\quad m \leftarrow \mathrm{CAR}(\beta_1 m + (1-\beta_1)
            g_r) \odot \text{mask},\ v \text{ unchanged} \\
        \text{both}:&\quad u = m / (\sqrt{v} + \epsilon) + \lambda p,\quad
            p \leftarrow p - \eta\, u

    where CAR is ``fn.collectives.compressed_allreduce`` (error-compensated 1-bit allreduce with
    the leaf's own worker/server errors; each leaf is compressed on its own). With one worker
    there is nothing to compress and ``m`` stays the local momentum.

    The updates returned are ``-lr * u`` (so ``fn.apply_updates(params, updates)`` computes
    ``p - lr * u``, equal to the rule above up to fp32 rounding), in fp32.

    Args:
        lr: learning rate, or a schedule: a torch-traceable function of the 0-dim int64 count of
            updates made so far. Kept in the state as the 0-dim fp32 field ``lr``;
            ``fn.set_hyperparams(state, lr=...)`` changes a constant one (a schedule overwrites
            it at every update).
        freeze_step: the first compressed update is ``t == freeze_step`` (updates
            ``1 .. freeze_step - 1`` warm up); at least 2, since the compressed phase needs the
            variance that the warmup estimates (``ValueError`` otherwise; DeepSpeed warmed up
            its first real update whatever ``freeze_step`` was).
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`, added to :math:`\sqrt{v}`.
        weight_decay: :math:`\lambda`, added to the update (L2, as DeepSpeed; not decoupled).
        comm: the ``fn.collectives`` Comm (``Local()``, ``Simulated(W)``, ``ProcessGroup()``).
        exp_avg_mask: optional pytree like params; a tensor leaf (broadcastable to the param) is
            multiplied into the momentum after every compressed allreduce, to keep momentum that
            should be exactly zero (e.g. unused embedding rows) from collecting compression error.
            ``None`` leaves (or ``None``) mean no mask.
        non_freeze: optional pytree like params of bools, DeepSpeed's ``non_freeze`` parameter
            groups: a ``True`` leaf is never compressed; it keeps the warmup rule (dense
            allreduce, ``m`` and ``v`` updated) in the compressed phase too.

    Returns:
        A ``CompressedOptimizer(init, warmup_update, compressed_update, is_compressed, plan)``;
        both updates are ``(grads, state, params=None, *, step=None, plan=None, **extra) ->
        (updates, state)`` with either ``step``, the 1-based update count (a Python int), or
        ``plan=opt.plan(step)``, an ``OnebitAdamPlan`` (for ``torch.compile``: two plans, warmup
        and compressed, so two graphs). ``params`` is needed when ``weight_decay > 0``.

    Raises:
        ValueError: naming the argument: negative ``lr`` (a number), ``eps`` or ``weight_decay``;
            betas outside [0, 1); ``freeze_step < 2``.

    Policies: a ``None`` gradient leaf (a frozen param) gets a ``None`` update and its state is
    untouched. Non-finite gradients raise ``ValueError`` and nothing is updated: the warmup update
    checks the averaged gradient (so every rank raises together), the compressed update relies on
    the collective's check (and checks the local gradient itself with one worker). Unlike
    DeepSpeed, the error buffers are part of the state: a checkpoint continues bit for bit; they
    must be reset when the world size changes.
    """
    b1, b2 = check_betas(betas)
    check_nonnegative("onebit_adam", eps=eps, weight_decay=weight_decay)
    if not callable(lr):
        check_nonnegative("onebit_adam", lr=lr)
    why = (
        "the compressed updates divide by sqrt(v) + eps with the variance v frozen, which at "
        "least one warmup update (t < freeze_step) must estimate"
    )
    schedule = FreezeSchedule(check_nonnegative_int("freeze_step", freeze_step, 2, why))
    plan_for = schedule.onebit_adam_plan
    world = comm.world_size

    def init_fn(params: Params) -> OnebitAdamState:
        def errors(p):
            return collectives.init_error_feedback(p.numel(), comm=comm, device=p.device)

        pairs = tree_map(errors, params)
        spec = tree_flatten(params)[1]
        pair_leaves = spec.flatten_up_to(pairs)
        return OnebitAdamState(
            count=torch.zeros((), dtype=torch.int64),
            lr=init_lr(lr),
            exp_avg=tree_map(lambda p: torch.zeros_like(p, dtype=torch.float32), params),
            exp_avg_sq=tree_map(lambda p: torch.zeros_like(p, dtype=torch.float32), params),
            worker_error=tree_unflatten([None if e is None else e[0] for e in pair_leaves], spec),
            server_error=tree_unflatten([None if e is None else e[1] for e in pair_leaves], spec),
        )

    def make_update(compressed: bool):
        def update_fn(
            grads: Updates,
            state: OnebitAdamState,
            params: Params | None = None,
            *,
            step: int | None = None,
            plan: OnebitAdamPlan | None = None,
            **extra: Any,
        ) -> tuple[Updates, OnebitAdamState]:
            del extra
            phase = "compressed" if compressed else "warmup"
            resolve_plan(step, plan, plan_for, OnebitAdamPlan, compressed, phase)
            if weight_decay > 0:
                require_params(params, "weight_decay > 0")
            spec = tree_flatten(state.exp_avg)[1]
            g_leaves = spec.flatten_up_to(grads)
            m_leaves = spec.flatten_up_to(state.exp_avg)
            v_leaves = spec.flatten_up_to(state.exp_avg_sq)
            ew_leaves = spec.flatten_up_to(state.worker_error)
            es_leaves = spec.flatten_up_to(state.server_error)
            p_leaves = leaves_or_nones(params, spec)
            mask_leaves = leaves_or_nones(exp_avg_mask, spec)
            dense_leaves = leaves_or_nones(non_freeze, spec)
            eta = learning_rate_now(lr, state.count, state.lr)

            out = {k: [] for k in ("u", "m", "v", "ew", "es")}
            for i, g in enumerate(g_leaves):
                m, v, ew, es = m_leaves[i], v_leaves[i], ew_leaves[i], es_leaves[i]
                if g is None:
                    for k, x in zip(("u", "m", "v", "ew", "es"), (None, m, v, ew, es), strict=True):
                        out[k].append(x)
                    continue
                g = check_shape(g, m, i)
                if not compressed or bool(dense_leaves[i]):
                    g = check_finite(comm.all_reduce(g, op="mean"), "the averaged gradient")
                    m = moving_average(m, b1, g)
                    v = moving_average_of_squares(v, b2, g)
                else:
                    # In-place ops only on fresh temporaries: the same rounding, fewer full-size
                    # allocations on the hot path of the compressed phase.
                    m = (b1 * m).add_((1 - b1) * g)
                    if world > 1 and m.numel() > 0:
                        m, ew, es = collectives.compressed_allreduce(m, ew, es, comm=comm)
                    elif world == 1:
                        m = check_finite(m, "the momentum (local gradient)")
                    if mask_leaves[i] is not None:
                        m = m * mask_leaves[i]
                u = m / v.sqrt().add_(eps)
                if weight_decay > 0:
                    u = u.add_(weight_decay * p_leaves[i].float())
                for k, x in zip(
                    ("u", "m", "v", "ew", "es"), (u.mul_(-eta), m, v, ew, es), strict=True
                ):
                    out[k].append(x)

            new_state = OnebitAdamState(
                count=state.count + 1,
                lr=eta,
                exp_avg=tree_unflatten(out["m"], spec),
                exp_avg_sq=tree_unflatten(out["v"], spec),
                worker_error=tree_unflatten(out["ew"], spec),
                server_error=tree_unflatten(out["es"], spec),
            )
            return tree_unflatten(out["u"], spec), new_state

        return update_fn

    return CompressedOptimizer(
        init_fn, make_update(False), make_update(True), schedule.is_compressed, plan_for
    )
