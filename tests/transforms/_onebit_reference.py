"""Readable references for the 1-bit family: plain loops over ranks and leaves, the rules of
docs/algorithms.md written out one line each, mutable per-rank state. Independent of ``fn``'s code
(its own compressed allreduce, padding and schedule counters)."""

from __future__ import annotations

import math

import torch


def padded(n: int, world: int) -> int:
    unit = world * math.lcm(world, 8)
    return -(-n // unit) * unit


def sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def car(xs: list[torch.Tensor], ews: list[torch.Tensor], ess: list[torch.Tensor]):
    """The error-compensated 1-bit allreduce over a list of ranks (docs/algorithms.md); updates
    the error lists in place and returns every rank's (equal) output. The identity for one
    rank."""
    world = len(xs)
    if world == 1:
        return [xs[0]]
    n = xs[0].numel()
    big_n = padded(n, world)
    chunk = big_n // world
    scales, signs = [], []
    for r in range(world):
        x = torch.zeros(big_n)
        x[:n] = xs[r].reshape(-1)
        m = x + ews[r]
        a = m.norm() / math.sqrt(big_n)
        ews[r] = m - a * sign(m)
        scales.append(a)
        signs.append(sign(m))
    out = []
    for r in range(world):
        c = torch.zeros(chunk)
        for i in range(world):
            c = c + scales[i] * signs[i][r * chunk : (r + 1) * chunk]
        c = c / world + ess[r]
        b = c.norm() / math.sqrt(chunk)
        ess[r] = c - b * sign(c)
        out.append(b * sign(c))
    y = torch.cat(out)[:n].view(xs[0].shape)
    return [y.clone() for _ in range(world)]


def mean(xs: list[torch.Tensor]) -> torch.Tensor:
    return sum(xs) / len(xs)


class OnebitAdamReference:
    def __init__(self, params, world, lr, freeze_step, betas, eps, wd, mask=None):
        self.world, self.lr, self.F, (self.b1, self.b2) = world, lr, freeze_step, betas
        self.eps, self.wd, self.mask = eps, wd, mask or {}
        self.m = {k: [torch.zeros_like(p) for _ in range(world)] for k, p in params.items()}
        self.v = {k: [torch.zeros_like(p) for _ in range(world)] for k, p in params.items()}
        self.ew = {k: [torch.zeros(padded(p.numel(), world))] * world for k, p in params.items()}
        self.es = {
            k: [torch.zeros(padded(p.numel(), world) // world)] * world for k, p in params.items()
        }

    def step(self, t, grads, params):
        """grads, params: per rank, dicts of tensors. Returns the new per-rank params."""
        new = [dict(p) for p in params]
        for k in params[0]:
            g = [grads[r][k] for r in range(self.world)]
            m, v = self.m[k], self.v[k]
            if t < self.F:
                gm = mean(g)
                for r in range(self.world):
                    m[r] = self.b1 * m[r] + (1 - self.b1) * gm
                    v[r] = self.b2 * v[r] + (1 - self.b2) * gm * gm
            else:
                for r in range(self.world):
                    m[r] = self.b1 * m[r] + (1 - self.b1) * g[r]
                if m[0].numel() > 0:
                    m[:] = car(m, self.ew[k], self.es[k])
                if self.mask.get(k) is not None:
                    m[:] = [x * self.mask[k] for x in m]
            for r in range(self.world):
                u = m[r] / (v[r].sqrt() + self.eps) + self.wd * params[r][k]
                new[r][k] = params[r][k] - self.lr * u
        return new


class ZeroOneAdamReference:
    """Per-leaf counters exactly as docs/algorithms.md (and DeepSpeed) keep them, c = t + 1."""

    def __init__(self, params, world, lr, betas, eps, wd, V, K, L, H, mask=None):
        self.world, self.lr, (self.b1, self.b2), self.eps, self.wd = world, lr, betas, eps, wd
        self.V, self.K, self.L, self.H, self.mask = V, K, L, H, mask or {}
        w = world
        self.s = {}
        for k, p in params.items():
            self.s[k] = {
                "m": [torch.zeros_like(p) for _ in range(w)],
                "v": [torch.zeros_like(p) for _ in range(w)],
                "a": [torch.zeros_like(p) for _ in range(w)],
                "ew": [torch.zeros(padded(p.numel(), w)) for _ in range(w)],
                "es": [torch.zeros(padded(p.numel(), w) // w) for _ in range(w)],
                "var_interval": 1,
                "var_counter": 0,
                "local_interval": 1,
                "local_counter": 0,
                "lrs": 0.0,
            }
        self.frozen = False
        self.errors_reset = False
        self.log = []  # per update: "var", "onebit", "local" or "sync"

    def _car(self, xs, s, mask):
        ys = car(xs, s["ew"], s["es"]) if xs[0].numel() > 0 else list(xs)
        return [y * mask for y in ys] if mask is not None else ys

    def step(self, t, grads, params):
        c = t + 1
        w = self.world
        new = [dict(p) for p in params]
        kind = None
        for k in params[0]:
            s = self.s[k]
            m, v, a = s["m"], s["v"], s["a"]
            g = [grads[r][k] for r in range(w)]
            mask = self.mask.get(k)
            var_step = False
            if not self.frozen:
                if c % s["var_interval"] == 0:
                    var_step = True
                    kind = "var"
                    gm = mean(g)
                    for r in range(w):
                        v[r] = self.b2 * v[r] + (1 - self.b2) * gm * gm
                        m[r] = self.b1 * m[r] + (1 - self.b1) * gm
                else:
                    kind = "onebit"
                    gc = self._car(g, s, mask)
                    for r in range(w):
                        m[r] = self.b1 * m[r] + (1 - self.b1) * gc[r]
            else:
                kind = "local"
                for r in range(w):
                    m[r] = self.b1 * m[r] + (1 - self.b1) * g[r]
                s["lrs"] += self.lr
            for r in range(w):
                u = m[r] / (v[r].sqrt() + self.eps) + self.wd * params[r][k]
                new[r][k] = params[r][k] - self.lr * u
                if self.frozen:
                    a[r] = a[r] - self.lr * u
            if self.frozen and c % s["local_interval"] == 0:
                kind = "sync"
                for r in range(w):
                    new[r][k] = new[r][k] - a[r]
                    a[r] = a[r] * (v[r].sqrt() + self.eps)
                a[:] = self._car(a, s, mask)
                for r in range(w):
                    m[r] = -a[r] / s["lrs"]
                    new[r][k] = new[r][k] + a[r] / (v[r].sqrt() + self.eps)
                    a[r] = torch.zeros_like(a[r])
                s["lrs"] = 0.0
            if not self.frozen:
                if var_step:
                    s["var_counter"] += 1
                    if s["var_counter"] == self.K:
                        s["var_counter"] = 0
                        s["var_interval"] *= 2
            else:
                s["local_counter"] += 1
                if s["local_counter"] == self.L:
                    s["local_counter"] = 0
                    s["local_interval"] = min(self.H, 2 * s["local_interval"])
        if c > self.V:
            self.frozen = True
        if self.frozen and not self.errors_reset:
            for s in self.s.values():
                s["ew"] = [torch.zeros_like(e) for e in s["ew"]]
                s["es"] = [torch.zeros_like(e) for e in s["es"]]
            self.errors_reset = True
        self.log.append(kind)
        return new


class OnebitLambReference:
    def __init__(self, params, world, lr, freeze_step, betas, eps, wd, coeffs, mask=None):
        self.world, self.lr, self.F, (self.b1, self.b2) = world, lr, freeze_step, betas
        self.eps, self.wd, self.mask = eps, wd, mask or {}
        (self.max_coeff, self.min_coeff, self.coeff_beta) = coeffs[:3]
        (self.factor_max, self.factor_min, self.factor_threshold) = coeffs[3:]
        w = world
        self.keys = list(params)
        self.m = {k: [torch.zeros_like(p) for _ in range(w)] for k, p in params.items()}
        self.v = {k: [torch.zeros_like(p) for _ in range(w)] for k, p in params.items()}
        self.vf = {k: [torch.zeros_like(p) for _ in range(w)] for k, p in params.items()}
        self.R = {k: [0.0] * w for k in params}
        self.last = {k: [1.0] * w for k in params}
        self.scaling = None
        total = sum(p.numel() for p in params.values())
        self.ew = [torch.zeros(padded(total, w)) for _ in range(w)]
        self.es = [torch.zeros(padded(total, w) // w) for _ in range(w)]

    def step(self, t, grads, params):
        w, b1, b2, eps = self.world, self.b1, self.b2, self.eps
        new = [dict(p) for p in params]
        if t < self.F:
            for k in self.keys:
                gm = mean([grads[r][k] for r in range(w)])
                for r in range(w):
                    m = self.m[k][r] = b1 * self.m[k][r] + (1 - b1) * gm
                    v = self.v[k][r] = b2 * self.v[k][r] + (1 - b2) * gm * gm
                    if t + 1 == self.F:
                        self.vf[k][r] = v.clone()
                    u = m / (v.sqrt() + eps) + self.wd * params[r][k]
                    ratio = 1.0
                    p_norm, u_norm = float(params[r][k].norm()), float(u.norm())
                    if p_norm != 0 and u_norm != 0:
                        ratio = p_norm / u_norm
                    ratio = min(max(ratio, self.min_coeff), self.max_coeff)
                    if ratio != 1.0:
                        beta = self.coeff_beta
                        self.R[k][r] = beta * self.R[k][r] + (1 - beta) * ratio
                    new[r][k] = params[r][k] - self.lr * ratio * u
            return new
        m_last = {k: [x.clone() for x in self.m[k]] for k in self.keys}
        if self.scaling is None:
            rms = {}
            for k in self.keys:
                rms[k] = float(self.m[k][0].norm()) / math.sqrt(self.m[k][0].numel())
            united = sum(rms.values()) / len(rms)
            self.scaling = {k: united / rms[k] for k in self.keys}
        fused = []
        for r in range(w):
            for k in self.keys:
                self.m[k][r] = (b1 * self.m[k][r] + (1 - b1) * grads[r][k]) * self.scaling[k]
            fused.append(torch.cat([self.m[k][r].reshape(-1) for k in self.keys]))
        fused = car(fused, self.ew, self.es)
        for r in range(w):
            offset = 0
            for k in self.keys:
                n = self.m[k][r].numel()
                m = fused[r][offset : offset + n].view_as(self.m[k][r]) / self.scaling[k]
                offset += n
                if self.mask.get(k) is not None:
                    m = m * self.mask[k]
                self.m[k][r] = m
                g_hat = (m - b1 * m_last[k][r]) / (1 - b1)
                vf = self.vf[k][r] = b2 * self.vf[k][r] + (1 - b2) * g_hat * g_hat
                d = self.v[k][r].sqrt() + eps
                u0 = m / d
                u = u0 + self.wd * params[r][k]
                f = float((d / (vf.sqrt() + eps)).max())
                if self.wd > 0:
                    q = min(1.0, float(u0.norm()) / float(u.norm()))
                    f = f * q + (1 - q)
                f = min(f, self.factor_max)
                f = max(f, self.factor_min)
                last = self.last[k][r]
                f = min(f, last * (1 + self.factor_threshold))
                f = max(f, last * (1 - self.factor_threshold))
                self.last[k][r] = f
                new[r][k] = params[r][k] - self.lr * self.R[k][r] * f * u
        return new
