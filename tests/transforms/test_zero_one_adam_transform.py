from __future__ import annotations

import pytest
import torch

import fn
from fn.collectives import Local, Simulated, replicate, simulate
from fn.transforms._onebit_schedules import ZeroOneAdamSchedule
from tests.transforms._onebit_harness import (
    assert_trajectories_close,
    make_grads,
    make_params,
    run_fn,
    run_reference,
)
from tests.transforms._onebit_reference import ZeroOneAdamReference

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
# var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper: variance refreshes at
# t = 1, 2, 3, 5, 7, 11, 1-bit steps at 4, 6, 8, 9, 10, 12, syncs at 13, 14, 15, 17, 19, 23, 27
SCHED = (12, 2, 3, 4)


def make(comm, wd=0.0, mask=None):
    # DeepSpeed's exact rule (safeguard=False), which the reference implements
    return fn.zero_one_adam(
        LR, BETAS, EPS, wd, *SCHED, comm=comm, exp_avg_mask=mask, safeguard=False
    )


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_single_worker_matches_reference(wd):
    params = make_params()
    grads = make_grads(params, 1, 50)
    got, _ = run_fn(lambda c: make(c, wd), params, grads, world=1)
    ref = ZeroOneAdamReference(params, 1, LR, BETAS, EPS, wd, *SCHED)
    assert_trajectories_close(got, run_reference(ref, params, grads, 1), atol=2e-6)
    assert set(ref.log) == {"var", "onebit", "local", "sync"}


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks_match_reference(world):
    params = make_params()
    grads = make_grads(params, world, 30)
    mask = {"w": None, "b": None, "big": (torch.arange(40).view(4, 10) % 3 != 0).float()}
    got, state = run_fn(lambda c: make(c, 0.01, mask), params, grads, world)
    ref = ZeroOneAdamReference(params, world, LR, BETAS, EPS, 0.01, *SCHED, mask=mask)
    want = run_reference(ref, params, grads, world)
    assert_trajectories_close(got, want, atol=2e-6)
    schedule = ZeroOneAdamSchedule(*SCHED)
    for t, ranks in enumerate(got, start=1):
        # variance and 1-bit steps keep the ranks equal; local steps let them drift; a sync
        # brings them together again, up to fp32 rounding (p - a is the synchronized point only
        # up to rounding, as in DeepSpeed)
        for p in ranks[1:]:
            for k in p:
                if not schedule.frozen(t):
                    assert torch.equal(p[k], ranks[0][k]), (t, k)
                elif schedule.is_sync_step(t):
                    torch.testing.assert_close(p[k], ranks[0][k], atol=1e-6, rtol=0)
                else:
                    assert not torch.allclose(p[k], ranks[0][k], atol=1e-5), (t, k)
    # the counters in the state mirror the reference's per-leaf counters
    s = ref.s["w"]
    assert int(state.var_interval[0]) == s["var_interval"]
    assert int(state.var_counter[0]) == s["var_counter"]
    assert int(state.local_interval[0]) == s["local_interval"]
    assert int(state.local_counter[0]) == s["local_counter"]
    assert bool(state.frozen[0]) and float(state.lrs[0]) == pytest.approx(s["lrs"])


def test_state_counters_mirror_schedule():
    schedule = ZeroOneAdamSchedule(*SCHED)
    params = make_params()
    opt = make(Local())
    state = opt.init(params)
    for t, g in enumerate(make_grads(params, 1, 30), start=1):
        _, state = opt.update(g[0], state, params, step=t)
        after = schedule.counters(t + 1)
        got = (state.var_interval, state.var_counter, state.local_interval, state.local_counter)
        assert tuple(int(x) for x in got) == after[:4]
        assert bool(state.frozen) == after.frozen
        assert int(state.count) == t


def test_phase_dispatch_and_wrong_phase():
    opt = make(Local())
    assert [t for t in range(1, 14) if not opt.is_compressed(t)] == [1, 2, 3, 5, 7, 11]
    params = make_params()
    state = opt.init(params)
    g = make_grads(params, 1, 1)[0][0]
    with pytest.raises(ValueError, match="not a compressed update"):
        opt.compressed_update(g, state, params, step=1)
    with pytest.raises(ValueError, match="not a variance"):
        opt.warmup_update(g, state, params, step=4)


def test_errors_zeroed_when_variance_freezes():
    world = 2
    comm = Simulated(world)
    params = make_params()
    opt = make(comm)
    state, p = replicate(opt.init(params), comm), replicate(params, comm)
    update = simulate(opt.update, comm)
    for t, g in enumerate(make_grads(params, world, 12), start=1):
        stacked = {k: torch.stack([g[r][k] for r in range(world)]) for k in params}
        updates, state = update(stacked, state, p, step=t)
        p = fn.apply_updates(p, updates)
        errors = fn.tree.tree_leaves((state.worker_error, state.server_error))
        if t == 11:
            assert any(bool(e.abs().sum() > 0) for e in errors)
    assert all(bool((e == 0).all()) for e in errors)


def test_exp_avg_mask_keeps_masked_momentum_zero():
    """Gradients that are exactly zero on some elements (unused embedding rows): without a mask
    the 1-bit steps give them non-zero momentum; with the mask it stays exactly zero."""
    world = 4
    comm = Simulated(world)
    params = {"emb": torch.randn(6, 4)}
    mask = {"emb": torch.zeros(6, 4)}
    mask["emb"][:4] = 1.0
    update_of = {}
    for masked in (True, False):
        opt = make(comm, mask=mask if masked else None)
        state, p = replicate(opt.init(params), comm), replicate(params, comm)
        update = simulate(opt.update, comm)
        for t in range(1, 30):
            g = torch.randn(world, 6, 4) * mask["emb"]
            updates, state = update({"emb": g}, state, p, step=t)
            p = fn.apply_updates(p, updates)
        update_of[masked] = state.exp_avg["emb"][:, 4:]
    assert torch.all(update_of[True] == 0)
    assert torch.any(update_of[False] != 0)


def test_none_and_empty_leaves():
    world = 2
    comm = Simulated(world)
    params = {"a": torch.randn(6), "frozen": torch.randn(3), "empty": torch.zeros(0)}
    opt = make(comm, wd=0.1)
    state0 = replicate(opt.init(params), comm)
    state, p = state0, replicate(params, comm)
    update = simulate(opt.update, comm)
    for t in range(1, 20):
        grads = {"a": torch.randn(world, 6), "frozen": None, "empty": torch.zeros(world, 0)}
        updates, state = update(grads, state, p, step=t)
        assert updates["frozen"] is None and updates["empty"].shape == (world, 0)
        p = fn.apply_updates(p, updates)
    assert torch.equal(p["frozen"], replicate(params, comm)["frozen"])
    for field in ("exp_avg", "exp_avg_sq", "momentum_accumulator"):
        assert torch.equal(getattr(state, field)["frozen"], getattr(state0, field)["frozen"])
    assert all(torch.isfinite(x).all() for x in fn.tree.tree_leaves(state))


@pytest.mark.parametrize("step", [1, 4, 16])  # variance, 1-bit, local
@pytest.mark.parametrize("world", [1, 2])
def test_non_finite_gradient_raises(step, world):
    comm = Local() if world == 1 else Simulated(world)
    params = {"a": torch.randn(5)}
    opt = make(comm)
    grads = {"a": torch.randn(world, 5)}
    grads["a"][world - 1, 2] = float("inf")
    state = opt.init(params) if world == 1 else replicate(opt.init(params), comm)
    before = [x.clone() for x in fn.tree.tree_leaves(state)]
    with pytest.raises(ValueError, match="non-finite"):
        if world == 1:
            opt.update({"a": grads["a"][0]}, state, params, step=step)
        else:
            simulate(opt.update, comm)(grads, state, replicate(params, comm), step=step)
    assert all(torch.equal(a, b) for a, b in zip(before, fn.tree.tree_leaves(state), strict=True))


def test_lr_schedule_accumulates_into_lrs():
    params = make_params()
    opt = fn.zero_one_adam(lambda c: 1e-2 / (1 + c.float()), BETAS, EPS, 0.0, *SCHED, comm=Local())
    state = opt.init(params)
    for t, g in enumerate(make_grads(params, 1, 16), start=1):
        _, state = opt.update(g[0], state, params, step=t)
        assert state.lr.item() == pytest.approx(1e-2 / t)
    # t = 16 is a local step after the sync at 15: lrs holds its learning rate only
    assert state.lrs.item() == pytest.approx(1e-2 / 16)
