"""1-bit LAMB (Li et al. 2022) as a pure state transition."""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import torch

from fn.base import CompressedOptimizer, SecondMomentField
from fn.collectives import ErrorFeedbackField, Local, PackedSigns
from fn.errors import check_fraction, check_nonnegative, check_ordered
from fn.transforms import _leafwise as leafwise
from fn.transforms import _onebit_auto as onebit_auto
from fn.transforms import _onebit_state as onebit_state
from fn.transforms._onebit_auto import AutoState
from fn.transforms._onebit_schedules import AutoFreeze, OnebitLambPlan, freeze_schedule
from fn.transforms.trust_ratio import trust_ratio_of_norms
from fn.tree import LiveLeaves, PyTree, fitting, live_leaves, tree_leaves, tree_map, tree_zeros_like


class OnebitLambState(NamedTuple):
    """The state of :func:`onebit_lamb` (``N`` the padded size of all leaves together, ``W``
    ranks, ``L`` ranks per node).

    Attributes:
        count: ``[]`` int64 tensor, the number of updates made so far.
        lr: ``[]`` fp32 tensor, the learning rate of the last update (or the one to use next).
        exp_avg: like params, fp32: the momentum :math:`m`; once compressed, the one
            ``fn.collectives.PackedSigns`` of the fused allreduce's result (``m_l`` = its slice
            of leaf ``l`` / ``scaling_coeff_l`` * ``exp_avg_mask_l``).
        exp_avg_sq: like params, fp32: the variance :math:`v` (frozen once compressed).
        exp_avg_sq_fresh: like params, fp32: the variance tracked while compressed; ``None``
            until the last warmup update.
        lamb_coeff_freeze: per leaf, ``[]`` fp32: :math:`R`, the EMA of the warmup trust ratios.
        last_factor: per leaf, ``[]`` fp32: the last scaling factor of :math:`R` (starts at 1).
        scaling_coeff: per leaf, ``[]`` fp32: the momentum scaling, set at the first compressed
            update.
        worker_error: ``[N / L]`` (``L = 1`` flat) in ``error_dtype``: the worker error
            :math:`e_w` of the fused allreduce; ``None`` until it first runs.
        server_error: ``[N / W]`` in ``error_dtype``: the server error :math:`e_s`; ``None``
            until the fused allreduce first runs.
        auto: the :class:`AutoState` that ``freeze_step="auto"`` and ``exp_avg_mask="auto"``
            decide from; ``None`` without them.

    Example:
        >>> opt = fn.onebit_lamb(lr=1e-3, freeze_step=2, comm=fn.collectives.Local())
        >>> state = opt.init({"w": torch.zeros(2)})
        >>> state.lamb_coeff_freeze, state.scaling_coeff, state.worker_error
        ({'w': tensor(0.)}, {'w': tensor(1.)}, None)
    """

    count: torch.Tensor
    lr: torch.Tensor
    exp_avg: PyTree
    exp_avg_sq: SecondMomentField
    exp_avg_sq_fresh: SecondMomentField
    lamb_coeff_freeze: PyTree
    last_factor: PyTree
    scaling_coeff: PyTree
    worker_error: ErrorFeedbackField
    server_error: ErrorFeedbackField
    auto: AutoState | None = None


_Leaf = leafwise.leaf_type(OnebitLambState, shared=("worker_error", "server_error", "auto"))


def onebit_lamb(
    lr: leafwise.LearningRate = 1e-3,
    freeze_step: int | str | AutoFreeze = 100000,
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
    exp_avg_mask: PyTree | str | None = None,
    safeguard: bool = True,
    local_world_size: int | None = None,
    error_dtype: torch.dtype = torch.float32,
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
            (``ValueError`` otherwise). ``"auto"`` or an ``fn.AutoFreeze``: decided in the
            state once the variance has caught up with the gradients (see ``fn.onebit_adam``).
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`.
        weight_decay: :math:`\lambda`, added to the update.
        max_coeff, min_coeff: the bounds of the warmup trust ratio :math:`\rho`.
        coeff_beta: :math:`\beta_c`, the EMA coefficient of the frozen trust ratio :math:`R`.
        factor_max, factor_min: the bounds of the factor :math:`f`.
        factor_threshold: :math:`\tau`, the largest relative change of :math:`f` per update.
        comm: the ``fn.collectives`` Comm.
        exp_avg_mask: optional pytree like params of masks multiplied into the momentum after
            every compressed allreduce; ``None`` leaves: no mask; ``"auto"``: 0 where the
            averaged gradient was exactly zero at every warmup update (see
            ``fn.onebit_adam``).
        safeguard, local_world_size, error_dtype: as ``fn.onebit_adam``'s (the safeguard: see
            below).

    Memory: the warmup keeps LAMB's state (``m`` and ``v``, fp32, and per-leaf scalars); the
    fresh variance starts as the variance itself at the last warmup update (no copy until the
    first compressed update replaces it), the errors come with the first compressed update,
    and from then on the momentum is kept as the fused allreduce's packed signs
    (``fn.collectives.PackedSigns``; a leaf's momentum is read back exactly from them, its
    scaling coefficient and its mask). A compressed update in which some leaf has no gradient
    keeps every momentum as fp32 instead, since that leaf keeps its own. With ``W`` ranks
    (flat): ``8 n`` (v, fresh v) + ``n / 8`` (m) + ``4 n + 4 n / W`` (fp32 errors) bytes, 1.64
    times Adam's ``8 n`` at ``W = 4`` (1.33 with bf16 errors).

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
            ``freeze_step < 2``, another string than ``"auto"`` or an invalid
            ``fn.AutoFreeze``; an ``error_dtype`` other than fp32, bf16 or fp16.

    Further deliberate deviations from DeepSpeed: a leaf whose momentum is zero at the first
    compressed update gets the scaling coefficient 1 (DeepSpeed divided by zero), and empty leaves
    take no part in the scaling mean; ``freeze_step <= 1`` is rejected (DeepSpeed accepted it and
    warmed up its first real update anyway). DeepSpeed's 1-bit LAMB had no ``non_freeze`` groups
    and neither does this one.

    Safeguard (``safeguard=True``, a deliberate deviation from DeepSpeed; the failure and the
    bound :math:`B = (1-\beta_1) / \sqrt{(1-\beta_2)(1-\beta_1^2/\beta_2)}` on dense Adam's
    :math:`|m / \sqrt v|` are explained in ``onebit_adam``): :math:`u_0 = m / d` is clipped to
    :math:`[-B, B]`, so an element moves by at most :math:`\eta R f B` per update. The freeze
    (the first compressed update) reports and a never-warmed-up state raises as in
    ``onebit_adam``.

    Policies: a ``None`` gradient leaf gets a ``None`` update and keeps its state (its slice of
    the fused buffer is zero); every rank must have ``None`` at the same leaves. Non-finite
    gradients raise ``ValueError`` with nothing updated (warmup: checked on the averaged gradient;
    compressed: the collective's check, or a local check with one worker).

    Buffer donation: the updates accept the extra keyword ``donate`` (``None``, ``True`` or a
    state like ``state``). A compressed update then writes the new errors of the fused
    allreduce into the donated state's buffers and its mean into the fused momentum, after
    every rank's check; the per-leaf rule and the warmup updates still allocate their results.

    ``sqrt(v)`` and ``sqrt(v~)`` are correctly rounded (``fn.kernels.sqrt_rn``, as in
    ``onebit_adam``).

    The exact rules, step by step, are in docs/algorithms.md, "1-bit LAMB".

    Example:
        One worker (``Local``: the collectives are the identity; ``fn.onebit_adam``'s example
        runs simulated ranks): a warmup update, which fixes the trust ratio's EMA :math:`R`,
        then compressed ones.

        >>> import torch
        >>> import fn
        >>> from fn.collectives import Local
        >>> opt = fn.onebit_lamb(lr=1e-2, freeze_step=2, comm=Local())
        >>> params = {"w": torch.ones(4, 2), "b": torch.ones(3)}
        >>> state = opt.init(params)
        >>> for t in (1, 2, 3):
        ...     grads = {k: torch.full_like(p, 0.5) for k, p in params.items()}
        ...     updates, state = opt.update(grads, state, params, step=t)
        ...     params = fn.apply_updates(params, updates)
        >>> [opt.is_compressed(t) for t in (1, 2, 3)]
        [False, True, True]
        >>> state.lamb_coeff_freeze["w"]  # R, frozen at the last warmup update
        tensor(0.0316)
        >>> params["b"]
        tensor([0.9864, 0.9864, 0.9864])
    """
    settings = leafwise.onebit_settings(
        "onebit_lamb", lr, betas, eps, weight_decay, comm, safeguard, local_world_size, error_dtype
    )
    trust = _trust_settings(
        "onebit_lamb", min_coeff, max_coeff, coeff_beta, factor_min, factor_max, factor_threshold
    )
    schedule = freeze_schedule(freeze_step, _FREEZE_NEEDS)
    auto = onebit_auto.auto_warmup("onebit_lamb", schedule, exp_avg_mask, None, settings)

    def update(grads, state, params, plan, eta, donated=None):  # the settings in its closure
        packed = isinstance(state.exp_avg, PackedSigns)
        mask = onebit_state.masks_of(exp_avg_mask, state) if plan.compressed or packed else None
        state = state._replace(exp_avg=onebit_state.momentum_of(state, mask))
        if not plan.compressed:
            return _warmup_update(settings, trust, auto, grads, state, params, plan, eta)
        return _compressed_update(settings, trust, mask, grads, state, params, plan, eta, donated)

    opt = _lamb_optimizer("onebit_lamb", lr, schedule, auto, update)
    return opt._replace(**onebit_auto.checks("onebit_lamb", settings, auto, exp_avg_mask))


def _warmup_update(h, trust, auto, grads, state, params, plan, eta):
    """A warmup update of :func:`onebit_lamb`: :func:`_warmup_rule` on every leaf, on the
    gradients averaged first where the warmup decides something (``auto``)."""
    grads, seen, h = onebit_auto.observed_warmup("onebit_lamb", auto, grads, state, h)
    # with an automatic switch any warmup update may be the last: each sets v~ = v
    copies = plan.copies_variance or (auto is not None and auto.freeze is not None)
    rule = partial(_warmup_rule, h, trust, eta=eta, copies=copies)
    updates, new = leafwise.map_leaves("onebit_lamb", rule, grads, state, _Leaf, params)
    return updates, new._replace(auto=seen)


def _compressed_update(h, trust, mask, grads, state, params, plan, eta, donated):
    """A compressed update of :func:`onebit_lamb` (the first also reports the frozen variance
    and sets the momentum scaling): :func:`_fused_momenta`, then :func:`_compressed_rule` on
    every leaf; the momentum kept as the allreduce's packed signs where every leaf has one."""
    if plan.sets_scaling:
        leafwise.report_frozen_variance("onebit_lamb", state, h, mask=mask)
        state = state._replace(scaling_coeff=_scaling_coefficients(state))
    mean, momenta, state = _fused_momenta(h, grads, state, donated)
    rule = partial(_compressed_rule, h, trust, eta=eta)
    updates, state = leafwise.map_leaves("onebit_lamb", rule, momenta, state, _Leaf, params, mask)
    if isinstance(mean, PackedSigns) and None not in tree_leaves(momenta, keep_none=True):
        state = state._replace(exp_avg=mean)  # the momenta, read back by momentum_of
    return updates, state


def onebit_lamb_sharded(
    lr: leafwise.LearningRate = 1e-3,
    freeze_step: int | str | AutoFreeze = 100000,
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
    safeguard: bool = True,
) -> CompressedOptimizer:
    r"""1-bit LAMB's rule on one rank's shard of the params, for a caller that runs the
    momentum's communication itself (``fn.fsdp.OnebitLamb``, inside FSDP2's reduce-scatter).

    The rule of :func:`onebit_lamb` (the same per-leaf code), with two differences of where
    things are computed:

    - every full-tensor reduction of a leaf (:math:`\lVert p\rVert`, :math:`\lVert u\rVert`,
      :math:`\lVert u_0\rVert`, :math:`\lVert m\rVert` and the factor's :math:`\max_i`) is
      taken over the shards: each rank's sums of squares (fp64) and maxima are all-gathered
      over ``comm`` in one call per update and reduced in rank order, so every rank gets the
      same bits; a norm is :math:`\sqrt{\sum_r s_r}` in fp64, rounded once to fp32;
    - the momentum scaling :math:`s_\ell` is fixed at the last warmup update (from the momentum
      it leaves, the one :func:`onebit_lamb` reads at the first compressed update), so that it
      is known before the first compressed reduce-scatter, which scales by it.

    Inputs: a warmup update takes the mean gradient shards over the ranks; a compressed one
    takes this rank's shard of the allreduce's result (the scaled momentum
    :math:`\mathrm{CAR}(s_\ell(\beta_1 m_\ell + (1-\beta_1) g_{r,\ell}))`, times the mask where
    the caller has one), with the state's ``exp_avg`` holding the momentum shards before it
    (:math:`m_{last}`).

    Args:
        lr, betas, eps, weight_decay, safeguard: as :func:`onebit_lamb`.
        freeze_step: as :func:`onebit_lamb`. With ``freeze_step="auto"`` every warmup update
            takes ``gradient_energy=`` (as ``fn.transforms.onebit_adam_sharded``'s) and, since
            any of them may be the last, sets ``v~ = v`` and the scaling coefficients.
        max_coeff, min_coeff, coeff_beta: as :func:`onebit_lamb`.
        factor_max, factor_min, factor_threshold: as :func:`onebit_lamb`.
        comm: the ``fn.collectives`` Comm over the ranks that hold the shards (its
            ``all_gather`` carries the norms; ``Local()`` for unsharded leaves).

    Returns:
        A ``CompressedOptimizer`` (``params`` required) whose state is an ``OnebitLambState``
        with the errors ``None``; the momentum a compressed update returns in ``exp_avg`` is
        the new fp32 shard. Every rank must have ``None`` gradients at the same leaves. The
        first compressed update takes the caller's masks as ``momentum_mask=`` (as
        ``fn.transforms.onebit_adam_sharded``'s: for the report of the frozen variance only).

    Raises:
        ValueError: as :func:`onebit_lamb`.
        TypeError: a warmup update of an automatic switch without a valid
            ``gradient_energy`` (as ``fn.transforms.onebit_adam_sharded``).

    Example:
        One rank holding the whole leaf (``Local``): the rule of :func:`onebit_lamb` with one
        worker, up to how its norms are summed.

        >>> import torch
        >>> import fn
        >>> from fn.collectives import Local
        >>> opt = fn.transforms.onebit_lamb_sharded(lr=0.1, freeze_step=2, comm=Local())
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -1.0])}, state, params, step=1)
        >>> params = fn.apply_updates(params, updates)
        >>> state.scaling_coeff["w"]  # fixed at the last warmup update
        tensor(1.)
        >>> momentum = {"w": torch.tensor([0.2, -0.1])}  # CAR's result, from the caller
        >>> updates, state = opt.update(momentum, state, params, step=2)
        >>> state.exp_avg["w"]
        tensor([ 0.2000, -0.1000])
    """
    name = "onebit_lamb_sharded"
    settings = leafwise.onebit_settings(name, lr, betas, eps, weight_decay, Local(), safeguard)
    trust = _trust_settings(
        name, min_coeff, max_coeff, coeff_beta, factor_min, factor_max, factor_threshold
    )
    schedule = freeze_schedule(freeze_step, _FREEZE_NEEDS)
    auto = onebit_auto.auto_warmup(name, schedule, None, None, settings)

    def update(grads, state, params, plan, eta, **given):  # the settings in its closure
        inputs = (grads, state, params, plan, eta)
        return _sharded_update(settings, trust, comm, auto, *inputs, **given)

    keywords = ("gradient_energy", "momentum_mask")
    return _lamb_optimizer(name, lr, schedule, auto, update, keywords=keywords)


def _lamb_optimizer(name, lr, schedule, auto, update, **options) -> CompressedOptimizer:
    """The ``CompressedOptimizer`` of :func:`onebit_lamb` and :func:`onebit_lamb_sharded`:
    ``update`` on the plans of ``schedule``, the state made by :func:`_init_fields`; ``options``
    go to ``fn.transforms._leafwise.compressed_optimizer``."""
    return leafwise.compressed_optimizer(
        name,
        lr,
        OnebitLambState,
        partial(_init_fields, auto),
        update,
        schedule.is_compressed,
        schedule.onebit_lamb_plan,
        OnebitLambPlan,
        params_needed_for="1-bit LAMB (trust ratios)",
        first_compressed=schedule.first_compressed_step,
        **options,
    )


def _sharded_update(h, trust, comm, auto, grads, state, params, plan, eta, donated=None, **given):
    """An update of :func:`onebit_lamb_sharded`: :func:`_sharded_warmup` after observing the
    ``gradient_energy`` given (with an automatic switch, any warmup update may be the last:
    each copies ``v~ = v`` and fixes the scaling), or :func:`_sharded_compressed` (the first
    reports the frozen variance with the ``momentum_mask`` given); ``donated`` is unused."""
    del donated
    name = "onebit_lamb_sharded"
    leaves = leafwise.leaves_of(name, grads, state, _Leaf, params)
    if plan.compressed:
        if plan.sets_scaling:
            leafwise.report_frozen_variance(name, state, h, mask=given.get("momentum_mask"))
        return _sharded_compressed(h, trust, comm, leaves, state, eta)
    seen = onebit_auto.observed_given(name, auto, state, given.get("gradient_energy"))
    copies = plan.copies_variance or auto is not None
    updates, new = _sharded_warmup(h, trust, comm, leaves, state, eta, copies)
    return updates, new._replace(auto=seen)


def _sharded_warmup(h, trust, comm, leaves, state, eta, copies):
    """:func:`_warmup_rule` on shards: the norms summed over the ranks; ``copies``: the last
    warmup update, which also fixes the momentum scaling (from the norms of the new momenta,
    in the same all-gather)."""
    directions = [
        _warmup_direction(h, x.g, x.leaf, x.inputs[0], copies=copies) for x in leaves.with_grad
    ]
    sums = [
        part
        for (u, _), x in zip(directions, leaves.with_grad, strict=True)
        for part in (_count(u), _sum_of_squares(x.inputs[0]), _sum_of_squares(u))
    ]
    if copies:  # every leaf's new momentum (a leaf without a gradient keeps its own)
        _, moved = leafwise.rebuilt(leaves, directions, state)
        walk = live_leaves(moved.exp_avg, moved.scaling_coeff)
        sums += [part for m in walk.at_live(0) for part in (_count(m), _sum_of_squares(m))]
    total, _ = _over_ranks(comm, sums, [])
    counts = total.tolist()
    results = []
    for j, (u, leaf) in enumerate(directions):
        if counts[3 * j] == 0:  # an empty leaf: no trust ratio
            results.append((u, leaf))
            continue
        norms = _norm(total[3 * j + 1]), _norm(total[3 * j + 2])
        results.append(_warmup_scaled(trust, u, leaf, *norms, eta=eta))
    updates, new = leafwise.rebuilt(leaves, results, state)
    if not copies:
        return updates, new
    start = 3 * len(directions)
    rms = {
        j: _norm(total[start + 2 * j + 1]) / counts[start + 2 * j] ** 0.5
        for j in range(len(walk.at_live(0)))
        if counts[start + 2 * j] > 0
    }
    scaling = walk.rebuild(_scaling_of_rms(rms, walk.at_live(1)), fill=1)
    return updates, new._replace(scaling_coeff=scaling)


def _sharded_compressed(h, trust, comm, leaves, state, eta):
    """:func:`_compressed_rule` on shards: the factor's maximum and the norms over the
    ranks."""
    directions = [
        _compressed_direction(h, x.g, x.leaf, x.inputs[0], None) for x in leaves.with_grad
    ]
    sums = [
        part
        for d, _ in directions
        for part in (_count(d.u), _sum_of_squares(d.u0), _sum_of_squares(d.u))
    ]
    highest = [_largest(d.spread) for d, _ in directions]
    total, largest = _over_ranks(comm, sums, highest)
    counts = total[0::3].tolist()
    results = []
    for j, ((d, leaf), x) in enumerate(zip(directions, leaves.with_grad, strict=True)):
        if counts[j] == 0:  # an empty leaf
            results.append((torch.zeros_like(x.leaf.exp_avg), x.leaf))
            continue
        norms = (_norm(total[3 * j + 1]), _norm(total[3 * j + 2])) if h.weight_decay > 0 else None
        factor = largest[j].float()
        results.append(_compressed_scaled(h, trust, d.u, leaf, factor, norms, eta=eta))
    return leafwise.rebuilt(leaves, results, state)


def _count(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)


def _sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    return x.double().square().sum()


def _largest(x: torch.Tensor) -> torch.Tensor:
    """The largest element of ``x`` (fp64), ``-inf`` for an empty shard."""
    if x.numel() == 0:
        return torch.tensor(-math.inf, dtype=torch.float64, device=x.device)
    return x.amax().double()


def _norm(sum_of_squares: torch.Tensor) -> torch.Tensor:
    """A norm from its fp64 sum of squares, rounded once to fp32."""
    return sum_of_squares.sqrt().float()


def _over_ranks(
    comm: Any, sums: list[torch.Tensor], maxima: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums over the ranks of ``sums`` and the maxima of ``maxima`` (0-dim fp64 each), the
    same bits on every rank: one all-gather, reduced in rank order."""
    local = torch.stack([*sums, *maxima]) if sums or maxima else torch.zeros(0, dtype=torch.float64)
    rows = comm.all_gather(local).view(-1, local.numel())
    return rows[:, : len(sums)].sum(0), rows[:, len(sums) :].amax(0)


def _init_fields(auto: Any, params: PyTree) -> dict[str, Any]:
    """The fields of the initial state after ``count`` and ``lr``."""
    return dict(
        exp_avg=tree_zeros_like(params, torch.float32),
        exp_avg_sq=tree_zeros_like(params, torch.float32),
        exp_avg_sq_fresh=leafwise.no_error_feedback(params),
        lamb_coeff_freeze=_scalars(params, 0.0),
        last_factor=_scalars(params, 1.0),
        scaling_coeff=_scalars(params, 1.0),
        worker_error=None,
        server_error=None,
        auto=onebit_auto.init_auto(auto, params),
    )


class _TrustSettings(NamedTuple):
    """The hyperparameters of 1-bit LAMB's trust ratios (see ``onebit_lamb``)."""

    min_coeff: float
    max_coeff: float
    coeff_beta: float
    factor_min: float
    factor_max: float
    factor_threshold: float


def _trust_settings(name: str, *values: float) -> _TrustSettings:
    """The checked trust-ratio hyperparameters, given in the order of :class:`_TrustSettings`
    (``ValueError`` naming a bad one)."""
    trust = _TrustSettings(*values)
    min_coeff, max_coeff, coeff_beta, factor_min, factor_max, factor_threshold = trust
    check_nonnegative(
        name, min_coeff=min_coeff, factor_min=factor_min, factor_threshold=factor_threshold
    )
    check_ordered(name, min_coeff=min_coeff, max_coeff=max_coeff)
    check_ordered(name, factor_min=factor_min, factor_max=factor_max)
    check_fraction(name, coeff_beta=coeff_beta)
    return trust


_FREEZE_NEEDS = (
    "the compressed updates divide by sqrt(v) + eps and scale by the trust ratio R, both "
    "frozen, which at least one warmup update (t < freeze_step) must estimate"
)


def _warmup_rule(h: leafwise.OnebitSettings, trust: _TrustSettings, g, leaf, p, *, eta, copies):
    """The warmup update of one leaf: LAMB on the averaged gradient; ``copies``: the fresh
    variance starts as a copy of the variance."""
    u, leaf = _warmup_direction(h, g, leaf, p, copies=copies)
    if u.numel() == 0:
        return u, leaf
    p_norm, u_norm = torch.linalg.vector_norm(p.float()), torch.linalg.vector_norm(u)
    return _warmup_scaled(trust, u, leaf, p_norm, u_norm, eta=eta)


def _warmup_direction(h: leafwise.OnebitSettings, g, leaf, p, *, copies):
    """The elementwise part of a warmup update: the new moments and Adam's direction ``u``."""
    m, v, v_fresh, r, last, scaling = leaf
    m, v = leafwise.dense_moments(g, m, v, h.b1, h.b2, h.comm)
    if copies:
        v_fresh = v
    u = leafwise.adam_direction(
        m, leafwise.adam_denominator(v, h.eps), p, bound=None, weight_decay=h.weight_decay
    )
    return u, _Leaf(m, v, v_fresh, r, last, scaling)


def _warmup_scaled(trust: _TrustSettings, u, leaf, p_norm, u_norm, *, eta):
    """The warmup update of a non-empty leaf from its direction and the norms of its param and
    direction: the trust ratio, its moving average ``R`` and the scaled update."""
    ratio = trust_ratio_of_norms(
        p_norm, u_norm, min_coeff=trust.min_coeff, max_coeff=trust.max_coeff
    )
    r = leaf.lamb_coeff_freeze
    r = torch.where(ratio != 1, leafwise.moving_average(r, trust.coeff_beta, ratio), r)
    return -(eta * ratio) * u, leaf._replace(lamb_coeff_freeze=r)


def _compressed_rule(h: leafwise.OnebitSettings, trust: _TrustSettings, m, leaf, p, mask, *, eta):
    """The compressed update of a leaf whose momentum came out of the allreduce as ``m``."""
    if m.numel() == 0:
        return torch.zeros_like(leaf.exp_avg), leaf
    direction, leaf = _compressed_direction(h, m, leaf, p, mask)
    norms = None
    if h.weight_decay > 0:
        norms = (torch.linalg.vector_norm(direction.u0), torch.linalg.vector_norm(direction.u))
    factor = direction.spread.amax()
    return _compressed_scaled(h, trust, direction.u, leaf, factor, norms, eta=eta)


class _CompressedDirection(NamedTuple):
    """The elementwise part of a compressed update of one leaf."""

    u0: torch.Tensor  # m / d, clipped by the safeguard
    u: torch.Tensor  # u0 plus the weight decay
    spread: torch.Tensor  # d / (sqrt(v~) + eps), whose largest element is the factor f


def _compressed_direction(h: leafwise.OnebitSettings, m, leaf, p, mask):
    """The elementwise part of a compressed update: the momentum ``m`` (the leaf's slice of
    the allreduce's result, scaled), the fresh variance, the directions."""
    m_last, v, v_fresh, r, last, scaling = leaf
    m = onebit_state.fused_momentum(m, scaling, mask)
    v_fresh = v if v_fresh is None else v_fresh  # a state whose warmup made no copy
    g_hat = (m - h.b1 * m_last) / (1 - h.b1)
    v_fresh = leafwise.moving_average(v_fresh, h.b2, g_hat, square=True)
    d = leafwise.adam_denominator(v, h.eps)
    u0 = leafwise.adam_direction(m, d, p, bound=h.clip, weight_decay=0.0)
    u = u0 + h.weight_decay * p.float() if h.weight_decay > 0 else u0
    spread = d / leafwise.adam_denominator(v_fresh, h.eps)
    return _CompressedDirection(u0, u, spread), _Leaf(m, v, v_fresh, r, last, scaling)


def _compressed_scaled(
    h: leafwise.OnebitSettings, trust: _TrustSettings, u, leaf, f, norms, *, eta
):
    """The compressed update of a non-empty leaf from its direction ``u``, the largest element
    ``f`` of its spread and, with weight decay, the norms of ``u0`` and ``u``: the factor
    (bounded, and by ``factor_threshold`` around the last one) and the scaled update."""
    if norms is not None:
        u0_norm, u_norm = norms
        q = (u0_norm / u_norm).clamp(max=1.0)
        q = torch.where(u_norm != 0, q, torch.ones_like(q))
        f = f * q + (1 - q)
    last = leaf.last_factor
    f = f.clamp(max=trust.factor_max).clamp(min=trust.factor_min)
    f = torch.minimum(f, last * (1 + trust.factor_threshold))
    f = torch.maximum(f, last * (1 - trust.factor_threshold))
    return -(eta * (leaf.lamb_coeff_freeze * f)) * u, leaf._replace(last_factor=f)


def _fused_momenta(h: leafwise.OnebitSettings, grads, state, donated):
    """Every leaf's scaled momentum, 1-bit averaged by one compressed allreduce of all of them
    (the new errors into ``donated``'s buffers where given): the mean as it arrives (packed
    signs where it was compressed), the momenta as views of its values (``None`` where the
    gradient is ``None``) and ``state`` with the new errors."""
    pieces, _ = leafwise.map_leaves(
        "onebit_lamb", partial(_scaled_momentum, h.b1), grads, state, _Leaf
    )
    walk = live_leaves(state.exp_avg, pieces)  # the momenta's sizes, their scaled pieces
    fused = _fuse(walk)
    buffers = None
    if donated is not None and state.worker_error is not None:
        buffers = (
            None,
            fitting(donated.worker_error, state.worker_error),
            fitting(donated.server_error, state.server_error),
        )
    mean, worker_error, server_error = leafwise.compressed_mean(
        fused,
        state.worker_error,
        state.server_error,
        h,
        "the momentum (local gradient)",
        out=buffers,
        packed=True,
    )
    flat = mean.values(fused.numel()) if isinstance(mean, PackedSigns) else mean
    momenta = _split(flat, walk)
    return mean, momenta, state._replace(worker_error=worker_error, server_error=server_error)


def _scaled_momentum(b1, g, leaf):
    return leafwise.moving_average(leaf.exp_avg, b1, g) * leaf.scaling_coeff, leaf


def _scalars(params: PyTree, value: float) -> PyTree:
    """A 0-dim fp32 ``value`` per leaf, on the leaf's device."""
    return tree_map(lambda p: torch.tensor(value, dtype=torch.float32, device=p.device), params)


def _scaling_coefficients(state: OnebitLambState) -> PyTree:
    """The momentum scaling of every non-empty leaf, ``mean_l(rms(m_l)) / rms(m_l)`` (1 where
    ``m_l`` is zero), the mean over the non-empty leaves; empty leaves keep theirs."""
    walk = live_leaves(state.exp_avg, state.scaling_coeff)
    rms = {
        j: torch.linalg.vector_norm(m) / m.numel() ** 0.5
        for j, m in enumerate(walk.at_live(0))
        if m.numel() > 0
    }
    return walk.rebuild(_scaling_of_rms(rms, walk.at_live(1)), fill=1)


def _scaling_of_rms(rms: dict[int, torch.Tensor], scaling: list) -> list:
    """``scaling`` with the coefficient of every leaf ``j`` in ``rms`` (its momentum's RMS)
    set to ``mean(rms) / rms[j]`` (1 where ``rms[j]`` is 0)."""
    if rms:
        mean = torch.stack(list(rms.values())).mean()
        for j, s in rms.items():
            scaling[j] = torch.where(s > 0, mean / s, torch.ones_like(s))
    return scaling


def _fuse(walk: LiveLeaves) -> torch.Tensor:
    """The pieces of ``walk`` (of the momenta, then the pieces), flattened and concatenated in
    leaf order; zeros of the size of the momentum where a piece is ``None``."""
    flat = [
        m.new_zeros(m.numel()) if piece is None else piece.reshape(-1)
        for m, piece in zip(walk.at_live(0), walk.at_live(1), strict=True)
    ]
    return torch.cat(flat) if flat else torch.zeros(0)


def _split(flat: torch.Tensor, walk: LiveLeaves) -> PyTree:
    """Inverse of :func:`_fuse`: views of ``flat`` shaped like the momenta (``None`` where a
    piece is ``None``)."""
    momenta = walk.at_live(0)
    values = flat.split([m.numel() for m in momenta])
    columns = zip(values, momenta, walk.at_live(1), strict=True)
    return walk.rebuild([None if piece is None else x.view_as(m) for x, m, piece in columns])
