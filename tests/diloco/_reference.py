"""DiLoCo's outer step written plainly, one worker after the other, from docs/algorithms.md
("DiLoCo: local steps and a compressed outer step"): the references the tests compare fn.diloco
and its collectives with.

Every value is fp32 and every operation is spelled out in the order the section gives, so that
fn must match these bit for bit. The one exception is Nesterov's ``g + mu * b``: both fn.sgd and
``torch.optim.SGD`` compute it as ``torch.add(g, b, alpha=mu)``, one fused multiply-add on the
CPU (one rounding where ``mu * b`` then ``+ g`` round twice), and the reference does the same.

Participation: ``takes_part[r]`` says whether worker ``r`` takes part (``None``: every worker).
A mean is the sum over the participants only, divided by their number ``n``; a sitter's error
feedback stays as it was. The quantized and 1-bit compressors take fn.kernels' quantizer and
sign compressor as their primitives (tested against their own references in tests/kernels):
here the loop over workers, the messages, the sums and the divisor are spelled out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import fn.kernels as K
from fn.collectives import padded_numel, quantized_padded_numel


def _taking(takes_part: Sequence[bool] | None, world_size: int) -> list[bool]:
    return [True] * world_size if takes_part is None else [bool(t) for t in takes_part]


def cast_mean(
    xs: list[torch.Tensor], dtype: torch.dtype, takes_part: Sequence[bool] | None = None
) -> torch.Tensor:
    """The mean of the workers' ``xs`` sent as ``dtype``: each participant's rounded to
    ``dtype``, summed in fp32 from zero worker by worker, divided by ``n`` and rounded to
    ``dtype``; returned in the first input's dtype."""
    taking = _taking(takes_part, len(xs))
    total = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x, taken in zip(xs, taking, strict=True):
        if taken:
            total = total + x.to(dtype).float()
    return (total / sum(taking)).to(dtype).to(xs[0].dtype)


def topk_code(v: torch.Tensor, k: int, chunk_size: int) -> torch.Tensor:
    """``T(v)``: per chunk of ``chunk_size`` values (the last zero-padded), the ``k`` values of
    largest magnitude, ties to the lower position, as ``+-M/4`` or ``+-3M/4``; zero elsewhere."""
    flat = v.reshape(-1).float()
    out = torch.zeros_like(flat)
    for start in range(0, flat.numel(), chunk_size):
        chunk = flat[start : start + chunk_size].tolist()
        chunk += [0.0] * (chunk_size - len(chunk))
        order = sorted(range(chunk_size), key=lambda i: (-abs(chunk[i]), i))
        m = torch.tensor(max(abs(x) for x in chunk), dtype=torch.float32)
        for i in order[:k]:
            if start + i >= flat.numel():
                continue  # the padding: decoded, then dropped
            magnitude = m * 0.75 if abs(chunk[i]) > float(m * 0.5) else m * 0.25
            out[start + i] = -magnitude if chunk[i] < 0 else magnitude
    return out.view(v.shape)


def topk_allreduce(
    xs: list[torch.Tensor],
    errors: list[torch.Tensor],
    k: int,
    chunk_size: int,
    decay: float,
    takes_part: Sequence[bool] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One call of the top-k allreduce on every worker: the mean over the participants (the same
    for all) and each worker's new error (a sitter's as it was)."""
    taking = _taking(takes_part, len(xs))
    total = torch.zeros(xs[0].shape, dtype=torch.float32)
    new_errors = []
    for x, e, taken in zip(xs, errors, taking, strict=True):
        if not taken:
            new_errors.append(e)
            continue
        v = e * decay + x.float()
        c = topk_code(v, k, chunk_size)
        total = total + c
        new_errors.append(v - c)
    return total / sum(taking), new_errors


def quantized_allreduce(
    xs: list[torch.Tensor],
    bits: int,
    group_size: int,
    takes_part: Sequence[bool] | None = None,
    errors: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    err_beta: float = 0.0,
    reset: bool = False,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]] | None]:
    """One call of the quantized allreduce (one hop; with ``errors``, LoCo's): every
    participant quantizes its padded vector (plus its reduce-scatter error), worker ``j`` sums
    chunk ``j`` of the participants' dequantized vectors, divides by ``n``, and quantizes the
    mean (plus its all-gather error), which every worker dequantizes. Returns the mean and each
    worker's new ``(e_rs, e_ag)`` (a sitter's ``e_rs`` as it entered: zero at a ``reset``)."""
    world_size, n = len(xs), xs[0].numel()
    taking = _taking(takes_part, world_size)
    padded = quantized_padded_numel(n, world_size, group_size)
    chunk = padded // world_size
    entered = None
    if errors is not None:
        entered = [tuple(torch.zeros_like(e) if reset else e for e in pair) for pair in errors]
    pieces, new_rs = [], []
    for r, x in enumerate(xs):
        if not taking[r]:
            pieces.append(None)
            new_rs.append(None if entered is None else entered[r][0])
            continue
        v = torch.nn.functional.pad(x.reshape(-1).float(), (0, padded - n))
        error = None if entered is None else entered[r][0]
        d, new_error = _quantized(v, error, bits, group_size, err_beta)
        pieces.append(d)
        new_rs.append(new_error)
    out, new_ag = [], []
    for j in range(world_size):
        total = torch.zeros(chunk)
        for r in range(world_size):
            if taking[r]:
                total = total + pieces[r][j * chunk : (j + 1) * chunk]
        error = None if entered is None else entered[j][1]
        d, new_error = _quantized(total / sum(taking), error, bits, group_size, err_beta)
        out.append(d)
        new_ag.append(new_error)
    mean = torch.cat(out)[:n].view(xs[0].shape)
    return mean, None if errors is None else list(zip(new_rs, new_ag, strict=True))


def _quantized(
    v: torch.Tensor, error: torch.Tensor | None, bits: int, group_size: int, err_beta: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``DQ(Q(v + e))`` and LoCo's new error ``beta e + (1 - beta) (v + e - DQ(Q(v + e)))`` (no
    error: ``DQ(Q(v))``, ``None``)."""
    if error is not None:
        v = v + error
    q, scales = K.quantize(v, bits, group_size)
    d = K.dequantize(q, scales, bits, v.numel())
    return d, None if error is None else err_beta * error + (1 - err_beta) * (v - d)


def onebit_allreduce(
    xs: list[torch.Tensor],
    errors: list[tuple[torch.Tensor, torch.Tensor]],
    takes_part: Sequence[bool] | None = None,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One call of the error-compensated 1-bit allreduce (flat): every participant compresses
    ``x + e_w`` to signs and one scale (a sitter sends scale 0 and keeps ``e_w``); worker ``j``
    sums the signs of chunk ``j`` weighed by the scales over ``n`` in rank order, adds its
    ``e_s`` and compresses again; every worker unpacks every chunk. Returns the result and each
    worker's new ``(e_w, e_s)``."""
    world_size, n = len(xs), xs[0].numel()
    taking = _taking(takes_part, world_size)
    padded = padded_numel(n, world_size)
    chunk = padded // world_size
    signs, scales, new_worker = [], [], []
    for r, x in enumerate(xs):
        m = torch.nn.functional.pad(x.reshape(-1).float(), (0, padded - n))
        packed, scale, error = K.sign_compress(
            m if taking[r] else torch.zeros(padded), errors[r][0]
        )
        signs.append(K.unpackbits(packed, padded))
        scales.append(scale if taking[r] else torch.zeros(()))
        new_worker.append(error if taking[r] else errors[r][0])
    count = sum(taking)
    weights = torch.stack(scales) / (world_size if count == world_size else count)
    out, new_server = [], []
    for j in range(world_size):
        rows = torch.stack([s[j * chunk : (j + 1) * chunk] for s in signs])
        packed, scale, error = K.sign_compress(K.sum_ranks(rows * weights[:, None]), errors[j][1])
        out.append(K.unpackbits(packed, chunk) * scale)
        new_server.append(error)
    result = torch.cat(out)[:n].view(xs[0].shape)
    return result, list(zip(new_worker, new_server, strict=True))


def _rows(leaves: list[torch.Tensor], chunk_size: int, chunks: int) -> torch.Tensor:
    """The leaves flattened, each zero-padded to whole chunks, one after the other, with zero
    chunks appended up to ``chunks``: ``[chunks, C]``."""
    flat = []
    for x in leaves:
        x = x.reshape(-1)
        flat.append(torch.cat([x, x.new_zeros(-x.numel() % chunk_size)]))
    flat = torch.cat(flat)
    return torch.cat([flat, flat.new_zeros(chunks * chunk_size - flat.numel())]).view(
        -1, chunk_size
    )


def topk_owner_allreduce(
    xs: list[list[torch.Tensor]],
    errors: list[list[torch.Tensor]],
    server_errors: list[torch.Tensor],
    k: int,
    chunk_size: int,
    decay: float,
    takes_part: Sequence[bool] | None = None,
    server_k: int | None = None,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[torch.Tensor]]:
    """One call of the owner-partitioned top-k allreduce on every worker: ``xs[r]`` and
    ``errors[r]`` are worker ``r``'s leaves and errors, ``server_errors[j]`` owner ``j``'s
    (``[m C]``). Returns the result's leaves (the same for all), every worker's new errors (a
    sitter's as they were) and every owner's new server error.

    Each worker that takes part sends ``T(v_r)``; their mean (in worker order, over the
    participants) is cut into the chunks of the leaves (each leaf padded to whole chunks, then
    empty chunks up to ``W m``); owner ``j`` (a sitter too) takes chunks ``j m .. (j + 1) m -
    1``, adds its server error, sends ``T`` of that (``server_k`` values a chunk, ``None``:
    ``k``) and keeps the rest (zero where a position is
    a leaf's padding or an appended chunk)."""
    world_size = len(xs)
    taking = _taking(takes_part, world_size)
    vs = [
        [e * decay + x.float() for x, e in zip(xr, er, strict=True)]
        for xr, er in zip(xs, errors, strict=True)
    ]
    cs = [[topk_code(v, k, chunk_size) for v in vr] for vr in vs]
    means = []
    for leaf in range(len(xs[0])):
        total = torch.zeros(xs[0][leaf].shape, dtype=torch.float32)
        for r in range(world_size):
            if taking[r]:
                total = total + cs[r][leaf]
        means.append(total / sum(taking))
    share = server_errors[0].numel() // chunk_size
    rows = _rows(means, chunk_size, world_size * share)
    valid = _rows([torch.ones(x.shape) for x in xs[0]], chunk_size, world_size * share) > 0
    sent, new_server = [], []
    for j in range(world_size):
        mine = slice(j * share, (j + 1) * share)
        s = rows[mine] + server_errors[j].view(share, chunk_size)
        c = topk_code(s.reshape(-1), server_k or k, chunk_size).view(share, chunk_size)
        sent.append(c)
        new_server.append(torch.where(valid[mine], s - c, 0.0).reshape(-1))
    result = torch.cat(sent).reshape(-1)
    out, start = [], 0
    for x in xs[0]:
        out.append(result[start : start + x.numel()].view(x.shape))
        start += -(-x.numel() // chunk_size) * chunk_size
    new_errors = [
        [v - c for v, c in zip(vr, cr, strict=True)] if taken else er
        for vr, cr, er, taken in zip(vs, cs, errors, taking, strict=True)
    ]
    return out, new_errors, new_server


def nesterov_steps(
    anchor: torch.Tensor, workers: list[list[torch.Tensor]], lr: float, momentum: float
) -> list[torch.Tensor]:
    """DiLoCo with an exact mean: ``workers[s][r]`` is worker ``r``'s params before outer step
    ``s``; returns the anchor after every step."""
    b = torch.zeros_like(anchor)
    lr_ = torch.tensor(-lr)
    out = []
    for params in workers:
        deltas = [anchor - p for p in params]
        mean = cast_mean(deltas, torch.float32)
        b = b * momentum + mean
        anchor = anchor + torch.add(mean, b, alpha=momentum) * lr_
        out.append(anchor)
    return out


def sparseloco_steps(
    anchor: torch.Tensor,
    workers: list[list[torch.Tensor]],
    lr: float,
    beta: float,
    k: int,
    chunk_size: int,
) -> list[torch.Tensor]:
    """SparseLoCo: ``e_r = beta e_r + delta_r``, each worker sends ``T(e_r)`` and keeps the rest,
    the anchor moves by ``-lr`` times the mean of what was sent."""
    errors = [torch.zeros_like(anchor) for _ in workers[0]]
    out = []
    for params in workers:
        deltas = [anchor - p for p in params]
        mean, errors = topk_allreduce(deltas, errors, k, chunk_size, beta)
        anchor = anchor + mean * torch.tensor(-lr)
        out.append(anchor)
    return out


def streaming_run(
    workers: list[list[torch.Tensor]],
    inner_step: Callable[[int, int], None],
    *,
    steps: int,
    sync_every: int,
    fragments: list[list[int]],
    delay: int,
    mix: float,
    outer: Callable[[int, list[torch.Tensor], list[bool]], torch.Tensor],
    takes_part: Callable[[int, int], bool] = lambda r, p: True,
    reset: Callable[[int], None] = lambda r: None,
) -> list[list[list[torch.Tensor]]]:
    """Streaming DiLoCo over a loop of workers, from the section's "Streaming fragments and
    delay" and its participation: ``workers[r]`` are worker ``r``'s parameters (changed in
    place), ``inner_step(r, t)`` takes worker ``r``'s inner step ``t`` (from 0), and
    ``outer(j, deltas, taking)`` is the anchor's update of parameter ``j`` from the workers'
    pseudo-gradients and who takes part (it keeps its own outer state).

    After inner step ``t`` (from 1), fragment ``p`` with ``t + delay = (p + 1) H / P (mod H)``
    takes its pseudo-gradients, and worker ``r`` takes part where ``takes_part(r, p)`` (its
    inner optimizer's state finite) and all its pseudo-gradients of the fragment are finite;
    fragment ``p`` with ``t = (p + 1) H / P (mod H)`` applies its outer step from them: where
    some worker takes part the anchor moves, and every participant continues from
    ``(1 - mix) * anchor + mix * its own``, in fp32; every sitter's parameters, of every
    fragment, become their anchors and ``reset(r)`` restarts its inner optimizer. Returns every
    worker's parameters after every inner step."""
    stride = sync_every // len(fragments)
    anchor = [x.detach().clone() for x in workers[0]]
    taken: dict[int, tuple[list[list[torch.Tensor]], list[bool]]] = {}
    out = []
    for t in range(1, steps + 1):
        for r in range(len(workers)):
            inner_step(r, t - 1)
        for p, fragment in enumerate(fragments):
            due = (p + 1) * stride % sync_every
            if (t + delay) % sync_every == due:
                deltas = [
                    [anchor[j].float() - w[j].detach().float() for j in fragment] for w in workers
                ]
                taking = [
                    takes_part(r, p) and all(bool(d.isfinite().all()) for d in deltas[r])
                    for r in range(len(workers))
                ]
                taken[p] = (deltas, taking)
            if t % sync_every != due:
                continue
            deltas, taking = taken.pop(p)
            for k, j in enumerate(fragment):
                if any(taking):
                    update = outer(j, [per_worker[k] for per_worker in deltas], taking)
                    anchor[j] = (anchor[j] + update).to(anchor[j].dtype)
                with torch.no_grad():
                    for w, taken_part in zip(workers, taking, strict=True):
                        if taken_part and mix > 0:
                            w[j].copy_(anchor[j].float() * (1.0 - mix) + w[j].float() * mix)
                        else:
                            w[j].copy_(anchor[j])
            for r, taken_part in enumerate(taking):
                if not taken_part:
                    with torch.no_grad():
                        for x, a in zip(workers[r], anchor, strict=True):
                            x.copy_(a)
                    reset(r)
        out.append([[x.detach().clone() for x in w] for w in workers])
    return out


def nesterov_outer(
    lr: float, momentum: float
) -> Callable[[int, list[torch.Tensor], list[bool]], torch.Tensor]:
    """``outer`` for :func:`streaming_run`: Nesterov SGD on the exact mean over the
    participants, a momentum per parameter."""
    b: dict[int, torch.Tensor] = {}

    def update(j: int, deltas: list[torch.Tensor], taking: list[bool]) -> torch.Tensor:
        mean = cast_mean(deltas, torch.float32, taking)
        b[j] = b.get(j, torch.zeros_like(mean)) * momentum + mean
        return torch.add(mean, b[j], alpha=momentum) * torch.tensor(-lr)

    return update


def sparseloco_outer(
    lr: float, beta: float, k: int, chunk_size: int
) -> Callable[[int, list[torch.Tensor], list[bool]], torch.Tensor]:
    """``outer`` for :func:`streaming_run`: SparseLoCo, an accumulator per worker and
    parameter (a sitter's kept)."""
    errors: dict[int, list[torch.Tensor]] = {}

    def update(j: int, deltas: list[torch.Tensor], taking: list[bool]) -> torch.Tensor:
        kept = errors.get(j, [torch.zeros_like(d) for d in deltas])
        mean, errors[j] = topk_allreduce(deltas, kept, k, chunk_size, beta, taking)
        return mean * torch.tensor(-lr)

    return update
