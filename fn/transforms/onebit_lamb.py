"""1-bit LAMB (Li et al. 2022) as a pure state transition."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fn import collectives
from fn.base import CompressedOptimizer, Params, Updates
from fn.collectives import ErrorFeedbackField
from fn.transforms._learning_rate import learning_rate_now
from fn.transforms._leaves import check_fraction, check_nonnegative, check_ordered
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
from fn.transforms._onebit_schedules import FreezeSchedule, OnebitLambPlan
from fn.tree import PyTree, tree_flatten, tree_leaves, tree_map, tree_unflatten

_LEAF_FIELDS = (
    "exp_avg",
    "exp_avg_sq",
    "exp_avg_sq_fresh",
    "lamb_coeff_freeze",
    "last_factor",
    "scaling_coeff",
)


class OnebitLambState(NamedTuple):
    count: torch.Tensor  # [] int64: updates made so far
    lr: torch.Tensor  # [] fp32: the learning rate of the last update (or the one to use next)
    exp_avg: PyTree  # like params, fp32: the momentum m
    exp_avg_sq: PyTree  # like params, fp32: the variance v (frozen once compressed)
    exp_avg_sq_fresh: PyTree  # like params, fp32: the fresh variance tracked while compressed
    lamb_coeff_freeze: PyTree  # per leaf [] fp32: R, the EMA of the warmup trust ratios
    last_factor: PyTree  # per leaf [] fp32: the last scaling factor of R (starts at 1)
    scaling_coeff: PyTree  # per leaf [] fp32: momentum scaling, set at the first compressed update
    worker_error: ErrorFeedbackField  # [N] fp32: e_w of the one fused compressed allreduce
    server_error: ErrorFeedbackField  # [N / W] fp32: e_s


def onebit_lamb(
    lr: LearningRate = 1e-3,
    freeze_step: int = 100000,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    *,
    comm: Any,
    exp_avg_mask: PyTree | None = None,
) -> CompressedOptimizer:
    r"""1-bit LAMB: LAMB whose momenta are communicated with 1 bit per element after a warmup,
    with the layerwise trust ratios frozen and rescaled by a fresh variance estimate.

    Li et al. 2022, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with
    LAMB's Convergence Speed" (https://arxiv.org/abs/2104.06069); DeepSpeed 0.18.9's
    ``OnebitLamb``. No bias correction. Per leaf, at update :math:`t` with :math:`c = t + 1`:

    Warmup (:math:`t < F`), with :math:`g = \mathrm{mean}_r\, g_r`:

    .. math::
        m \leftarrow \beta_1 m + (1-\beta_1) g,\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,
        \quad \tilde v \leftarrow v \text{ if } c = F \\
        u = m / (\sqrt v + \epsilon) + \lambda p,\quad
        \rho = \mathrm{clip}(\lVert p\rVert / \lVert u\rVert \text{ (1 if a norm is 0)},
            c_{min}, c_{max}) \\
        R \leftarrow \beta_c R + (1-\beta_c) \rho \text{ if } \rho \ne 1,\quad
        p \leftarrow p - \eta \rho u

    Compressed (:math:`t \ge F`), with the LOCAL gradient :math:`g_r`: at the first compressed
    update the scaling coefficients :math:`s_\ell = \bar s / s_\ell^{rms}` are fixed
    (:math:`s^{rms}_\ell = \lVert m_\ell\rVert / \sqrt{n_\ell}`, :math:`\bar s` their mean over
    leaves); then

    .. math::
        m_\ell \leftarrow \mathrm{CAR}\big(\mathrm{concat}_\ell\, s_\ell (\beta_1 m_\ell +
            (1-\beta_1) g_{r,\ell})\big)_\ell / s_\ell \odot \text{mask},\quad
        \hat g = (m - \beta_1 m_{last}) / (1 - \beta_1),\quad
        \tilde v \leftarrow \beta_2 \tilde v + (1-\beta_2) \hat g^2 \\
        d = \sqrt v + \epsilon,\ u_0 = m / d,\ u = u_0 + \lambda p,\
        f = \max_i d_i / (\sqrt{\tilde v_i} + \epsilon) \\
        \text{if } \lambda > 0:\ q = \min(1, \lVert u_0\rVert / \lVert u\rVert),\
            f \leftarrow f q + 1 - q \\
        f \leftarrow \mathrm{clip}(\mathrm{clip}(f, f_{min}, f_{max}), f_{last}(1 - \tau),
            f_{last}(1 + \tau)),\quad f_{last} \leftarrow f,\quad
        p \leftarrow p - \eta R f u

    All momenta are fused, in pytree leaf order, into one buffer and compressed by one
    ``fn.collectives.compressed_allreduce`` (CAR; one worker/server error pair; identity with one
    worker), whose padding is zero at every call. DeepSpeed 0.18.9 left the previous call's
    output in the padding from the second compressed call on; that is a bug and fn zero-pads, so
    fn matches DeepSpeed exactly only when the fused size needs no padding.

    The updates returned are ``-lr * rho * u`` (warmup) and ``-lr * R * f * u`` (compressed) in
    fp32, so ``fn.apply_updates`` reproduces the rule above up to fp32 rounding.

    Args:
        lr: learning rate, or a schedule of the 0-dim int64 update count (see ``onebit_adam``);
            kept in the state as ``lr``.
        freeze_step: the first compressed update is ``t == freeze_step``; at least 2, since the
            compressed phase needs the variance and trust ratio that the warmup estimates
            (``ValueError`` otherwise).
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`.
        weight_decay: :math:`\lambda`, added to the update.
        max_coeff, min_coeff: the bounds of the warmup trust ratio :math:`\rho`.
        coeff_beta: :math:`\beta_c`, the EMA coefficient of the frozen trust ratio :math:`R`.
        factor_max, factor_min: the bounds of the factor :math:`f`.
        factor_threshold: :math:`\tau`, the largest relative change of :math:`f` per update.
        comm: the ``fn.collectives`` Comm.
        exp_avg_mask: optional pytree like params of masks multiplied into the momentum after
            every compressed allreduce; ``None`` leaves: no mask.

    Returns:
        A ``CompressedOptimizer``; both updates are ``(grads, state, params, *, step=None,
        plan=None, **extra)`` with either ``step=t`` (a Python int) or ``plan=opt.plan(t)``, a
        ``OnebitLambPlan`` (for ``torch.compile``: four distinct plans, warmup, the last warmup
        update that copies the variance, the first compressed update that fixes the scaling
        coefficients, and compressed). ``params`` is required (trust ratios).

    Raises:
        ValueError: naming the argument: negative ``lr`` (a number), ``eps``, ``weight_decay``,
            ``min_coeff``, ``factor_min`` or ``factor_threshold``; ``min_coeff > max_coeff``,
            ``factor_min > factor_max``; betas or ``coeff_beta`` outside [0, 1);
            ``freeze_step < 2``.

    Further deliberate deviations from DeepSpeed: a leaf whose momentum is zero at the first
    compressed update gets the scaling coefficient 1 (DeepSpeed divided by zero), and empty leaves
    take no part in the scaling mean; ``freeze_step <= 1`` is rejected (DeepSpeed accepted it and
    warmed up its first real update anyway). DeepSpeed's 1-bit LAMB had no ``non_freeze`` groups
    and neither does this one.

    Policies: a ``None`` gradient leaf gets a ``None`` update and keeps its state (its slice of
    the fused buffer is zero); every rank must have ``None`` at the same leaves. Non-finite
    gradients raise ``ValueError`` with nothing updated (warmup: checked on the averaged gradient;
    compressed: the collective's check, or a local check with one worker).
    """
    b1, b2 = check_betas(betas)
    check_nonnegative(
        "onebit_lamb",
        eps=eps,
        weight_decay=weight_decay,
        min_coeff=min_coeff,
        factor_min=factor_min,
        factor_threshold=factor_threshold,
    )
    if not callable(lr):
        check_nonnegative("onebit_lamb", lr=lr)
    check_ordered("onebit_lamb", min_coeff=min_coeff, max_coeff=max_coeff)
    check_ordered("onebit_lamb", factor_min=factor_min, factor_max=factor_max)
    check_fraction("onebit_lamb", coeff_beta=coeff_beta)
    why = (
        "the compressed updates divide by sqrt(v) + eps and scale by the trust ratio R, both "
        "frozen, which at least one warmup update (t < freeze_step) must estimate"
    )
    schedule = FreezeSchedule(check_nonnegative_int("freeze_step", freeze_step, 2, why))
    plan_for = schedule.onebit_lamb_plan
    world = comm.world_size

    def init_fn(params: Params) -> OnebitLambState:
        leaves = tree_leaves(params)
        numel = sum(p.numel() for p in leaves)
        device = leaves[0].device if leaves else None
        worker_error, server_error = collectives.init_error_feedback(
            numel, comm=comm, device=device
        )

        def zeros(p):
            return torch.zeros_like(p, dtype=torch.float32)

        def scalar(value):
            return lambda p: torch.tensor(value, dtype=torch.float32, device=p.device)

        return OnebitLambState(
            count=torch.zeros((), dtype=torch.int64),
            lr=init_lr(lr),
            exp_avg=tree_map(zeros, params),
            exp_avg_sq=tree_map(zeros, params),
            exp_avg_sq_fresh=tree_map(zeros, params),
            lamb_coeff_freeze=tree_map(scalar(0.0), params),
            last_factor=tree_map(scalar(1.0), params),
            scaling_coeff=tree_map(scalar(1.0), params),
            worker_error=worker_error,
            server_error=server_error,
        )

    def trust_ratio_update(p, u, r):
        """The clipped warmup trust ratio and the new R (DeepSpeed's ``lamb_coeff``); the
        fallback 1 for a zero norm is clipped too."""
        p_norm = torch.linalg.vector_norm(p)
        u_norm = torch.linalg.vector_norm(u)
        ratio = torch.where((p_norm != 0) & (u_norm != 0), p_norm / u_norm, torch.ones_like(p_norm))
        ratio = ratio.clamp(min=min_coeff, max=max_coeff)
        r = torch.where(ratio != 1, coeff_beta * r + (1 - coeff_beta) * ratio, r)
        return ratio, r

    def factor(d, v_fresh, u0, u, last):
        """The factor f that rescales the frozen trust ratio (clipped, then rate-limited)."""
        f = (d / (v_fresh.sqrt() + eps)).amax()
        if weight_decay > 0:
            u_norm = torch.linalg.vector_norm(u)
            q = (torch.linalg.vector_norm(u0) / u_norm).clamp(max=1.0)
            q = torch.where(u_norm != 0, q, torch.ones_like(q))
            f = f * q + (1 - q)
        f = f.clamp(max=factor_max).clamp(min=factor_min)
        f = torch.minimum(f, last * (1 + factor_threshold))
        return torch.maximum(f, last * (1 - factor_threshold))

    def scaling_coefficients(m_leaves):
        """Per leaf ``mean_l(rms(m_l)) / rms(m_l)``, over the non-empty leaves."""
        rms = {
            i: torch.linalg.vector_norm(m) / m.numel() ** 0.5
            for i, m in enumerate(m_leaves)
            if m is not None and m.numel() > 0
        }
        if not rms:
            return {}
        mean = torch.stack(list(rms.values())).mean()
        return {i: torch.where(s > 0, mean / s, torch.ones_like(s)) for i, s in rms.items()}

    def warmup_update(grads, state, params, plan):
        spec = tree_flatten(state.exp_avg)[1]
        g_leaves = spec.flatten_up_to(grads)
        old = {k: spec.flatten_up_to(getattr(state, k)) for k in _LEAF_FIELDS}
        p_leaves = spec.flatten_up_to(params)
        eta = learning_rate_now(lr, state.count, state.lr)
        updates, new = [], {k: list(v) for k, v in old.items()}
        for i, g in enumerate(g_leaves):
            if g is None:
                updates.append(None)
                continue
            m, v, v_fresh, r = (old[k][i] for k in _LEAF_FIELDS[:4])
            g = check_shape(g, m, i)
            g = check_finite(comm.all_reduce(g, op="mean"), "the averaged gradient")
            m = moving_average(m, b1, g)
            v = moving_average_of_squares(v, b2, g)
            if plan.copies_variance:
                v_fresh = v
            u = m / (v.sqrt() + eps)
            if weight_decay > 0:
                u = u + weight_decay * p_leaves[i].float()
            if m.numel() > 0:
                ratio, r = trust_ratio_update(p_leaves[i].float(), u, r)
                u = -(eta * ratio) * u
            updates.append(u)
            for k, x in zip(_LEAF_FIELDS[:4], (m, v, v_fresh, r), strict=True):
                new[k][i] = x
        fields = {k: tree_unflatten(v, spec) for k, v in new.items()}
        new_state = state._replace(count=state.count + 1, lr=eta, **fields)
        return tree_unflatten(updates, spec), new_state

    def compressed_update(grads, state, params, plan):
        spec = tree_flatten(state.exp_avg)[1]
        g_leaves = spec.flatten_up_to(grads)
        old = {k: spec.flatten_up_to(getattr(state, k)) for k in _LEAF_FIELDS}
        p_leaves = spec.flatten_up_to(params)
        mask_leaves = leaves_or_nones(exp_avg_mask, spec)
        eta = learning_rate_now(lr, state.count, state.lr)
        new = {k: list(v) for k, v in old.items()}
        if plan.sets_scaling:
            for i, s in scaling_coefficients(old["exp_avg"]).items():
                new["scaling_coeff"][i] = s
        scaling = new["scaling_coeff"]

        pieces = []
        for i, m in enumerate(old["exp_avg"]):
            if m is None:
                continue
            g = g_leaves[i]
            if g is None:
                pieces.append(torch.zeros(m.numel(), dtype=m.dtype, device=m.device))
            else:
                g = check_shape(g, m, i)
                pieces.append(((b1 * m + (1 - b1) * g) * scaling[i]).reshape(-1))
        flat = torch.cat(pieces) if pieces else torch.zeros(0)
        ew, es = state.worker_error, state.server_error
        if world > 1 and flat.numel() > 0:
            flat, ew, es = collectives.compressed_allreduce(flat, ew, es, comm=comm)
        elif world == 1:
            flat = check_finite(flat, "the momentum (local gradient)")

        updates, offset = [], 0
        for i, m_last in enumerate(old["exp_avg"]):
            g = g_leaves[i]
            n = 0 if m_last is None else m_last.numel()
            piece, offset = flat[offset : offset + n], offset + n
            if g is None:
                updates.append(None)
                continue
            if n == 0:
                updates.append(torch.zeros_like(m_last))
                continue
            m = piece.view_as(m_last) / scaling[i]
            if mask_leaves[i] is not None:
                m = m * mask_leaves[i]
            g_hat = (m - b1 * m_last) / (1 - b1)
            v_fresh = b2 * old["exp_avg_sq_fresh"][i] + (1 - b2) * g_hat * g_hat
            d = old["exp_avg_sq"][i].sqrt() + eps
            u0 = m / d
            u = u0 + weight_decay * p_leaves[i].float() if weight_decay > 0 else u0
            f = factor(d, v_fresh, u0, u, old["last_factor"][i])
            updates.append(-(eta * (old["lamb_coeff_freeze"][i] * f)) * u)
            new["exp_avg"][i], new["exp_avg_sq_fresh"][i], new["last_factor"][i] = m, v_fresh, f

        fields = {k: tree_unflatten(v, spec) for k, v in new.items()}
        new_state = state._replace(
            count=state.count + 1, lr=eta, worker_error=ew, server_error=es, **fields
        )
        return tree_unflatten(updates, spec), new_state

    def make_update(compressed: bool):
        rule = compressed_update if compressed else warmup_update

        def update_fn(
            grads: Updates,
            state: OnebitLambState,
            params: Params | None = None,
            *,
            step: int | None = None,
            plan: OnebitLambPlan | None = None,
            **extra: Any,
        ) -> tuple[Updates, OnebitLambState]:
            del extra
            phase = "compressed" if compressed else "warmup"
            plan = resolve_plan(step, plan, plan_for, OnebitLambPlan, compressed, phase)
            require_params(params, "1-bit LAMB (trust ratios)")
            return rule(grads, state, params, plan)

        return update_fn

    return CompressedOptimizer(
        init_fn, make_update(False), make_update(True), schedule.is_compressed, plan_for
    )
