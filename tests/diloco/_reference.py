"""DiLoCo's outer step written plainly, one worker after the other, from docs/algorithms.md
("DiLoCo: local steps and a compressed outer step"): the references the tests compare fn.diloco
and its collectives with.

Every value is fp32 and every operation is spelled out in the order the section gives, so that
fn must match these bit for bit. The one exception is Nesterov's ``g + mu * b``: both fn.sgd and
``torch.optim.SGD`` compute it as ``torch.add(g, b, alpha=mu)``, one fused multiply-add on the
CPU (one rounding where ``mu * b`` then ``+ g`` round twice), and the reference does the same.
"""

from __future__ import annotations

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
