"""Adam: the bias-corrected adaptive-moment preconditioner and the Adam/AdamW optimizers."""

from __future__ import annotations

import math
import threading
from typing import Literal, NamedTuple, get_args

import torch

from fn.base import (
    GradientTransformation,
    SecondMomentField,
    apply_updates,
    chain,
    donated_state,
    split_donated,
)
from fn.errors import check_betas, check_nonnegative, check_shapes
from fn.kernels._cpu import adamw_step_runs
from fn.kernels._table import kernel as device_kernel
from fn.transforms._learning_rate import learning_rate_now
from fn.transforms._leaves import device_of
from fn.transforms.learning_rate import (
    ScaleByLearningRateState,
    Schedule,
    scale_by_learning_rate,
)
from fn.transforms.weight_decay import add_decayed_weights
from fn.tree import (
    PyTree,
    buffer_like,
    can_donate,
    donated_leaves,
    foreach_blocker,
    foreach_ok,
    per_leaf,
    tree_flatten,
    tree_leaves,
    tree_unflatten,
    tree_zeros_like,
)

__all__ = ["ScaleByAdamState", "scale_by_adam", "adam", "adamw"]


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # [] int64: updates made so far
    mu: PyTree  # like params: first moment m
    nu: SecondMomentField  # like params: second moment v


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
    """
    b1, b2 = check_betas("scale_by_adam", (b1, b2))
    check_nonnegative("scale_by_adam", eps=eps)

    def init_fn(params):
        count = torch.zeros((), dtype=torch.int64, device=device_of(params))
        return ScaleByAdamState(count, tree_zeros_like(params), tree_zeros_like(params))

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        del params, extra

        def moments_step(ms, vs, gs, ps, count, donated):
            del ps
            if bias_correction:
                bc1 = _bias_correction(b1, count)
                bc2_sqrt = _bias_correction(b2, count).sqrt()
            else:
                bc1 = bc2_sqrt = None
            step = _adam_foreach if foreach_ok(*ms, *vs, *gs, count) else _adam_leafwise
            return step(ms, vs, gs, b1, b2, eps, bc1, bc2_sqrt, donated)

        donated = donated_state(donate, state)
        return _step_live_leaves("scale_by_adam", updates, state, moments_step, None, donated)

    return GradientTransformation(init_fn, update_fn)


def _step_live_leaves(name, updates, state, moments_step, params=None, donated=None):
    """Runs ``moments_step(ms, vs, gs, ps, count, donated) -> (new_ms, new_vs, us)`` (``count``
    = the ``t`` of this update; ``ps`` the params' leaves, ``None`` without ``params``;
    ``donated``: ``None``, or the donated ``(ms, vs)`` leaves, ``None`` where not donated) on the
    leaves that have an update and rebuilds the trees; leaves with a ``None`` update keep their
    moments. Returns ``None`` when ``moments_step`` does."""
    m_leaves, spec = tree_flatten(state.mu)
    v_leaves = spec.flatten_up_to(state.nu)
    g_leaves = spec.flatten_up_to(updates)
    live = [i for i, g in enumerate(g_leaves) if g is not None]
    for i in live:
        if m_leaves[i] is None:
            raise ValueError(f"{name}: an update where the state has no moments")
        check_shapes(name, m_leaves[i], g_leaves[i])
    ms, vs, gs = ([leaves[i] for i in live] for leaves in (m_leaves, v_leaves, g_leaves))
    ps = None
    if params is not None:
        p_leaves = spec.flatten_up_to(params)
        ps = [p_leaves[i] for i in live]
    count = state.count + 1
    if donated is not None:
        dm_leaves = donated_leaves(getattr(donated, "mu", None), spec)
        dv_leaves = donated_leaves(getattr(donated, "nu", None), spec)
        donated = ([dm_leaves[i] for i in live], [dv_leaves[i] for i in live])
    stepped = moments_step(ms, vs, gs, ps, count, donated)
    if stepped is None:
        return None
    mu, nu, out = list(m_leaves), list(v_leaves), [None] * len(g_leaves)
    for i, m, v, u in zip(live, *stepped, strict=True):
        mu[i], nu[i], out[i] = m, v, u
    mu, nu = tree_unflatten(mu, spec), tree_unflatten(nu, spec)
    return tree_unflatten(out, spec), ScaleByAdamState(count, mu, nu)


def _adam_leafwise(ms, vs, gs, b1, b2, eps, bc1, bc2_sqrt, donated=None):
    """New moments and updates, leaf by leaf (vmap, autograd, torch.compile), with the ops and
    rounding of :func:`_adam_foreach`: ``m / (sqrt(v) * (bc1 / bc2_sqrt) + bc1 * eps)``. The
    in-place steps only touch fresh temporaries that autograd does not save, or donated
    buffers (``donated``: see :func:`_step_live_leaves`)."""
    if donated is not None and can_donate(*ms, *vs, *gs):
        return _adam_leafwise_donated(ms, vs, gs, b1, b2, eps, bc1, bc2_sqrt, *donated)
    new_ms = [torch.lerp(m, g, 1.0 - b1) for m, g in zip(ms, gs, strict=True)]
    new_vs = [torch.addcmul(v * b2, g, g, value=1.0 - b2) for v, g in zip(vs, gs, strict=True)]
    if bc1 is None:
        us = [m / (v.sqrt() + eps) for m, v in zip(new_ms, new_vs, strict=True)]
    else:
        scale, shift = bc1 / bc2_sqrt, bc1 * eps
        us = [m / (v.sqrt() * scale).add_(shift) for m, v in zip(new_ms, new_vs, strict=True)]
    return new_ms, new_vs, us


def _adam_leafwise_donated(ms, vs, gs, b1, b2, eps, bc1, bc2_sqrt, dms, dvs):
    """:func:`_adam_leafwise` into the donated moments (where they fit) and the updates' own
    tensors: the same ops, written with ``out=`` and in place."""
    new_ms, new_vs = [], []
    for m, v, g, dm, dv in zip(ms, vs, gs, dms, dvs, strict=True):
        new_ms.append(torch.lerp(m, g, 1.0 - b1, out=buffer_like(dm, m)))
        new_v = torch.mul(v, b2, out=buffer_like(dv, v))
        new_vs.append(new_v.addcmul_(g, g, value=1.0 - b2))
    us = []
    for m, v, g in zip(new_ms, new_vs, gs, strict=True):
        u = torch.sqrt(v, out=g)  # the gradient is read: its tensor takes the update
        if bc1 is None:
            u.add_(eps)
        else:
            u.mul_(bc1 / bc2_sqrt).add_(bc1 * eps)
        us.append(torch.div(m, u, out=u))
    return new_ms, new_vs, us


def _adam_foreach(ms, vs, gs, b1, b2, eps, bc1, bc2_sqrt, donated=None):
    """:func:`_adam_leafwise` with one ``torch._foreach_*`` call per op over all leaves (eager,
    plain tensors); same ops and rounding. The in-place ops only touch fresh outputs, or donated
    buffers: the moments copied into the donated ones (none to copy in place), the update into
    the gradient's tensor once the moments have read it."""
    if donated is not None and can_donate(*ms, *vs, *gs):
        new_ms, new_vs = (_donated_copies(*pair) for pair in zip((ms, vs), donated, strict=True))
        torch._foreach_lerp_(new_ms, gs, 1.0 - b1)
        torch._foreach_mul_(new_vs, b2)
        torch._foreach_addcmul_(new_vs, gs, gs, value=1.0 - b2)
        us = gs
        torch._foreach_copy_(us, new_vs)
        torch._foreach_sqrt_(us)
    else:
        new_ms = torch._foreach_lerp(ms, gs, 1.0 - b1)
        new_vs = torch._foreach_mul(vs, b2)
        torch._foreach_addcmul_(new_vs, gs, gs, value=1.0 - b2)
        us = torch._foreach_sqrt(new_vs)
    if bc1 is None:
        torch._foreach_add_(us, eps)
    else:
        # sqrt(v) / bc2_sqrt + eps, scaled by bc1 so that m needs no division by bc1.
        torch._foreach_mul_(us, bc1 / bc2_sqrt)
        torch._foreach_add_(us, bc1 * eps)
    for m, u in zip(new_ms, us, strict=True):
        torch.div(m, u, out=u)
    return new_ms, new_vs, us


def _donated_copies(xs, donated):
    """``xs`` copied into the donated tensors (a new tensor where one does not fit; no copy
    where it is the same tensor)."""
    outs = [buffer_like(d, x) for x, d in zip(xs, donated, strict=True)]
    pairs = [(o, x) for o, x in zip(outs, xs, strict=True) if o is not x]
    if pairs:
        torch._foreach_copy_([o for o, _ in pairs], [x for _, x in pairs])
    return outs


def _bias_correction(beta: float, count: torch.Tensor) -> torch.Tensor:
    """``1 - beta**count`` as fp32, computed as ``-expm1(count * log(beta))``: the direct form
    cancels catastrophically in fp32 (``1 - 0.999**1`` keeps only ~4 significant digits)."""
    if beta == 0.0:
        return torch.ones_like(count, dtype=torch.float32)
    return -torch.expm1(count.to(torch.float32) * math.log(beta))


def _update_functions(step):
    """``(update_fn, fast_step)`` of a transform whose update and fast step are one
    ``step(updates, state, params, donate, extra, apply)`` (``extra``: a dict of the other
    keywords, which ``step`` may change): ``update_fn`` runs it with ``apply=False`` and returns
    ``(updates, state)``; ``fast_step`` runs it with ``apply=True`` and returns ``(params,
    state)``, the params updated in place."""

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        return step(updates, state, params, donate, extra, apply=False)

    def fast_step(updates, state, params, *, donate, **extra):
        return step(updates, state, params, donate, extra, apply=True)

    return update_fn, fast_step


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
    :func:`_fused_adam_step`): one pass over the moments instead of six. Without decay,
    ``params + update`` then equals ``torch.optim.Adam(fused=True)``'s new params bit for bit
    (for a learning rate representable in fp32, as the state stores it); with decoupled decay it
    equals ``torch.optim.AdamW(fused=True)``'s wherever a step moves a param by less than half
    of it.
    """
    if implementation not in _IMPLEMENTATIONS:
        choices = ", ".join(repr(c) for c in _IMPLEMENTATIONS)
        raise ValueError(f"{name}: implementation must be one of {choices}, got {implementation!r}")
    moments = scale_by_adam(*betas, eps)
    step_size = scale_by_learning_rate(lr, decoupled_weight_decay=decoupled_weight_decay)
    chained = chain(moments, step_size)
    b1, b2 = (float(b) for b in betas)

    def cannot_run(reason):
        return RuntimeError(f"{name}: implementation={implementation!r} cannot run: {reason}")

    def unfused(updates, state, params, extra):
        if implementation == "chain":
            return per_leaf(chained.update, updates, state, params, **extra)
        if implementation == "foreach":
            moments_state, lr_state = state
            decayed = params if decoupled_weight_decay != 0.0 else None
            reason = foreach_blocker(*tree_leaves((updates, moments_state, lr_state, decayed)))
            if reason is not None:
                raise cannot_run(reason)
        return chained.update(updates, state, params, **extra)

    def step(updates, state, params, donate, extra, apply):
        """``update_fn``, or with ``apply`` the step of :func:`fn.update_and_apply`: the params
        updated in place and returned in place of the updates."""
        if donate is not None:
            extra["donate"] = donate
        fused = None
        if implementation in ("auto", "fused"):
            moments_state, lr_state = state
            reason = foreach_blocker(lr_state.count, lr_state.lr)
            if reason is None:
                current = learning_rate_now(lr, lr_state.count, lr_state.lr)
                moments_step = _fused_adam_step(
                    b1, b2, eps, current, decoupled_weight_decay, cannot_run,
                    implementation == "fused", apply,
                )  # fmt: skip
                donated = split_donated(name, donated_state(donate, state), 2)[0]
                donated = donated_state(donated, moments_state)
                read = params if apply or decoupled_weight_decay != 0.0 else None
                fused = _step_live_leaves(name, updates, moments_state, moments_step, read, donated)
            elif implementation == "fused":
                raise cannot_run(reason)
        if fused is None:
            updates, state = unfused(updates, state, params, extra)
            return (apply_updates(params, updates, donate=True) if apply else updates), state
        updates, moments_state = fused
        state = (moments_state, ScaleByLearningRateState(lr_state.count + 1, current))
        return (params if apply else updates), state

    update_fn, fast_step = _update_functions(step)
    return GradientTransformation(chained.init, update_fn, fast_step)


# Devices and dtypes where fn uses torch._fused_adam_ (torch.optim.Adam(fused=True)'s kernel);
# elsewhere the foreach ops run. CUDA is listed as torch.optim ships it; CI only runs the CPU one.
_FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda"})
_FUSED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _fused_blocker(operands, count, lr):
    """Why ``torch._fused_adam_`` cannot run on ``operands`` (non-empty) with this counter and
    learning rate, or ``None``: it needs eager, plain, contiguous tensors of one supported device
    and dtype, the kernel assuming one memory layout for all its operands."""
    reason = foreach_blocker(*operands, count, lr)
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


def _fused_adam_step(b1, b2, eps, lr, weight_decay, cannot_run, required, apply=False):
    """A ``moments_step`` for :func:`_step_live_leaves` computing the new moments and the update
    ``-lr * m_hat / (sqrt(v_hat) + eps)`` (with ``weight_decay``: AdamW's
    ``-lr * wd * p - lr * m_hat / (sqrt(v_hat) + eps)``) with one ``torch._fused_adam_`` or
    ``torch._fused_adamw_`` call. Where the kernel cannot run (:func:`_fused_blocker`) it returns
    ``None`` (the caller falls back), or raises ``cannot_run(reason)`` when ``required``. It
    also returns ``None`` when there is nothing to compute (no leaf has an update) and when
    AdamW lacks params (the fall-back chain raises that error).

    The kernel updates params and moments in place, so it runs on fresh copies of the moments
    and of a "param": zeros for Adam, whose result ``0 - step`` is the update (``p + update`` is
    then the kernel's ``p - step`` exactly), or a copy ``p'`` of the params for AdamW, whose
    update is ``p' - p`` (exact, and so is ``p + update``, wherever ``p' / p`` lies in
    [1/2, 2]).

    With ``apply`` (donated state only, see :func:`fn.update_and_apply`) it adds the update to
    the params in place and returns ``None`` updates: fp32/fp64 Adam runs the kernel on the
    params themselves (``p - step``, the value of ``p + (0 - step)``), fp32/fp64 AdamW on the
    CPU runs :func:`fn.kernels.adamw_step` (one pass computing ``p + (p' - p)``) where its C
    kernel runs, the rest goes through the workspace of :func:`_fused_in_pieces` (no
    full-size copy, unlike the kernel's reference)."""

    def moments_step(ms, vs, gs, ps, count, donated):
        if weight_decay == 0.0 and not apply:
            operands = (*ms, *vs, *gs)
        elif ps is None or any(p is None for p in ps):
            return None
        else:
            operands = (*ms, *vs, *gs, *ps)
        if not gs:
            return None
        reason = _fused_blocker(operands, count, lr)
        if reason is not None:
            if required:
                raise cannot_run(reason)
            return None
        kernel = torch._fused_adam_ if weight_decay == 0.0 else torch._fused_adamw_
        step = count.to(torch.float32)  # the CUDA kernel reads steps as fp32

        def run(us, gs, ms, vs):
            kernel(
                us, gs, ms, vs, [], [step] * len(gs), lr=lr, beta1=b1, beta2=b2,
                weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
            )  # fmt: skip

        decoupled = weight_decay != 0.0
        if apply and donated is None:  # nothing fits: the new moments are new tensors
            donated = ([None] * len(gs), [None] * len(gs))
        if apply and decoupled and gs[0].is_cpu and adamw_step_runs(gs[0].dtype, b1):
            new_ms, new_vs = (
                [buffer_like(d, x) for x, d in zip(xs, ds, strict=True)]
                for xs, ds in zip((ms, vs), donated, strict=True)
            )
            # the table's kernel without fn.kernels.adamw_step's checks: _fused_blocker did them
            device_kernel("cpu", "adamw_step")(
                ps, gs, ms, vs, new_ms, new_vs, float(step), float(lr), b1, b2, eps, weight_decay
            )
            return new_ms, new_vs, [None] * len(gs)
        if apply and not decoupled and gs[0].dtype in (torch.float32, torch.float64):
            new_ms, new_vs = (
                _donated_copies(*pair) for pair in zip((ms, vs), donated, strict=True)
            )
            run(ps, gs, new_ms, new_vs)
            return new_ms, new_vs, [None] * len(gs)
        if apply or (donated is not None and can_donate(*gs)):
            return _fused_in_pieces(run, ms, vs, gs, ps, *donated, decoupled=decoupled, apply=apply)
        new_ms = [m.clone() for m in ms]
        new_vs = [v.clone() for v in vs]
        us = [torch.zeros_like(g) for g in gs] if weight_decay == 0.0 else [p.clone() for p in ps]
        run(us, gs, new_ms, new_vs)
        if weight_decay != 0.0:
            torch._foreach_sub_(us, ps)
        return new_ms, new_vs, us

    return moments_step


# The donated fused step runs the kernel on pieces of at most _PIECE elements of each leaf, up to
# _WORKSPACE elements per call, with a per-thread workspace of _WORKSPACE elements per dtype and
# device (4 MiB in fp32) taking the "param" that the kernel updates in place: small enough to stay
# in cache, so each piece's update is copied into the gradient's tensor (or added to the param)
# at cache speed. Pieces start at multiples of _PIECE in their leaf, so the kernel splits every
# leaf into vectors and a scalar tail where it does without pieces: the same bits.
_PIECE = 1 << 18
_WORKSPACE = 1 << 20
_workspaces = threading.local()


def _workspace(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's workspace of ``_WORKSPACE`` elements for ``dtype`` on ``device``."""
    cache = _workspaces.__dict__.setdefault("buffers", {})
    buffer = cache.get((dtype, device))
    if buffer is None or buffer.numel() < _WORKSPACE:
        buffer = cache[(dtype, device)] = torch.empty(_WORKSPACE, dtype=dtype, device=device)
    return buffer


def _batches(gs):
    """The pieces ``(leaf, start, stop)`` of the leaves ``gs``, ``_PIECE`` elements at most and
    starting at multiples of it, grouped into batches of at most ``_WORKSPACE`` elements."""
    batch, size = [], 0
    for i, g in enumerate(gs):
        for start in range(0, g.numel(), _PIECE):
            stop = min(g.numel(), start + _PIECE)
            if size + stop - start > _WORKSPACE:
                yield batch
                batch, size = [], 0
            batch.append((i, start, stop))
            size += stop - start
    if batch:
        yield batch


def _piece(t, start, stop):
    """Elements ``start:stop`` of the contiguous ``t``: ``t`` itself when that is all of it."""
    return t if stop - start == t.numel() else t.view(-1)[start:stop]


def _fused_in_pieces(run, ms, vs, gs, ps, dms, dvs, *, decoupled, apply):
    """The fused step of :func:`_fused_adam_step` without a full-size temporary: the new
    moments in the donated ones (in place where they are the same tensors; copied piece by
    piece into the others; new tensors where none fits), the updates in the gradients' tensors
    (read by the kernel first), or, with ``apply``, added to the params ``ps`` in place (the
    gradients only read; the updates returned are ``None``). ``run(us, gs, ms, vs)`` calls the
    kernel; ``decoupled``: AdamW (the kernel's "param" starts as a copy of the params and the
    update is ``p' - p``), else Adam (it starts at zero and the update is ``0 - step``)."""
    new_ms = [buffer_like(d, m) for m, d in zip(ms, dms, strict=True)]
    new_vs = [buffer_like(d, v) for v, d in zip(vs, dvs, strict=True)]
    workspace = _workspace(gs[0].dtype, gs[0].device)
    for batch in _batches(gs):
        g, m, v = ([_piece(x[i], a, b) for i, a, b in batch] for x in (gs, new_ms, new_vs))
        moved = [
            (_piece(new[i], a, b), _piece(old[i], a, b))
            for new, old in ((new_ms, ms), (new_vs, vs))
            for i, a, b in batch
            if new[i] is not old[i]
        ]
        if moved:
            torch._foreach_copy_([n for n, _ in moved], [o for _, o in moved])
        size = sum(b - a for _, a, b in batch)
        sizes = [x.numel() for x in g]
        work = [w.view_as(x) for w, x in zip(workspace[:size].split(sizes), g, strict=True)]
        if decoupled or apply:
            p = [_piece(ps[i], a, b) for i, a, b in batch]
        if decoupled:
            torch._foreach_copy_(work, p)
        else:
            workspace[:size].zero_()
        run(work, g, m, v)
        if decoupled:
            torch._foreach_sub_(work, p)
        if apply:
            torch._foreach_add_(p, work)
        else:
            torch._foreach_copy_(g, work)
    return new_ms, new_vs, ([None] * len(gs) if apply else list(gs))


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
        ValueError: for an unknown ``implementation``.

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
    apply_adam_then_lr = adam_then_lr.fast_step

    def init_fn(params):
        return (decay.init(params), *adam_then_lr.init(params))

    def step(updates, state, params, donate, extra, apply):
        if len(state) != 3:
            raise ValueError(f"adam: expected a state of 3 entries, got {len(state)}")
        donated = split_donated("adam", donate, 3)
        updates, decay_state = decay.update(updates, state[0], params, donate=donated[0])
        if donate is not None:
            extra["donate"] = donate if isinstance(donate, bool) else tuple(donated[1:])
        rest_step = apply_adam_then_lr if apply else adam_then_lr.update
        out, rest = rest_step(updates, tuple(state[1:]), params, **extra)
        return out, (decay_state, *rest)

    update_fn, fast_step = _update_functions(step)
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
    update and ``apply_updates`` as one step that writes the params in place, reading and
    writing the params and moments once: where the fused kernel runs, on fp32/fp64 CPU tensors
    :func:`fn.kernels.adamw_step` (a C kernel computing torch's ``p'`` and ``p + (p' - p)`` in
    one pass), else the fused kernel on a small workspace, ``p + (p' - p)`` computed there as
    ``apply_updates`` does.

    Reference: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.

    Args:
        lr: learning rate ``eta`` (float or schedule; in the state as ``lr``).
        betas: ``(beta1, beta2)``.
        eps: denominator term ``epsilon``.
        weight_decay: decoupled decay coefficient ``lambda``.
        implementation: ``"auto"``, ``"fused"``, ``"foreach"`` or ``"chain"`` (see
            :func:`adam`).

    Returns:
        A GradientTransformation with the chain's state,
        ``(ScaleByAdamState, ScaleByLearningRateState)``; ``update`` needs ``params``.

    Raises:
        ValueError: for an unknown ``implementation``.

    Example:
        >>> import torch, fn
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> tx = fn.adamw(lr=0.1, weight_decay=0.5)
        >>> updates, state = tx.update({"w": torch.tensor([0.5, -0.25])}, tx.init(params), params)
        >>> fn.apply_updates(params, updates)["w"]  # (1 - 0.1 * 0.5) * p - 0.1 * sign(g)
        tensor([ 0.8500, -1.8000])
    """
    return _scale_by_adam_then_lr("adamw", lr, betas, eps, weight_decay, implementation)
