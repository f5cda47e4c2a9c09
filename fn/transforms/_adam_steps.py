"""The in-place steps of the Adam family: the donated updates (``update(..., donate=...)``) and
the fast steps (``fn.update_and_apply``), each a straight loop over the live leaves.

Each computes, with the same ops and rounding, what its pure counterpart in
:mod:`fn.transforms.adam_transform` computes, but writes the new moments into the donated ones
(``dms``, ``dvs``: a donated tensor per leaf, ``None`` or one that does not fit gives a new
tensor) and the updates into the gradients' tensors, or, in the fast steps, adds them to the
params. ``run(ps, gs, ms, vs)`` is one ``torch._fused_adam_`` / ``torch._fused_adamw_`` call
that updates ``ps``, ``ms`` and ``vs`` in place.
"""

from __future__ import annotations

import threading

import torch

from fn.tree import buffer_like

# The fused steps that must not write the params run the kernel on pieces of at most _PIECE
# elements of each leaf, up to _WORKSPACE elements per call, with a per-thread workspace of
# _WORKSPACE elements per dtype and device (4 MiB in fp32) taking the "param" that the kernel
# updates in place: small enough to stay in cache, so each piece's update is copied into the
# gradient's tensor (or added to the param) at cache speed. Pieces start at multiples of _PIECE
# in their leaf, so the kernel splits every leaf into vectors and a scalar tail where it does
# without pieces: the same bits.
_PIECE = 1 << 18
_WORKSPACE = 1 << 20
_workspaces = threading.local()


def donated_copies(xs, donated):
    """``xs`` copied into the donated tensors (a new tensor where one does not fit; no copy
    where it is the same tensor)."""
    outs = [buffer_like(d, x) for x, d in zip(xs, donated, strict=True)]
    pairs = [(o, x) for o, x in zip(outs, xs, strict=True) if o is not x]
    if pairs:
        torch._foreach_copy_([o for o, _ in pairs], [x for _, x in pairs])
    return outs


def adam_direction_(us, ms, eps, bc1, bc2_sqrt):
    """``us = ms / (us * (bc1 / bc2_sqrt) + bc1 * eps)`` in place (``us`` holds ``sqrt(v)``;
    without bias correction, ``bc1 = None``: ``ms / (us + eps)``): the end of the foreach
    Adam step, shared by the pure and the donated one."""
    if bc1 is None:
        torch._foreach_add_(us, eps)
    else:
        # sqrt(v) / bc2_sqrt + eps, scaled by bc1 so that m needs no division by bc1.
        torch._foreach_mul_(us, bc1 / bc2_sqrt)
        torch._foreach_add_(us, bc1 * eps)
    for m, u in zip(ms, us, strict=True):
        torch.div(m, u, out=u)
    return us


def adam_foreach_donated(ms, vs, gs, dms, dvs, b1, b2, eps, bc1, bc2_sqrt):
    """The foreach Adam step with the new moments in the donated ones and the updates in the
    gradients' tensors (once the moments have read them)."""
    new_ms, new_vs = donated_copies(ms, dms), donated_copies(vs, dvs)
    torch._foreach_lerp_(new_ms, gs, 1.0 - b1)
    torch._foreach_mul_(new_vs, b2)
    torch._foreach_addcmul_(new_vs, gs, gs, value=1.0 - b2)
    torch._foreach_copy_(gs, new_vs)
    torch._foreach_sqrt_(gs)
    return new_ms, new_vs, adam_direction_(gs, new_ms, eps, bc1, bc2_sqrt)


def adam_leafwise_donated(ms, vs, gs, dms, dvs, b1, b2, eps, bc1, bc2_sqrt):
    """The per-leaf Adam rule written with ``out=`` and in place: the new moments in the
    donated ones, the updates in the gradients' tensors (once the moments have read them)."""
    new_ms, new_vs, us = [], [], []
    for m, v, g, dm, dv in zip(ms, vs, gs, dms, dvs, strict=True):
        new_m = torch.lerp(m, g, 1.0 - b1, out=buffer_like(dm, m))
        new_v = torch.mul(v, b2, out=buffer_like(dv, v)).addcmul_(g, g, value=1.0 - b2)
        u = torch.sqrt(new_v, out=g)
        if bc1 is None:
            u.add_(eps)
        else:
            u.mul_(bc1 / bc2_sqrt).add_(bc1 * eps)
        new_ms.append(new_m)
        new_vs.append(new_v)
        us.append(torch.div(new_m, u, out=u))
    return new_ms, new_vs, us


def fused_into_gradients(run, ms, vs, gs, ps, dms, dvs, decoupled):
    """The fused step's updates in the gradients' tensors without a full-size temporary: the
    kernel runs piece by piece on the workspace, started at zero (Adam: the update is
    ``0 - step``) or at a copy of the params (AdamW, ``decoupled``: the update is ``p' - p``)."""
    new_ms = [buffer_like(d, m) for m, d in zip(ms, dms, strict=True)]
    new_vs = [buffer_like(d, v) for v, d in zip(vs, dvs, strict=True)]
    for work, batch in _pieces(gs, ms, vs, new_ms, new_vs):
        g, m, v = ([_piece(x[i], a, b) for i, a, b in batch] for x in (gs, new_ms, new_vs))
        if decoupled:
            p = [_piece(ps[i], a, b) for i, a, b in batch]
            torch._foreach_copy_(work, p)
        else:
            torch._foreach_zero_(work)
        run(work, g, m, v)
        if decoupled:
            torch._foreach_sub_(work, p)
        torch._foreach_copy_(g, work)
    return new_ms, new_vs, list(gs)


def fused_onto_params(run, ms, vs, gs, ps, dms, dvs, decoupled):
    """The fast step: the fused kernel's step added to the params ``ps`` in place, the new
    moments in the donated ones, the gradients only read. AdamW (``decoupled``) and fp32/fp64
    Adam run the kernel on the params themselves (Adam's ``p - step`` is ``p + (0 - step)``
    exactly; AdamW's ``p'`` is ``p + (p' - p)`` wherever a step moves a param by less than
    half of it); fp16/bf16 Adam adds the rounded update ``0 - step`` piece by piece from the
    workspace, as ``apply_updates`` does."""
    if decoupled or gs[0].dtype in (torch.float32, torch.float64):
        new_ms, new_vs = donated_copies(ms, dms), donated_copies(vs, dvs)
        run(ps, gs, new_ms, new_vs)
        return new_ms, new_vs
    new_ms = [buffer_like(d, m) for m, d in zip(ms, dms, strict=True)]
    new_vs = [buffer_like(d, v) for v, d in zip(vs, dvs, strict=True)]
    for work, batch in _pieces(gs, ms, vs, new_ms, new_vs):
        g, m, v, p = ([_piece(x[i], a, b) for i, a, b in batch] for x in (gs, new_ms, new_vs, ps))
        torch._foreach_zero_(work)
        run(work, g, m, v)
        torch._foreach_add_(p, work)
    return new_ms, new_vs


def _pieces(gs, ms, vs, new_ms, new_vs):
    """For each batch of pieces ``(leaf, start, stop)`` of the leaves: the workspace views
    shaped as the pieces and the batch, once the pieces of the old moments are copied into the
    new ones that are other tensors."""
    workspace = _workspace(gs[0].dtype, gs[0].device)
    for batch in _batches(gs):
        moved = [
            (_piece(new[i], a, b), _piece(old[i], a, b))
            for new, old in ((new_ms, ms), (new_vs, vs))
            for i, a, b in batch
            if new[i] is not old[i]
        ]
        if moved:
            torch._foreach_copy_([n for n, _ in moved], [o for _, o in moved])
        sizes = [b - a for _, a, b in batch]
        work = workspace[: sum(sizes)].split(sizes)
        shaped = [w.view_as(_piece(gs[i], a, b)) for w, (i, a, b) in zip(work, batch, strict=True)]
        yield shaped, batch


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
