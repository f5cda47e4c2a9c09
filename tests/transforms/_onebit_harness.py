"""Drives an fn optimizer and a reference over the same per-rank gradients."""

from __future__ import annotations

import torch

import fn
from fn.collectives import Local, Simulated, replicate, simulate

SHAPES = {"w": (5, 3), "b": (7,), "big": (4, 10)}  # 15, 7, 40 elements: all need padding


def make_params(shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=gen) for k, s in shapes.items()}


def make_grads(params, world, steps, seed=1):
    """grads[t - 1][r][name]: a shared drift plus rank noise, so the mean is not ~0."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        shared = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
        ranks = []
        for _ in range(world):
            noise = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}
            ranks.append({k: shared[k] + 0.5 * noise[k] for k in params})
        out.append(ranks)
    return out


def comm_for(world):
    return Local() if world == 1 else Simulated(world)


def run_fn(make_opt, params, grads, world):
    """Runs ``make_opt(comm)`` for ``len(grads)`` updates. Returns per step the per-rank params
    (a list of ``world`` dicts) and the final state."""
    comm = comm_for(world)
    opt = make_opt(comm)
    history = []
    if world == 1:
        state, p = opt.init(params), dict(params)
        for t, g in enumerate(grads, start=1):
            updates, state = opt.update(g[0], state, p, step=t)
            p = fn.apply_updates(p, updates)
            history.append([p])
        return history, state
    state, p = replicate(opt.init(params), comm), replicate(params, comm)
    update = simulate(opt.update, comm)
    for t, g in enumerate(grads, start=1):
        stacked = {k: torch.stack([g[r][k] for r in range(world)]) for k in params}
        updates, state = update(stacked, state, p, step=t)
        p = fn.apply_updates(p, updates)
        history.append([{k: x[r] for k, x in p.items()} for r in range(world)])
    return history, state


def check_exp_avg_mask_keeps_masked_momentum_zero(make_opt):
    """Runs ``make_opt(comm, mask)`` on 4 simulated ranks for 8 updates with a random 0/1
    ``exp_avg_mask``; after every compressed update the momentum is exactly zero where the mask
    is 0 and non-zero where it is 1."""
    world = 4
    comm = Simulated(world)
    params = make_params()
    mask = {
        k: (torch.rand(p.shape, generator=torch.Generator().manual_seed(3)) > 0.5).float()
        for k, p in params.items()
    }
    opt = make_opt(comm, mask)
    state, p = replicate(opt.init(params), comm), replicate(params, comm)
    update = simulate(opt.update, comm)
    for t, g in enumerate(make_grads(params, world, 8), start=1):
        stacked = {k: torch.stack([g[r][k] for r in range(world)]) for k in params}
        updates, state = update(stacked, state, p, step=t)
        p = fn.apply_updates(p, updates)
        if opt.is_compressed(t):
            momenta = simulate(lambda s: fn.transforms.momentum_of(s, mask), comm)(state)
            for k in params:
                assert torch.all(momenta[k][:, mask[k] == 0] == 0)
                assert torch.all(momenta[k][:, mask[k] == 1] != 0)


def run_reference(ref, params, grads, world):
    p = [dict(params) for _ in range(world)]
    history = []
    for t, g in enumerate(grads, start=1):
        p = ref.step(t, g, p)
        history.append(p)
    return history


def assert_trajectories_close(got, want, atol, rtol=1e-5):
    assert len(got) == len(want)
    for t, (ranks_got, ranks_want) in enumerate(zip(got, want, strict=True), start=1):
        for r, (pg, pw) in enumerate(zip(ranks_got, ranks_want, strict=True)):
            for k in pw:
                where = f"t={t} rank={r} {k}"
                torch.testing.assert_close(
                    pg[k], pw[k], atol=atol, rtol=rtol, msg=lambda m, w=where: f"{w}: {m}"
                )
