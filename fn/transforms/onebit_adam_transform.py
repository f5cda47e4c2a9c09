"""1-bit Adam (Tang et al. 2021) as a pure state transition."""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch

from fn.base import CompressedOptimizer, SecondMomentField
from fn.collectives import ErrorFeedbackField, Local
from fn.transforms import _leafwise as leafwise
from fn.transforms import _onebit_auto as onebit_auto
from fn.transforms import _onebit_state as onebit_state
from fn.transforms._onebit_auto import AutoState
from fn.transforms._onebit_schedules import AutoFreeze, OnebitAdamPlan, freeze_schedule
from fn.transforms.onebit_fast import onebit_adam_step
from fn.tree import PyTree, tree_zeros_like


class OnebitAdamState(NamedTuple):
    """The state of :func:`onebit_adam` (``N_leaf`` a leaf's padded size, ``W`` ranks, ``L``
    ranks per node).

    Attributes:
        count: ``[]`` int64 tensor, the number of updates made so far.
        lr: ``[]`` fp32 tensor, the learning rate of the last update (or the one to use next).
        exp_avg: like params, the momentum :math:`m` in fp32 (warmup), or once compressed the
            ``fn.collectives.PackedSigns`` the 1-bit allreduce returned it as (``m = signs *
            scales * exp_avg_mask``): ``n / 8`` bytes instead of ``4 n``.
        exp_avg_sq: like params, fp32: the variance :math:`v` (frozen once compressed).
        worker_error: per leaf ``[N_leaf / L]`` (``L = 1`` flat) in ``error_dtype``: the
            worker error :math:`e_w`; ``None`` until the first compressed update.
        server_error: per leaf ``[N_leaf / W]`` in ``error_dtype``: the server error
            :math:`e_s`; ``None`` until the first compressed update.
        auto: the :class:`AutoState` that ``freeze_step="auto"`` and ``exp_avg_mask="auto"``
            decide from; ``None`` without them.

    Example:
        >>> opt = fn.onebit_adam(lr=1e-3, freeze_step=2, comm=fn.collectives.Local())
        >>> state = opt.init({"w": torch.zeros(2)})
        >>> state.exp_avg, state.worker_error  # error feedback from the first compressed update
        ({'w': tensor([0., 0.])}, {'w': None})
    """

    count: torch.Tensor
    lr: torch.Tensor
    exp_avg: PyTree
    exp_avg_sq: SecondMomentField
    worker_error: ErrorFeedbackField
    server_error: ErrorFeedbackField
    auto: AutoState | None = None


_Leaf = leafwise.leaf_type(OnebitAdamState, shared=("auto",))


def onebit_adam(
    lr: leafwise.LearningRate = 1e-3,
    freeze_step: int | str | AutoFreeze = 100000,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    comm: Any,
    exp_avg_mask: PyTree | str | None = None,
    non_freeze: PyTree | None = None,
    safeguard: bool = True,
    local_world_size: int | None = None,
    error_dtype: torch.dtype = torch.float32,
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
            its first real update whatever ``freeze_step`` was). ``"auto"`` (or an
            ``fn.AutoFreeze`` with its bounds): the warmup ends once the variance, as it would
            freeze, holds half (``1 - tolerance``) of the gradients' recent energy, decided in
            the state from the averaged gradients (the same on every rank, no communication
            added); then ``opt.plan(t, state)`` and ``opt.is_compressed(t, state)`` need the
            state (see ``docs/algorithms.md``, "Automatic freeze and momentum mask").
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`, added to :math:`\sqrt{v}`.
        weight_decay: :math:`\lambda`, added to the update (L2, as DeepSpeed; not decoupled).
        comm: the ``fn.collectives`` Comm (``Local()``, ``Simulated(W)``, ``ProcessGroup()``).
        exp_avg_mask: optional pytree like params; a tensor leaf (broadcastable to the param) is
            multiplied into the momentum after every compressed allreduce, to keep momentum that
            should be exactly zero (e.g. unused embedding rows) from collecting compression error.
            ``None`` leaves (or ``None``) mean no mask. ``"auto"``: 0 where the averaged
            gradient was exactly zero at every warmup update, 1 elsewhere (the state records it
            in ``n / 8`` bytes per leaf), the same as passing that mask.
        non_freeze: optional pytree like params of bools, DeepSpeed's ``non_freeze`` parameter
            groups: a ``True`` leaf is never compressed; it keeps the warmup rule (dense
            allreduce, ``m`` and ``v`` updated) in the compressed phase too.
        safeguard: clip the Adam direction where the variance is frozen to the range dense Adam
            can reach, :math:`[-B, B]` (see below); ``False`` gives DeepSpeed's exact rule, bit
            for bit.
        local_world_size: ranks per node ``L`` for the hierarchical 1-bit allreduce: a dense
            fp32 mean inside each node of ``L`` consecutive ranks, 1 bit only across nodes
            (``fn.collectives.compressed_allreduce``; the worker errors are ``L`` times
            smaller). ``None`` (default): flat, every rank compresses. Use it with several
            ranks per node and a slow network between nodes; every rank must pass the same.
        error_dtype: the storage of the worker and server errors: ``torch.float32``
            (DeepSpeed's, bit for bit), ``torch.bfloat16`` or ``torch.float16`` (half the
            memory; the allreduce still computes in fp32 and rounds the new errors once).

    Memory: the warmup keeps Adam's state (``m`` and ``v``, fp32). The first compressed update
    allocates the errors, and from then on keeps the momentum as the 1-bit allreduce returned
    it, packed signs and one fp32 scale per chunk (``fn.collectives.PackedSigns``, read back
    exactly): with ``W`` ranks (flat) and ``n`` params, ``4 n`` (v) + ``n / 8`` (m) +
    ``(4 n + 4 n / W)`` (errors, fp32) bytes, ``1.14`` times Adam's ``8 n`` at ``W = 4``
    (``0.83`` with bf16 errors); DeepSpeed kept ``4 (3 n + n / W)``.

    Returns:
        A ``CompressedOptimizer(init, warmup_update, compressed_update, is_compressed, plan)``;
        both updates are ``(grads, state, params=None, *, step=None, plan=None, **extra) ->
        (updates, state)`` with either ``step``, the 1-based update count (a Python int), or
        ``plan=opt.plan(step)`` (``opt.plan(step, state)`` with ``freeze_step="auto"``), an
        ``OnebitAdamPlan`` (for ``torch.compile``: three plans, warmup, the freeze (the first
        compressed update) and compressed, so three graphs). ``params`` is needed when
        ``weight_decay > 0``.

    Raises:
        ValueError: naming the argument: negative ``lr`` (a number), ``eps`` or ``weight_decay``;
            betas outside [0, 1); ``freeze_step < 2``, another string than ``"auto"`` or an
            invalid ``fn.AutoFreeze``; ``"auto"`` with every leaf in ``non_freeze``; an
            ``error_dtype`` other than fp32, bf16 or fp16.

    Safeguard (``safeguard=True``, a deliberate deviation from DeepSpeed): an element whose
    gradient was (almost) zero during the warmup freezes with :math:`v \approx 0` while the
    1-bit allreduce gives it a momentum of its leaf's RMS magnitude, so DeepSpeed's
    :math:`m / (\sqrt v + \epsilon)` blows up. Dense Adam never leaves
    :math:`|m / \sqrt v| \le B = (1-\beta_1) / \sqrt{(1-\beta_2)(1-\beta_1^2/\beta_2)}` (7.27
    for the default betas), so the compressed update clips that ratio to :math:`[-B, B]`. The
    freeze logs (INFO) the elements below the safe range, and warns where training is at risk;
    a compressed update on a state with no update made raises ``ValueError``. The derivation
    and the measurements: ``docs/algorithms.md``, "Safeguard against near-zero frozen variance".

    Policies: a ``None`` gradient leaf (a frozen param) gets a ``None`` update and its state is
    untouched. Non-finite gradients raise ``ValueError`` and nothing is updated: the warmup update
    checks the averaged gradient (so every rank raises together), the compressed update relies on
    the collective's check (and checks the local gradient itself with one worker). Unlike
    DeepSpeed, the error buffers are part of the state: a checkpoint continues bit for bit; they
    must be reset when the world size changes.

    Buffer donation: both updates take the extra keyword ``donate`` (``None``, ``True`` or a
    state like ``state``). A compressed update then writes the new errors into the donated
    state's buffers and the updates into the gradients' buffers (fp32, contiguous; ``grads``
    are donated with the state), keeps the new momentum as the packed signs the allreduce
    received, returns the frozen variance as the same tensor, and on several ranks makes no
    full-size temporary: the momentum is computed inside the 1-bit allreduce's kernels (which
    read the previous one from its signs; a leaf with a mask unpacks it), the update by
    ``fn.kernels.adam_direction``. The bits are those of the pure update; every check (all
    ranks' scales and counts, the warmup) runs before the first write. Warmup updates,
    ``non_freeze`` leaves, fp16 errors and one worker stay pure (they allocate).
    ``fn.update_and_apply(opt, grads, state, params, step=t)`` (or ``plan=``) goes one step
    further on that path: each fp32 param gets its update added in place, reading the new
    momentum from its signs (``fn.kernels.adam_apply``), and the gradients' buffers are scratch
    (their contents unspecified) instead of receiving the updates; the params' bits are those
    of ``update`` then ``apply_updates``.

    ``sqrt(v)`` is correctly rounded (IEEE 754's square root, the same bits on every device;
    torch's fp32 ``sqrt`` on the CPU is 1 ulp off for about one input in five).

    The exact rules, step by step, are in docs/algorithms.md, "1-bit Adam".

    Example:
        Two simulated ranks: one warmup update, then compressed ones.

        >>> import torch
        >>> import fn
        >>> from fn.collectives import Simulated, replicate, simulate
        >>> comm = Simulated(2)
        >>> opt = fn.onebit_adam(lr=1e-2, freeze_step=2, comm=comm)
        >>> params = replicate({"w": torch.ones(8)}, comm)  # one row per rank
        >>> state = replicate(opt.init({"w": torch.ones(8)}), comm)
        >>> update = simulate(opt.update, comm)
        >>> for t in (1, 2, 3):
        ...     grads = {"w": torch.linspace(-1.0, 1.0, 16).reshape(2, 8)}  # each rank's own
        ...     updates, state = update(grads, state, params, step=t)
        ...     params = fn.apply_updates(params, updates)
        >>> [opt.is_compressed(t) for t in (1, 2, 3)]
        [False, True, True]
        >>> state.worker_error["w"].shape  # per rank, 8 elements padded to 16
        torch.Size([2, 16])
        >>> state.exp_avg["w"].packed.shape  # per rank: 16 signs in 2 chunks of 1 byte
        torch.Size([2, 2, 1])
        >>> torch.equal(params["w"][0], params["w"][1])  # the ranks agree after each update
        True
    """
    settings = leafwise.onebit_settings(
        "onebit_adam", lr, betas, eps, weight_decay, comm, safeguard, local_world_size, error_dtype
    )
    return _onebit_adam("onebit_adam", settings, lr, freeze_step, exp_avg_mask, non_freeze)


def onebit_adam_sharded(
    lr: leafwise.LearningRate = 1e-3,
    freeze_step: int | str | AutoFreeze = 100000,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    safeguard: bool = True,
) -> CompressedOptimizer:
    r"""1-bit Adam's rule on one rank's shard of the params, for a caller that runs the
    communication itself (``fn.fsdp.OnebitAdam``, inside FSDP2's reduce-scatter).

    The rule of :func:`onebit_adam` (the same code, the safeguard's clip included), with the
    collectives' results given as inputs: the mean gradient :math:`g = \mathrm{mean}_r\, g_r`
    to a warmup update, the new momentum :math:`m = \mathrm{CAR}(\beta_1 m + (1-\beta_1) g_r)`
    to a compressed one. Everything is elementwise, so it runs on any shard of the params.

    Args:
        lr, betas, eps, weight_decay, safeguard: as :func:`onebit_adam`.
        freeze_step: as :func:`onebit_adam`. With ``"auto"`` (or an ``fn.AutoFreeze``) the
            switch is decided as there, from the gradient energy of the averaged gradients,
            which a shard cannot compute alone: every warmup update then takes the keyword
            ``gradient_energy``, a 0-dim fp64 tensor on the CPU holding the sum over the ranks
            of :func:`fn.transforms.gradient_energy` of each rank's shard of the mean gradient,
            the same bits on every rank (the caller sums it, e.g. inside an allreduce it runs
            anyway). The decision is then the same on every rank.

    Returns:
        A ``CompressedOptimizer`` whose ``warmup_update`` takes the mean gradient over the ranks
        and whose ``compressed_update`` takes the new momentum, each in place of the gradient
        (both ``(grads, state, params=None, *, step=None, plan=None)``; the warmup update also
        ``gradient_energy=`` with ``freeze_step="auto"``). Its state is an ``OnebitAdamState``
        whose errors stay ``None``; the momentum a compressed update returns in ``exp_avg`` is
        the one it was given (the caller keeps it as it likes). There is no
        ``exp_avg_mask``: the caller masks the momentum it passes, and may pass its masks
        (a tree like the params of 0/1 values) to the first compressed update as
        ``momentum_mask=``, which only the report of the frozen variance reads (an element
        masked to 0 is never updated, so its variance at zero is no risk).

    Raises:
        ValueError: as :func:`onebit_adam`.
        TypeError: a warmup update of an automatic switch without a valid ``gradient_energy``.

    Example:
        >>> import torch
        >>> import fn
        >>> opt = fn.transforms.onebit_adam_sharded(lr=0.1, freeze_step=2)
        >>> params = {"w": torch.zeros(2)}
        >>> state = opt.init(params)
        >>> mean_grad = {"w": torch.tensor([1.0, -1.0])}
        >>> updates, state = opt.update(mean_grad, state, params, step=1)
        >>> params = fn.apply_updates(params, updates)
        >>> params["w"]
        tensor([-0.3162,  0.3162])
        >>> momentum = {"w": torch.tensor([0.5, 0.5])}  # CAR's result, from the caller
        >>> updates, state = opt.update(momentum, state, params, step=2)
        >>> fn.apply_updates(params, updates)["w"]  # m / sqrt(v) = 15.8, clipped to 7.27
        tensor([-1.0433, -0.4108])
    """
    settings = leafwise.onebit_settings(
        "onebit_adam_sharded", lr, betas, eps, weight_decay, Local(), safeguard
    )
    return _onebit_adam("onebit_adam_sharded", settings, lr, freeze_step, None, None, averaged=True)


def _onebit_adam(
    name: str,
    settings: leafwise.OnebitSettings,
    lr: leafwise.LearningRate,
    freeze_step: int | str | AutoFreeze,
    exp_avg_mask: PyTree | str | None,
    non_freeze: PyTree | None,
    averaged: bool = False,
) -> CompressedOptimizer:
    """1-bit Adam with ``settings``, its updates :func:`_update` (``averaged``: those of
    :func:`_sharded_update`). The settings stay in closures: ``fn.optim``'s cross-rank check
    reads them there (``settings_of``)."""
    schedule = freeze_schedule(freeze_step, _FREEZE_NEEDS)
    auto = onebit_auto.auto_warmup(name, schedule, exp_avg_mask, non_freeze, settings)

    def update(grads, state, params, plan, eta, **given):
        if averaged:
            return _sharded_update(settings, auto, grads, state, params, plan, eta, **given)
        inputs = (grads, state, params, plan, eta)
        return _update(settings, auto, exp_avg_mask, non_freeze, *inputs, **given)

    opt = leafwise.compressed_optimizer(
        name,
        lr,
        OnebitAdamState,
        partial(_init_fields, auto),
        update,
        schedule.is_compressed,
        schedule.onebit_adam_plan,
        OnebitAdamPlan,
        params_needed_for="weight_decay > 0" if settings.weight_decay > 0 else None,
        fused_apply=not averaged,
        first_compressed=schedule.first_compressed_step,
        keywords=("gradient_energy", "momentum_mask") if averaged else (),
    )
    if averaged:
        return opt
    return opt._replace(**onebit_auto.checks(name, settings, auto, exp_avg_mask, non_freeze))


_FREEZE_NEEDS = (
    "the compressed updates divide by sqrt(v) + eps with the variance v frozen, which at "
    "least one warmup update (t < freeze_step) must estimate"
)


def _update(
    h, auto, exp_avg_mask, non_freeze, grads, state, params, plan, eta, donated=None, apply=False
):
    """An update of :func:`onebit_adam`: the warmup observes the averaged gradients where it
    decides something (``auto``), the freeze reports the frozen variance, then the rule runs
    on every leaf, or its fast step into the ``donated`` state (``apply``: into the params)."""
    name, seen = "onebit_adam", state.auto
    if not plan.compressed:
        grads, seen, h = onebit_auto.observed_warmup(name, auto, grads, state, h, non_freeze)
    mask = onebit_state.masks_of(exp_avg_mask, state) if plan.compressed else None
    if plan.freezes:
        leafwise.report_frozen_variance(name, state, h, skip=non_freeze, mask=mask)
    rule = partial(_rule, h, compressed=plan.compressed, eta=eta)
    inputs = (params, mask, non_freeze)
    if donated is None:
        updates, new = leafwise.map_leaves(name, rule, grads, state, _Leaf, *inputs)
        return updates, new._replace(auto=seen)
    leaves = leafwise.leaves_of(name, grads, state, _Leaf, *inputs, donated=donated)
    return leafwise.rebuilt(leaves, onebit_adam_step(h, rule, leaves, eta, apply), state)


def _sharded_update(
    h, auto, grads, state, params, plan, eta, donated=None, gradient_energy=None, momentum_mask=None
):
    """An update of :func:`onebit_adam_sharded`: the warmup observes the ``gradient_energy``
    given, the freeze reports the frozen variance with the ``momentum_mask`` given, then the
    rule runs on every leaf with ``grads`` the collectives' result; ``donated`` is unused."""
    del donated
    name = "onebit_adam_sharded"
    seen = state.auto
    if not plan.compressed:  # the caller summed the gradient energy
        seen = onebit_auto.observed_given(name, auto, state, gradient_energy)
    if plan.freezes:
        leafwise.report_frozen_variance(name, state, h, mask=momentum_mask)
    rule = partial(_rule, h, compressed=plan.compressed, eta=eta, averaged=True)
    updates, new = leafwise.map_leaves(name, rule, grads, state, _Leaf, params, None, None)
    return updates, new._replace(auto=seen)


def _rule(h: leafwise.OnebitSettings, g, leaf, p, mask, dense, *, compressed, eta, averaged=False):
    """1-bit Adam's update of one leaf (the rules in ``onebit_adam``'s docstring); ``dense``:
    a ``non_freeze`` leaf, which keeps the warmup rule; ``averaged``: a compressed update's
    ``g`` is the momentum's 1-bit allreduce, which the caller ran (``onebit_adam_sharded``)."""
    kept, v, ew, es = leaf
    m = onebit_state.momentum(kept, v, mask)
    if not compressed or bool(dense):
        m, v = leafwise.dense_moments(g, m, v, h.b1, h.b2, h.comm)
        kept = m
    else:
        if averaged:
            mean = g
        else:
            m = leafwise.moving_average(m, h.b1, g)
            mean, ew, es = leafwise.compressed_mean(
                m, ew, es, h, "the momentum (local gradient)", packed=True
            )
        kept, m = onebit_state.kept_momentum(mean, v, mask)
    clip = h.clip if compressed and not bool(dense) else None
    u = leafwise.adam_direction(
        m, leafwise.adam_denominator(v, h.eps), p, bound=clip, weight_decay=h.weight_decay
    )
    return u.mul_(-eta), _Leaf(kept, v, ew, es)


def _init_fields(auto: Any, params: PyTree) -> dict[str, Any]:
    """The fields of the initial state after ``count`` and ``lr``: Adam's (the errors come
    with the first compressed update) and what the warmup decides from (``auto``)."""
    return dict(
        exp_avg=tree_zeros_like(params, torch.float32),
        exp_avg_sq=tree_zeros_like(params, torch.float32),
        worker_error=leafwise.no_error_feedback(params),
        server_error=leafwise.no_error_feedback(params),
        auto=onebit_auto.init_auto(auto, params),
    )
