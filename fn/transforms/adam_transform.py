"""Adam: the bias-corrected adaptive-moment preconditioner and the Adam/AdamW optimizers.

The definition is :func:`adam_leaf`, one leaf's step; the foreach loop and the fused kernel
compute it over all leaves (the fused kernel with its own rounding, see :func:`adam`). The
donated updates and the fast steps of :func:`fn.update_and_apply` are in
``fn.transforms._adam_steps``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal, NamedTuple, get_args

import torch

from fn.base import (
    GradientTransformation,
    SecondMomentField,
    apply_updates,
    chain,
    donated_state,
    split_donated,
)
from fn.errors import check_betas, check_finite_nonnegative, check_lr
from fn.transforms import _adam_steps as steps
from fn.transforms._learning_rate import learning_rate_now
from fn.transforms._leaves import device_of, in_dtypes_of, matching, refuse_complex
from fn.transforms.learning_rate import (
    ScaleByLearningRateState,
    Schedule,
    scale_by_learning_rate,
)
from fn.transforms.weight_decay import add_decayed_weights
from fn.tree import (
    PyTree,
    can_donate,
    donated_leaves,
    foreach_blocker,
    foreach_ok,
    live_leaves,
    per_leaf,
    tree_leaves,
    tree_zeros_like,
)

__all__ = ["ScaleByAdamState", "scale_by_adam", "adam", "adamw"]


class ScaleByAdamState(NamedTuple):
    """The state of :func:`scale_by_adam` (and of ``fn.adam``, ``fn.adamw``: their ``state[1]``).

    Attributes:
        count: ``[]`` int64 tensor, the number of updates made so far.
        mu: like params, the first moment :math:`m`.
        nu: like params, the second moment :math:`v`.

    Example:
        >>> state = fn.adam(1e-3).init({"w": torch.zeros(2)})
        >>> state[1]
        ScaleByAdamState(count=tensor(0), mu={'w': tensor([0., 0.])}, nu={'w': tensor([0., 0.])})
    """

    count: torch.Tensor
    mu: PyTree
    nu: SecondMomentField


def adam_leaf(m, v, g, b1, b2, eps, bc1=None, bc2_sqrt=None):
    """One leaf's Adam step: the new moments ``m``, ``v`` and the update ``u`` for the update
    ``g``, with the bias corrections ``bc1 = 1 - b1^t``, ``bc2_sqrt = sqrt(1 - b2^t)`` (``None``
    without bias correction)::

        m = lerp(m, g, 1 - b1)                      # b1 m + (1 - b1) g
        v = v * b2 + (1 - b2) g g
        u = m / (sqrt(v) * (bc1 / bc2_sqrt) + bc1 eps)   # (m / bc1) / (sqrt(v / bc2^2) + eps)
        u = m / (sqrt(v) + eps)                     # without bias correction

    The ops and rounding of ``torch.optim.Adam(foreach=True)``; the foreach loop and the
    donated steps compute exactly these values."""
    m = torch.lerp(m, g, 1.0 - b1)
    v = torch.addcmul(v * b2, g, g, value=1.0 - b2)
    if bc1 is None:
        return m, v, m / (v.sqrt() + eps)
    return m, v, m / (v.sqrt() * (bc1 / bc2_sqrt)).add_(bc1 * eps)


def _adam_foreach(ms, vs, gs, b1, b2, eps, bc1, bc2_sqrt):
    """:func:`adam_leaf` on all leaves with one ``torch._foreach_*`` call per op (eager, plain
    tensors); the same values."""
    new_ms = torch._foreach_lerp(ms, gs, 1.0 - b1)
    new_vs = torch._foreach_mul(vs, b2)
    torch._foreach_addcmul_(new_vs, gs, gs, value=1.0 - b2)
    us = torch._foreach_sqrt(new_vs)
    return new_ms, new_vs, steps.adam_direction_(us, new_ms, eps, bc1, bc2_sqrt)


def _adam_leafwise(ms, vs, gs, b1, b2, eps, bc1, bc2_sqrt):
    """:func:`adam_leaf` leaf by leaf (vmap, autograd, torch.compile): ``(ms, vs, us)``."""
    stepped = [adam_leaf(*mvg, b1, b2, eps, bc1, bc2_sqrt) for mvg in zip(ms, vs, gs, strict=True)]
    return [s[0] for s in stepped], [s[1] for s in stepped], [s[2] for s in stepped]


def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, bias_correction: bool = True
) -> GradientTransformation:
    """Rescales the updates by Adam's moment estimates.

    For the ``t``-th update (``t = count + 1``) with incoming update ``g``:

    .. math::
        m_t = \\beta_1 m_{t-1} + (1 - \\beta_1) g, \\qquad
        v_t = \\beta_2 v_{t-1} + (1 - \\beta_2) g^2,

        u = \\frac{m_t / (1 - \\beta_1^t)}{\\sqrt{v_t} / \\sqrt{1 - \\beta_2^t} + \\epsilon}
        \\quad\\text{or, without bias correction,}\\quad
        u = \\frac{m_t}{\\sqrt{v_t} + \\epsilon}.

    The moments are computed as ``torch.optim.Adam`` does (``m.lerp(g, 1 - b1)``,
    ``v * b2 + (1 - b2) * g * g``); the update as ``m_t / (\\sqrt{v_t} \\cdot c_1 / c_2 + c_1
    \\epsilon)`` with ``c_1 = 1 - \\beta_1^t``, ``c_2 = \\sqrt{1 - \\beta_2^t}`` (the value above,
    rounded slightly differently). On eager plain tensors each op is one ``torch._foreach_*`` call
    over all leaves, as ``torch.optim``'s foreach Adam; under vmap, autograd or
    ``torch.compile`` it goes leaf by leaf with the same rounding. A leaf whose update is
    ``None`` keeps its moments unchanged;
    the counter is shared by all leaves. Non-finite updates propagate into the moments, as in
    ``torch.optim`` (check with ``fn.tree.tree_all_finite`` to skip such steps).

    Reference: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the denominator, >= 0.
        bias_correction: divide the moments by ``1 - beta^t`` (Adam) or not (DeepSpeed's
            1-bit family).

    Returns:
        A GradientTransformation with state :class:`ScaleByAdamState`; moments have the
        params' shapes and dtypes.

    Example:
        The first update without bias correction is ``m / sqrt(v) = 0.2 / sqrt(0.004)``:

        >>> tx = fn.scale_by_adam(bias_correction=False, eps=0.0)
        >>> updates, state = tx.update({"w": torch.tensor([2.0])}, tx.init({"w": torch.zeros(1)}))
        >>> updates["w"], state.count
        (tensor([3.1623]), tensor(1))
    """
    b1, b2 = check_betas("scale_by_adam", (b1, b2))
    check_finite_nonnegative("scale_by_adam", eps=eps)

    def init_fn(params):
        refuse_complex("scale_by_adam", params)
        count = torch.zeros((), dtype=torch.int64, device=device_of(params))
        return ScaleByAdamState(count, tree_zeros_like(params), tree_zeros_like(params))

    def moments_step(ms, vs, gs, ps, count, donated):
        del ps
        bc1 = bc2_sqrt = None
        if bias_correction:
            bc1, bc2_sqrt = _bias_correction(b1, count), _bias_correction(b2, count).sqrt()
        foreach = foreach_ok(*ms, *vs, *gs, scalars=(count,))
        if donated is not None and can_donate(*ms, *vs, *gs):
            step = steps.adam_foreach_donated if foreach else steps.adam_leafwise_donated
            return step(ms, vs, gs, *donated, b1, b2, eps, bc1, bc2_sqrt)
        step = _adam_foreach if foreach else _adam_leafwise
        return step(ms, vs, gs, b1, b2, eps, bc1, bc2_sqrt)

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        del params, extra
        donated = donated_state(donate, state)
        return _step_live_leaves("scale_by_adam", updates, state, moments_step, None, donated)

    return GradientTransformation(init_fn, update_fn)


def _step_live_leaves(name, updates, state, moments_step, params=None, donated=None):
    """Runs ``moments_step(ms, vs, gs, ps, count, donated) -> (new_ms, new_vs, us)`` (``count``
    = the ``t`` of this update; ``ps`` the params' leaves, ``None`` without ``params``;
    ``donated``: ``None``, or the donated ``(ms, vs)`` leaves, ``None`` where not donated) on the
    leaves that have an update and rebuilds the trees; leaves with a ``None`` update keep their
    moments. Returns ``None`` when ``moments_step`` does."""
    check = matching(name, "an update where the state has no moments")
    walk = live_leaves(updates, state.mu, state.nu, params, structure=state.mu, check=check)
    gs, ms, vs = walk.at_live(0), walk.at_live(1), walk.at_live(2)
    gs = in_dtypes_of(gs, ms)  # torch.lerp refuses a mix, with an obscure message
    ps = None if params is None else walk.at_live(3)
    count = state.count + 1
    if donated is not None:
        dm_leaves = donated_leaves(getattr(donated, "mu", None), walk.spec)
        dv_leaves = donated_leaves(getattr(donated, "nu", None), walk.spec)
        donated = ([dm_leaves[i] for i in walk.live], [dv_leaves[i] for i in walk.live])
    stepped = moments_step(ms, vs, gs, ps, count, donated)
    if stepped is None:
        return None
    new_ms, new_vs, us = stepped
    mu, nu = walk.rebuild(new_ms, fill=1), walk.rebuild(new_vs, fill=2)
    return walk.rebuild(us), ScaleByAdamState(count, mu, nu)


def _bias_correction(beta: float, count: torch.Tensor) -> torch.Tensor:
    """``1 - beta**count`` as fp32, computed as ``-expm1(count * log(beta))``: the direct form
    cancels catastrophically in fp32 (``1 - 0.999**1`` keeps only ~4 significant digits)."""
    if beta == 0.0:
        return torch.ones_like(count, dtype=torch.float32)
    return -torch.expm1(count.to(torch.float32) * math.log(beta))


Implementation = Literal["auto", "fused", "foreach", "chain"]
_IMPLEMENTATIONS = get_args(Implementation)


def _scale_by_adam_then_lr(
    name: str,
    lr: float | Schedule,
    betas: tuple[float, float],
    eps: float,
    decoupled_weight_decay: float,
    implementation: Implementation,
) -> GradientTransformation:
    """``chain(scale_by_adam(*betas, eps), scale_by_learning_rate(lr, decoupled_weight_decay=
    ...))`` with the same state, run by ``implementation`` (the choices: :func:`adam`). The
    fused path is one ``torch._fused_adam_`` / ``torch._fused_adamw_`` call (see
    :func:`_fused_update`): one pass over the moments instead of six. Without decay,
    ``params + update`` then equals ``torch.optim.Adam(fused=True)``'s new params bit for bit
    (for a learning rate representable in fp32, as the state stores it); with decoupled decay it
    equals ``torch.optim.AdamW(fused=True)``'s wherever a step moves a param by less than half
    of it. The fast step (:func:`fn.update_and_apply`) is :func:`_fused_apply` where the
    kernel runs, else the chain's update and ``apply_updates``.
    """
    if implementation not in _IMPLEMENTATIONS:
        choices = ", ".join(repr(c) for c in _IMPLEMENTATIONS)
        raise ValueError(f"{name}: implementation must be one of {choices}, got {implementation!r}")
    b1, b2 = check_betas(name, betas)
    check_finite_nonnegative(name, eps=eps)
    check_lr(name, lr)
    chained = chain(
        scale_by_adam(b1, b2, eps),
        scale_by_learning_rate(lr, decoupled_weight_decay=decoupled_weight_decay),
    )
    hyper = (b1, b2, eps, decoupled_weight_decay)
    decoupled = decoupled_weight_decay != 0.0

    def cannot_run(reason):
        return RuntimeError(f"{name}: implementation={implementation!r} cannot run: {reason}")

    def unfused(updates, state, params, donate, extra):
        if donate is not None:
            extra["donate"] = donate
        if implementation == "chain":
            return per_leaf(chained.update, updates, state, params, **extra)
        if implementation == "foreach":
            moments_state, lr_state = state
            decayed = params if decoupled else None
            reason = foreach_blocker(*tree_leaves((updates, moments_state, lr_state, decayed)))
            if reason is not None:
                raise cannot_run(reason)
        return chained.update(updates, state, params, **extra)

    def fused(moments_step, updates, state, params, donate):
        if implementation not in ("auto", "fused"):
            return None
        required = cannot_run if implementation == "fused" else None
        run = functools.partial(moments_step, hyper)
        return _fused_step(name, lr, required, run, updates, state, params, donate)

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        read = params if decoupled else None
        stepped = fused(_fused_update, updates, state, read, donate)
        return stepped if stepped is not None else unfused(updates, state, params, donate, extra)

    def fast_step(updates, state, params, *, donate, **extra):
        stepped = fused(_fused_apply, updates, state, params, donate)
        if stepped is not None:
            return params, stepped[1]
        updates, state = unfused(updates, state, params, donate, extra)
        return apply_updates(params, updates, donate=True), state

    return GradientTransformation(chained.init, update_fn, fast_step)


def _fused_step(name, lr, cannot_run, moments_step, updates, state, params, donate):
    """``(updates, state)`` of :func:`_scale_by_adam_then_lr` from the fused
    ``moments_step(lr, cannot_run, ms, vs, gs, ps, count, donated)`` (:func:`_fused_update` or
    :func:`_fused_apply`) run on the live leaves at the state's learning rate, or ``None`` where
    it cannot run (``cannot_run(reason)`` is raised instead where given)."""
    moments_state, lr_state = state
    if _blocked(foreach_blocker(lr_state.count, lr_state.lr), cannot_run):
        return None
    current = learning_rate_now(lr, lr_state.count, lr_state.lr)
    donated = split_donated(name, donated_state(donate, state), 2)[0]
    donated = donated_state(donated, moments_state)
    run = functools.partial(moments_step, current, cannot_run)
    stepped = _step_live_leaves(name, updates, moments_state, run, params, donated)
    if stepped is None:
        return None
    return stepped[0], (stepped[1], ScaleByLearningRateState(lr_state.count + 1, current))


# Devices and dtypes where fn uses torch._fused_adam_ (torch.optim.Adam(fused=True)'s kernel);
# elsewhere the foreach ops run. CUDA is listed as torch.optim ships it; CI only runs the CPU one.
_FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda"})
_FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _fused_blocker(operands, count, lr):
    """Why ``torch._fused_adam_`` cannot run on ``operands`` (non-empty) with this counter and
    learning rate, or ``None``: it needs eager, plain, contiguous tensors of one supported device
    and dtype, the kernel assuming one memory layout for all its operands."""
    reason = foreach_blocker(*operands, scalars=(count, lr))
    if reason is not None:
        return reason
    device, dtype = operands[0].device, operands[0].dtype
    if device.type not in _FUSED_DEVICE_TYPES:
        return f"torch._fused_adam_ has no {device.type} kernel in fn (only cpu and cuda)"
    if dtype not in _FUSED_DTYPES:
        return f"torch._fused_adam_ does not take {dtype} tensors"
    for t in operands:
        if t.device != device or t.dtype != dtype:
            return f"the tensors mix {device}/{dtype} with {t.device}/{t.dtype}"
        if not t.is_contiguous():
            return "a tensor is not contiguous"
    if lr.device != device or count.device != device:
        return f"the learning rate or counter is not on the tensors' device {device}"
    return None


def _blocked(reason: str | None, cannot_run: Any) -> bool:
    """Whether the fused step stops for ``reason`` (``None``: it runs); where it is required
    (``cannot_run`` given), ``cannot_run(reason)`` is raised instead."""
    if reason is not None and cannot_run is not None:
        raise cannot_run(reason)
    return reason is not None


def _fused_kernel(hyper, lr, cannot_run, operands, count):
    """``run(ps, gs, ms, vs)``: one ``torch._fused_adam_`` call (``torch._fused_adamw_`` with
    decay) at step ``count`` updating ``ps``, ``ms`` and ``vs`` in place, or ``None`` where
    the kernel cannot run on ``operands`` (:func:`_fused_blocker`; ``cannot_run(reason)`` is
    raised instead where given)."""
    if _blocked(_fused_blocker(operands, count, lr), cannot_run):
        return None
    b1, b2, eps, weight_decay = hyper
    kernel = torch._fused_adam_ if weight_decay == 0.0 else torch._fused_adamw_
    step = count.to(torch.float32)  # the CUDA kernel reads steps as fp32

    def run(ps, gs, ms, vs):
        kernel(
            ps, gs, ms, vs, [], [step] * len(gs), lr=lr, beta1=b1, beta2=b2,
            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip

    return run


def _fused_update(hyper, lr, cannot_run, ms, vs, gs, ps, count, donated):
    """A ``moments_step`` for :func:`_step_live_leaves`: the new moments and the update
    ``-lr * m_hat / (sqrt(v_hat) + eps)`` (with decay: AdamW's ``-lr * wd * p - lr * m_hat /
    (sqrt(v_hat) + eps)``) from one fused kernel call, or ``None`` where there is nothing to
    compute, the kernel cannot run (the caller falls back) or AdamW lacks params (the
    fall-back chain raises that error).

    The kernel updates params and moments in place, so it runs on fresh copies of the moments
    and of a "param": zeros for Adam, whose result ``0 - step`` is the update (``p + update`` is
    then the kernel's ``p - step`` exactly), or a copy ``p'`` of the params for AdamW, whose
    update is ``p' - p`` (exact, and so is ``p + update``, wherever ``p' / p`` lies in
    [1/2, 2]). Donated, the same values go into the donated moments and the gradients' tensors
    (``fn.transforms._adam_steps.fused_into_gradients``)."""
    decoupled = hyper[3] != 0.0
    if not gs or (decoupled and (ps is None or any(p is None for p in ps))):
        return None
    operands = (*ms, *vs, *gs, *ps) if decoupled else (*ms, *vs, *gs)
    run = _fused_kernel(hyper, lr, cannot_run, operands, count)
    if run is None:
        return None
    if donated is not None and can_donate(*gs):
        return steps.fused_into_gradients(run, ms, vs, gs, ps, *donated, decoupled)
    new_ms, new_vs = [m.clone() for m in ms], [v.clone() for v in vs]
    us = [p.clone() for p in ps] if decoupled else [torch.zeros_like(g) for g in gs]
    run(us, gs, new_ms, new_vs)
    if decoupled:
        torch._foreach_sub_(us, ps)
    return new_ms, new_vs, us


def _fused_apply(hyper, lr, cannot_run, ms, vs, gs, ps, count, donated):
    """The fast step's ``moments_step`` for :func:`_step_live_leaves`: the fused kernel's step
    added to the params in place (``fn.transforms._adam_steps.fused_onto_params``), the new
    moments returned with ``None`` updates; ``None`` where :func:`_fused_update` is."""
    if not gs or any(p is None for p in ps):
        return None
    run = _fused_kernel(hyper, lr, cannot_run, (*ms, *vs, *gs, *ps), count)
    if run is None:
        return None
    dms, dvs = donated if donated is not None else ([None] * len(gs), [None] * len(gs))
    new_ms, new_vs = steps.fused_onto_params(run, ms, vs, gs, ps, dms, dvs, hyper[3] != 0.0)
    return new_ms, new_vs, [None] * len(gs)


def adam(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    implementation: Implementation = "auto",
) -> GradientTransformation:
    """Adam with L2 weight decay, as ``torch.optim.Adam``.

    For the ``t``-th update with gradient ``g``:

    .. math::
        g \\leftarrow g + \\lambda p_{t-1}, \\quad
        m_t = \\beta_1 m_{t-1} + (1 - \\beta_1) g, \\quad
        v_t = \\beta_2 v_{t-1} + (1 - \\beta_2) g^2,

        p_t = p_{t-1} - \\eta\\, \\frac{m_t / (1 - \\beta_1^t)}
        {\\sqrt{v_t / (1 - \\beta_2^t)} + \\epsilon}

    This is ``chain(add_decayed_weights(weight_decay), scale_by_adam(*betas, eps),
    scale_by_learning_rate(lr))``; ``implementation`` says how the last two run, as
    ``torch.optim.Adam``'s ``fused=`` and ``foreach=`` do:

    - ``"fused"``: one ``torch._fused_adam_`` call on fresh copies of the state (the kernel of
      ``torch.optim.Adam(fused=True)``, whose params ``apply_updates`` then matches bit for bit).
      It needs eager, plain, contiguous tensors of one dtype (fp16, bf16, fp32 or fp64) on one
      CPU or CUDA device, with the state's learning rate and counter there too, outside
      ``torch.func`` transforms and autograd recording.
    - ``"foreach"``: the chain with one ``torch._foreach_*`` call per op over all leaves
      (``torch.optim.Adam(foreach=True)``'s rounding); it needs eager tensors outside
      ``torch.func`` transforms and autograd recording.
    - ``"chain"``: the chain leaf by leaf, the ops that run under vmap (``Simulated``),
      autograd and ``torch.compile``: an eager run gives the bits of a vmapped one, and of a
      compiled one whose backend keeps the ops (``aot_eager``; inductor fuses them and rounds
      its own way, within fp32 rounding).
    - ``"auto"``: ``"fused"`` where it can run, else the chain, with foreach ops where they can
      run, else leaf by leaf. The fused kernel and the chain agree to fp32 rounding.

    Forcing ``"fused"`` or ``"foreach"`` where it cannot run raises a RuntimeError that names
    the reason. Inputs are never modified, unless donated (``donate=``, see
    :class:`fn.GradientTransformation`). ``fn.update_and_apply(tx, grads, state, params)`` runs
    the update and ``apply_updates`` as one step that writes the params in place: with the fused
    kernel on fp32/fp64 tensors the kernel writes the params directly, as
    ``torch.optim.Adam(fused=True)``; in other dtypes it goes through a small workspace.

    Reference: Kingma & Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015.

    Args:
        lr: learning rate ``eta`` (float or schedule; in the state as ``lr``).
        betas: ``(beta1, beta2)``.
        eps: denominator term ``epsilon``.
        weight_decay: L2 coefficient ``lambda`` added to the gradient.
        implementation: ``"auto"``, ``"fused"``, ``"foreach"`` or ``"chain"``.

    Returns:
        A GradientTransformation with the chain's state,
        ``(EmptyState(), ScaleByAdamState, ScaleByLearningRateState)``.

    Raises:
        ValueError: for an unknown ``implementation``; naming the argument, for ``betas`` that
            is not a pair of real numbers in [0, 1), ``lr`` (unless a schedule) or ``eps`` that
            is not a finite real number >= 0, a negative ``weight_decay``.

    Example:
        >>> import torch, fn
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> grads = {"w": torch.tensor([0.5, -0.25])}
        >>> tx = fn.adam(lr=0.1)
        >>> state = tx.init(params)
        >>> updates, state = tx.update(grads, state, params)
        >>> fn.apply_updates(params, updates)["w"]  # the first step is -lr * sign(g)
        tensor([ 0.9000, -1.9000])
        >>> per_leaf = fn.adam(lr=0.1, implementation="chain")  # the rounding of vmap
        >>> chained, _ = per_leaf.update(grads, per_leaf.init(params), params)
        >>> torch.allclose(chained["w"], updates["w"])
        True
    """
    decay = add_decayed_weights(weight_decay)
    adam_then_lr = _scale_by_adam_then_lr("adam", lr, betas, eps, 0.0, implementation)

    def init_fn(params):
        return (decay.init(params), *adam_then_lr.init(params))

    def decayed(updates, state, params, donate):
        """The decayed updates, the decay's state and the donated rest of the state."""
        if len(state) != 3:
            raise ValueError(f"adam: expected a state of 3 entries, got {len(state)}")
        donated = split_donated("adam", donate, 3)
        updates, decay_state = decay.update(updates, state[0], params, donate=donated[0])
        rest = donate if donate is None or isinstance(donate, bool) else tuple(donated[1:])
        return updates, decay_state, rest

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        updates, decay_state, donate = decayed(updates, state, params, donate)
        if donate is not None:
            extra["donate"] = donate
        updates, rest = adam_then_lr.update(updates, tuple(state[1:]), params, **extra)
        return updates, (decay_state, *rest)

    def fast_step(updates, state, params, *, donate, **extra):
        updates, decay_state, donate = decayed(updates, state, params, donate)
        params, rest = adam_then_lr.fast_step(
            updates, tuple(state[1:]), params, donate=donate, **extra
        )
        return params, (decay_state, *rest)

    return GradientTransformation(init_fn, update_fn, fast_step)


def adamw(
    lr: float | Schedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    *,
    implementation: Implementation = "auto",
) -> GradientTransformation:
    """Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    For the ``t``-th update with gradient ``g`` and the moments ``m_t``, ``v_t`` of :func:`adam`:

    .. math::
        p_t = (1 - \\eta\\lambda)\\, p_{t-1}
        - \\eta\\, \\frac{m_t / (1 - \\beta_1^t)}{\\sqrt{v_t / (1 - \\beta_2^t)} + \\epsilon}

    This is ``chain(scale_by_adam(*betas, eps), scale_by_learning_rate(lr,
    decoupled_weight_decay=weight_decay))``: the decay is scaled by the current ``lr``, so a new
    ``lr`` set with ``fn.set_hyperparams`` scales both, and it is applied in
    ``torch.optim.AdamW``'s order (see :func:`scale_by_learning_rate`). ``implementation``
    picks how it runs, as in :func:`adam`: ``"fused"`` is one ``torch._fused_adamw_`` call
    (``torch.optim.AdamW(fused=True)``'s kernel; its params and ``apply_updates``'s agree bit
    for bit wherever a step moves a param by less than half of it), ``"foreach"`` and
    ``"chain"`` run the chain with foreach or per-leaf ops, and ``"auto"`` (the default) picks
    ``"fused"`` where it can run and the chain elsewhere. ``fn.update_and_apply`` runs the
    step in place, reading and writing the params and moments once: where the fused kernel
    runs, it is ``torch._fused_adamw_`` on the params themselves, so the params are
    ``torch.optim.AdamW(fused=True)``'s bit for bit, and those of ``update`` then
    ``apply_updates`` wherever a step moves a param by less than half of it (elsewhere
    ``p + (p' - p)`` rounds once more than ``p'``); else it is those two calls.

    Reference: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.

    Args:
        lr, betas, eps, implementation: as :func:`adam`.
        weight_decay: decoupled decay coefficient ``lambda``.

    Returns:
        A GradientTransformation with the chain's state,
        ``(ScaleByAdamState, ScaleByLearningRateState)``; ``update`` needs ``params``.

    Raises:
        ValueError: as :func:`adam`.

    Example:
        >>> import torch, fn
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> tx = fn.adamw(lr=0.1, weight_decay=0.5)
        >>> updates, state = tx.update({"w": torch.tensor([0.5, -0.25])}, tx.init(params), params)
        >>> fn.apply_updates(params, updates)["w"]  # (1 - 0.1 * 0.5) * p - 0.1 * sign(g)
        tensor([ 0.8500, -1.8000])
    """
    return _scale_by_adam_then_lr("adamw", lr, betas, eps, weight_decay, implementation)
