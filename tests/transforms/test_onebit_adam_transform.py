from __future__ import annotations

import pytest
import torch

import fn
from fn.collectives import Local, Simulated, replicate, simulate
from tests.transforms._onebit_harness import (
    assert_trajectories_close,
    check_exp_avg_mask_keeps_masked_momentum_zero,
    make_grads,
    make_params,
    run_fn,
    run_reference,
)
from tests.transforms._onebit_reference import OnebitAdamReference

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_single_worker_matches_reference(wd):
    params = make_params()
    grads = make_grads(params, 1, 50)
    got, _ = run_fn(
        lambda c: fn.onebit_adam(LR, 20, BETAS, EPS, wd, comm=c, safeguard=False),
        params,
        grads,
        world=1,
    )
    ref = OnebitAdamReference(params, 1, LR, 20, BETAS, EPS, wd)
    assert_trajectories_close(got, run_reference(ref, params, grads, 1), atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks_match_reference(world):
    params = make_params()
    grads = make_grads(params, world, 30)
    mask = {"w": None, "b": None, "big": (torch.arange(40).view(4, 10) % 3 != 0).float()}
    got, _ = run_fn(
        lambda c: fn.onebit_adam(
            LR, 10, BETAS, EPS, 0.01, comm=c, exp_avg_mask=mask, safeguard=False
        ),
        params,
        grads,
        world,
    )
    ref = OnebitAdamReference(params, world, LR, 10, BETAS, EPS, 0.01, mask=mask)
    want = run_reference(ref, params, grads, world)
    assert_trajectories_close(got, want, atol=1e-6)
    for ranks in got:  # the momentum is synchronized, so every rank holds the same params
        for p in ranks[1:]:
            for k in p:
                assert torch.equal(p[k], ranks[0][k])


def test_phases_follow_freeze_step():
    opt = fn.onebit_adam(freeze_step=4, comm=Local())
    assert [opt.is_compressed(t) for t in range(1, 7)] == [False] * 3 + [True] * 3
    params = make_params()
    state = opt.init(params)
    grads = make_grads(params, 1, 1)[0][0]
    with pytest.raises(ValueError, match="not a compressed update"):
        opt.compressed_update(grads, state, params, step=3)
    with pytest.raises(ValueError, match="not a warmup update"):
        opt.warmup_update(grads, state, params, step=4)


def test_exp_avg_mask_keeps_masked_momentum_zero():
    check_exp_avg_mask_keeps_masked_momentum_zero(
        lambda comm, mask: fn.onebit_adam(LR, 3, comm=comm, exp_avg_mask=mask)
    )


def test_none_and_empty_leaves():
    world = 2
    comm = Simulated(world)
    params = {"a": torch.randn(6), "frozen": torch.randn(3), "empty": torch.zeros(0, 4)}
    opt = fn.onebit_adam(LR, 2, weight_decay=0.1, comm=comm)
    state0 = replicate(opt.init(params), comm)
    state, p = state0, replicate(params, comm)
    update = simulate(opt.update, comm)
    for t in range(1, 5):
        grads = {"a": torch.randn(world, 6), "frozen": None, "empty": torch.zeros(world, 0, 4)}
        updates, state = update(grads, state, p, step=t)
        assert updates["frozen"] is None
        assert updates["empty"].shape == (world, 0, 4)
        p = fn.apply_updates(p, updates)
    assert torch.equal(p["frozen"], replicate(params, comm)["frozen"])
    for field in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(state, field)["frozen"], getattr(state0, field)["frozen"])
    # a leaf never compressed has no error buffers; the empty leaf needs none
    assert state.worker_error["frozen"] is None and state.worker_error["empty"] is None
    assert state.worker_error["a"].shape == (world, 16)
    floats = [x for x in fn.tree.tree_leaves(state) if x.is_floating_point()]
    assert all(torch.isfinite(x).all() for x in floats)


@pytest.mark.parametrize("step", [1, 3])  # warmup, compressed
@pytest.mark.parametrize("world", [1, 2])
def test_non_finite_gradient_raises(step, world):
    comm = Local() if world == 1 else Simulated(world)
    params = {"a": torch.randn(5), "b": torch.randn(3)}
    opt = fn.onebit_adam(LR, 2, comm=comm)
    grads = {"a": torch.randn(world, 5), "b": torch.randn(world, 3)}
    grads["b"][world - 1, 1] = float("nan")
    if world == 1:
        state = opt.init(params)
        call = lambda: opt.update({k: g[0] for k, g in grads.items()}, state, params, step=step)  # noqa: E731
    else:
        state = replicate(opt.init(params), comm)
        call = lambda: simulate(opt.update, comm)(grads, state, replicate(params, comm), step=step)  # noqa: E731
    before = [x.clone() for x in fn.tree.tree_leaves(state)]
    with pytest.raises(ValueError, match="non-finite"):
        call()
    assert all(torch.equal(a, b) for a, b in zip(before, fn.tree.tree_leaves(state), strict=True))


def test_non_freeze_leaves_stay_dense():
    """A non_freeze leaf follows dense Adam in the compressed phase: the same trajectory as an
    optimizer that never compresses."""
    world = 2
    params = make_params()
    grads = make_grads(params, world, 12)
    non_freeze = {"w": True, "b": False, "big": False}
    got, _ = run_fn(
        lambda c: fn.onebit_adam(LR, 4, comm=c, non_freeze=non_freeze), params, grads, world
    )
    dense, _ = run_fn(lambda c: fn.onebit_adam(LR, 1000, comm=c), params, grads, world)
    torch.testing.assert_close(got[-1][0]["w"], dense[-1][0]["w"], atol=1e-6, rtol=0)
    assert not torch.allclose(got[-1][0]["big"], dense[-1][0]["big"], atol=1e-4)


def test_lr_in_state_and_schedule():
    params = make_params()
    grads = make_grads(params, 1, 6)
    opt = fn.onebit_adam(1e-2, 3, comm=Local())
    state = opt.init(params)
    assert state.lr.dtype == torch.float32 and state.lr.shape == ()
    state = fn.set_hyperparams(state, lr=0.0)
    updates, state = opt.update(grads[0][0], state, params, step=1)
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())

    def schedule(count):
        return 1e-2 * 0.5 ** count.float()

    sched = fn.onebit_adam(schedule, 3, comm=Local())
    const = fn.onebit_adam(1e-2, 3, comm=Local())
    s_state, c_state, p_s, p_c = sched.init(params), const.init(params), params, params
    for t, g in enumerate(grads, start=1):
        c_state = fn.set_hyperparams(c_state, lr=1e-2 * 0.5 ** (t - 1))
        u_s, s_state = sched.update(g[0], s_state, p_s, step=t)
        u_c, c_state = const.update(g[0], c_state, p_c, step=t)
        p_s, p_c = fn.apply_updates(p_s, u_s), fn.apply_updates(p_c, u_c)
        assert torch.allclose(s_state.lr, torch.tensor(1e-2 * 0.5 ** (t - 1)))
    for k in params:
        torch.testing.assert_close(p_s[k], p_c[k])


def test_staged_and_low_precision_params():
    """fn.staged reads the step from its counter (Local comm); bf16 params keep fp32 state."""
    params = {k: p.to(torch.bfloat16) for k, p in make_params().items()}
    grads = make_grads(params, 1, 6)
    opt = fn.onebit_adam(LR, 3, comm=Local())
    staged = fn.staged(opt)
    s_state, state, p_s, p = staged.init(params), opt.init(params), params, params
    for t, g in enumerate(grads, start=1):
        g = {k: x.to(torch.bfloat16) for k, x in g[0].items()}
        u_s, s_state = staged.update(g, s_state, p_s)
        u, state = opt.update(g, state, p, step=t)
        p_s, p = fn.apply_updates(p_s, u_s), fn.apply_updates(p, u)
    for k in params:
        assert p[k].dtype == torch.bfloat16 and torch.equal(p_s[k], p[k])
        assert state.exp_avg[k].dtype == torch.float32
    assert int(s_state.count) == int(state.count) == 6
