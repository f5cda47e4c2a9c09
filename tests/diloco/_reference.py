"""DiLoCo's outer step written plainly, one worker after the other, from docs/algorithms.md
("DiLoCo: local steps and a compressed outer step"): the references the tests compare fn.diloco
and its collectives with.

Every value is fp32 and every operation is spelled out in the order the section gives, so that
fn must match these bit for bit. The one exception is Nesterov's ``g + mu * b``: both fn.sgd and
``torch.optim.SGD`` compute it as ``torch.add(g, b, alpha=mu)``, one fused multiply-add on the
CPU (one rounding where ``mu * b`` then ``+ g`` round twice), and the reference does the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def cast_mean(xs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The mean of the workers' ``xs`` sent as ``dtype``: each rounded to ``dtype``, summed in
    fp32 from zero worker by worker, divided by ``W`` and rounded to ``dtype``; returned in the
    first input's dtype."""
    total = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        total = total + x.to(dtype).float()
    return (total / len(xs)).to(dtype).to(xs[0].dtype)


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
    xs: list[torch.Tensor], errors: list[torch.Tensor], k: int, chunk_size: int, decay: float
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One call of the top-k allreduce on every worker: the mean (the same for all) and each
    worker's new error."""
    vs = [e * decay + x.float() for x, e in zip(xs, errors, strict=True)]
    cs = [topk_code(v, k, chunk_size) for v in vs]
    total = torch.zeros(xs[0].shape, dtype=torch.float32)
    for c in cs:
        total = total + c
    return total / len(xs), [v - c for v, c in zip(vs, cs, strict=True)]


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
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[torch.Tensor]]:
    """One call of the owner-partitioned top-k allreduce on every worker: ``xs[r]`` and
    ``errors[r]`` are worker ``r``'s leaves and errors, ``server_errors[j]`` owner ``j``'s
    (``[m C]``). Returns the result's leaves (the same for all), every worker's new errors and
    every owner's new server error.

    Each worker sends ``T(v_r)``; the mean of the ``W`` in worker order is cut into the chunks
    of the leaves (each leaf padded to whole chunks, then empty chunks up to ``W m``), owner
    ``j`` takes chunks ``j m .. (j + 1) m - 1``, adds its server error, sends ``T`` of that and
    keeps the rest (zero where a position is a leaf's padding or an appended chunk)."""
    world_size = len(xs)
    vs = [
        [e * decay + x.float() for x, e in zip(xr, er, strict=True)]
        for xr, er in zip(xs, errors, strict=True)
    ]
    cs = [[topk_code(v, k, chunk_size) for v in vr] for vr in vs]
    means = []
    for leaf in range(len(xs[0])):
        total = torch.zeros(xs[0][leaf].shape, dtype=torch.float32)
        for r in range(world_size):
            total = total + cs[r][leaf]
        means.append(total / world_size)
    share = server_errors[0].numel() // chunk_size
    rows = _rows(means, chunk_size, world_size * share)
    valid = _rows([torch.ones(x.shape) for x in xs[0]], chunk_size, world_size * share) > 0
    sent, new_server = [], []
    for j in range(world_size):
        mine = slice(j * share, (j + 1) * share)
        s = rows[mine] + server_errors[j].view(share, chunk_size)
        c = topk_code(s.reshape(-1), k, chunk_size).view(share, chunk_size)
        sent.append(c)
        new_server.append(torch.where(valid[mine], s - c, 0.0).reshape(-1))
    result = torch.cat(sent).reshape(-1)
    out, start = [], 0
    for x in xs[0]:
        out.append(result[start : start + x.numel()].view(x.shape))
        start += -(-x.numel() // chunk_size) * chunk_size
    new_errors = [
        [v - c for v, c in zip(vr, cr, strict=True)] for vr, cr in zip(vs, cs, strict=True)
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
    outer: Callable[[int, list[torch.Tensor]], torch.Tensor],
) -> list[list[list[torch.Tensor]]]:
    """Streaming DiLoCo over a loop of workers, from the section's "Streaming fragments and
    delay": ``workers[r]`` are worker ``r``'s parameters (changed in place), ``inner_step(r, t)``
    takes worker ``r``'s inner step ``t`` (from 0), and ``outer(j, deltas)`` is the anchor's
    update of parameter ``j`` from the workers' pseudo-gradients (it keeps its own outer state).

    After inner step ``t`` (from 1), fragment ``p`` with ``t + delay = (p + 1) H / P (mod H)``
    takes its pseudo-gradients; fragment ``p`` with ``t = (p + 1) H / P (mod H)`` applies its
    outer step from them: the anchor moves, and every worker continues from
    ``(1 - mix) * anchor + mix * its own``, in fp32, unless some pseudo-gradient of the fragment
    is not finite: then the step is skipped (the outer state unchanged) and every worker
    continues from the anchor. Returns every worker's parameters after every inner step."""
    stride = sync_every // len(fragments)
    anchor = [x.detach().clone() for x in workers[0]]
    taken: dict[int, list[list[torch.Tensor]]] = {}
    out = []
    for t in range(1, steps + 1):
        for r in range(len(workers)):
            inner_step(r, t - 1)
        for p, fragment in enumerate(fragments):
            due = (p + 1) * stride % sync_every
            if (t + delay) % sync_every == due:
                taken[p] = [
                    [anchor[j].float() - w[j].detach().float() for j in fragment] for w in workers
                ]
            if t % sync_every != due:
                continue
            deltas = taken.pop(p)
            finite = all(bool(d.isfinite().all()) for per_worker in deltas for d in per_worker)
            for k, j in enumerate(fragment):
                if finite:
                    update = outer(j, [per_worker[k] for per_worker in deltas])
                    anchor[j] = (anchor[j] + update).to(anchor[j].dtype)
                for w in workers:
                    with torch.no_grad():
                        if finite and mix > 0:
                            w[j].copy_(anchor[j].float() * (1.0 - mix) + w[j].float() * mix)
                        else:
                            w[j].copy_(anchor[j])
        out.append([[x.detach().clone() for x in w] for w in workers])
    return out


def nesterov_outer(lr: float, momentum: float) -> Callable[[int, list[torch.Tensor]], torch.Tensor]:
    """``outer`` for :func:`streaming_run`: Nesterov SGD on the exact mean, a momentum per
    parameter."""
    b: dict[int, torch.Tensor] = {}

    def update(j: int, deltas: list[torch.Tensor]) -> torch.Tensor:
        mean = cast_mean(deltas, torch.float32)
        b[j] = b.get(j, torch.zeros_like(mean)) * momentum + mean
        return torch.add(mean, b[j], alpha=momentum) * torch.tensor(-lr)

    return update


def sparseloco_outer(
    lr: float, beta: float, k: int, chunk_size: int
) -> Callable[[int, list[torch.Tensor]], torch.Tensor]:
    """``outer`` for :func:`streaming_run`: SparseLoCo, an accumulator per worker and
    parameter."""
    errors: dict[int, list[torch.Tensor]] = {}

    def update(j: int, deltas: list[torch.Tensor]) -> torch.Tensor:
        kept = errors.get(j, [torch.zeros_like(d) for d in deltas])
        mean, errors[j] = topk_allreduce(deltas, kept, k, chunk_size, beta)
        return mean * torch.tensor(-lr)

    return update
