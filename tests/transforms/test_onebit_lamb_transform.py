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
from tests.transforms._onebit_reference import OnebitLambReference

LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8
COEFFS = (10.0, 0.01, 0.9, 4.0, 0.5, 0.1)  # max/min_coeff, coeff_beta, factor_max/min/threshold


def make(comm, freeze_step, wd=0.0, mask=None):
    # DeepSpeed's exact rule (safeguard=False), which the reference implements
    return fn.onebit_lamb(
        LR, freeze_step, BETAS, EPS, wd, *COEFFS, comm=comm, exp_avg_mask=mask, safeguard=False
    )


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_single_worker_matches_reference(wd):
    params = make_params()
    grads = make_grads(params, 1, 50)
    got, _ = run_fn(lambda c: make(c, 20, wd), params, grads, world=1)
    ref = OnebitLambReference(params, 1, LR, 20, BETAS, EPS, wd, COEFFS)
    assert_trajectories_close(got, run_reference(ref, params, grads, 1), atol=2e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_simulated_ranks_match_reference(world):
    params = make_params()
    grads = make_grads(params, world, 30)
    mask = {"w": None, "b": None, "big": (torch.arange(40).view(4, 10) % 3 != 0).float()}
    got, _ = run_fn(lambda c: make(c, 10, 0.01, mask), params, grads, world)
    ref = OnebitLambReference(params, world, LR, 10, BETAS, EPS, 0.01, COEFFS, mask=mask)
    want = run_reference(ref, params, grads, world)
    assert_trajectories_close(got, want, atol=2e-6)
    for ranks in got:
        for p in ranks[1:]:
            for k in p:
                assert torch.equal(p[k], ranks[0][k])


def test_state_after_warmup_and_first_compressed_step():
    """R is the EMA of the warmup ratios, v_fresh is v at the last warmup step, the scaling
    coefficients equalize the leaves' momentum RMS, the factors move by at most 10% a step."""
    params = make_params()
    grads = make_grads(params, 1, 8)
    opt = make(Local(), 5)
    state = opt.init(params)
    p = params
    for t, g in enumerate(grads, start=1):
        updates, state = opt.update(g[0], state, p, step=t)
        p = fn.apply_updates(p, updates)
        if t == 4:
            assert all(torch.equal(state.exp_avg_sq_fresh[k], state.exp_avg_sq[k]) for k in p)
            warm = state
        if t == 5:
            rms = {k: warm.exp_avg[k].norm() / warm.exp_avg[k].numel() ** 0.5 for k in p}
            mean = sum(rms.values()) / len(rms)
            for k in p:
                torch.testing.assert_close(state.scaling_coeff[k], mean / rms[k])
    for k in p:
        assert 0 < state.lamb_coeff_freeze[k] <= 10.0
        assert torch.equal(state.lamb_coeff_freeze[k], warm.lamb_coeff_freeze[k])
        assert 0.9**4 - 1e-6 <= state.last_factor[k] <= 1.1**4 + 1e-6
        assert not torch.equal(state.exp_avg_sq_fresh[k], warm.exp_avg_sq_fresh[k])


def test_fused_single_error_buffer_sizes():
    """One error pair for all leaves fused, allocated by the first compressed update (never
    with one worker); the fresh variance comes with the last warmup update, the packed
    momentum with the first compressed one."""
    params = make_params()  # 15 + 7 + 40 = 62 elements
    state = make(Simulated(2), 3).init(params)
    assert state.worker_error is None and state.server_error is None
    assert all(v is None for v in state.exp_avg_sq_fresh.values())
    for world, padded in ((1, None), (2, 64), (4, 64), (3, 72)):
        _, state = run_fn(lambda c: make(c, 3), params, make_grads(params, world, 3), world)
        assert all(v is not None for v in state.exp_avg_sq_fresh.values())
        if padded is None:
            assert state.worker_error is None and torch.is_tensor(state.exp_avg["w"])
            continue
        assert state.worker_error.shape == (world, padded)
        assert state.server_error.shape == (world, padded // world)
        assert state.exp_avg.packed.shape == (world, world, padded // world // 8)


@pytest.mark.parametrize("max_coeff, min_coeff", [(10.0, 2.0), (0.5, 0.01)])
@pytest.mark.parametrize("world", [1, 2])
def test_zero_norm_trust_ratio_is_the_clipped_one(world, max_coeff, min_coeff):
    """docs/algorithms.md: ratio = ||p|| / ||u|| if both are nonzero else 1, THEN clipped, so with
    min_coeff > 1 or max_coeff < 1 a zero-norm leaf steps with and averages the clipped 1."""
    gen = torch.Generator().manual_seed(4)
    params = {"zero_p": torch.zeros(3, 2), "zero_g": torch.randn(4, generator=gen)}
    params["w"] = torch.randn(5, generator=gen)
    grads = make_grads(params, world, 5)
    for ranks in grads:
        for g in ranks:
            g["zero_g"] = torch.zeros(4)  # u = 0 at every update (no weight decay)
    coeffs = (max_coeff, min_coeff) + COEFFS[2:]
    got, state = run_fn(
        lambda c: fn.onebit_lamb(LR, 6, BETAS, EPS, 0.0, *coeffs, comm=c, safeguard=False),
        params,
        grads,
        world,
    )
    ref = OnebitLambReference(params, world, LR, 6, BETAS, EPS, 0.0, coeffs)
    assert_trajectories_close(got, run_reference(ref, params, grads, world), atol=2e-6)
    clipped_one = min(max(1.0, min_coeff), max_coeff)
    assert clipped_one != 1.0
    # zero_g has u = 0 at all 5 updates: R = sum_t (1 - beta) beta^(5 - t) clipped_one
    beta = COEFFS[2]
    r_zero_g = state.lamb_coeff_freeze["zero_g"].reshape(-1)
    torch.testing.assert_close(r_zero_g, torch.full((world,), clipped_one * (1 - beta**5)))
    # zero_p has p = 0 at t = 1: its first step is -lr * clipped_one * u, u = m / (sqrt(v) + eps)
    g = sum(ranks["zero_p"] for ranks in grads[0]) / world
    u = (1 - BETAS[0]) * g / (((1 - BETAS[1]) * g * g).sqrt() + EPS)
    for p in got[0]:
        torch.testing.assert_close(p["zero_p"], -LR * clipped_one * u)
    for k in params:
        r_fn = state.lamb_coeff_freeze[k].reshape(-1)
        torch.testing.assert_close(r_fn, torch.tensor(ref.R[k], dtype=torch.float32))


def test_exp_avg_mask_keeps_masked_momentum_zero():
    check_exp_avg_mask_keeps_masked_momentum_zero(lambda comm, mask: make(comm, 3, mask=mask))


def test_none_empty_and_zero_momentum_leaves():
    world = 2
    comm = Simulated(world)
    params = {
        "a": torch.randn(6),
        "frozen": torch.randn(3),
        "empty": torch.zeros(0, 2),
        "zero": torch.zeros(4),  # zero param and zero gradient: ratio 1, scaling 1
    }
    opt = make(comm, 3, wd=0.1)
    state0 = replicate(opt.init(params), comm)
    state, p = state0, replicate(params, comm)
    update = simulate(opt.update, comm)
    for t in range(1, 8):
        grads = {
            "a": torch.randn(world, 6),
            "frozen": None,
            "empty": torch.zeros(world, 0, 2),
            "zero": torch.zeros(world, 4),
        }
        updates, state = update(grads, state, p, step=t)
        assert updates["frozen"] is None and updates["empty"].shape == (world, 0, 2)
        p = fn.apply_updates(p, updates)
    assert torch.equal(p["frozen"], replicate(params, comm)["frozen"])
    for field in ("exp_avg", "exp_avg_sq", "lamb_coeff_freeze", "last_factor"):
        assert torch.equal(getattr(state, field)["frozen"], getattr(state0, field)["frozen"])
    assert torch.equal(state.scaling_coeff["zero"], torch.ones(world))
    assert all(torch.isfinite(x).all() for x in fn.tree.tree_leaves(state))
    assert all(torch.isfinite(x).all() for x in fn.tree.tree_leaves(p))


@pytest.mark.parametrize("step", [1, 3])  # warmup, compressed
@pytest.mark.parametrize("world", [1, 2])
def test_non_finite_gradient_raises(step, world):
    comm = Local() if world == 1 else Simulated(world)
    params = {"a": torch.randn(5), "b": torch.randn(3)}
    opt = make(comm, 2)
    grads = {"a": torch.randn(world, 5), "b": torch.randn(world, 3)}
    grads["a"][0, 0] = float("nan")
    state = opt.init(params) if world == 1 else replicate(opt.init(params), comm)
    before = [x.clone() for x in fn.tree.tree_leaves(state)]
    with pytest.raises(ValueError, match="non-finite"):
        if world == 1:
            opt.update({k: g[0] for k, g in grads.items()}, state, params, step=step)
        else:
            simulate(opt.update, comm)(grads, state, replicate(params, comm), step=step)
    assert all(torch.equal(a, b) for a, b in zip(before, fn.tree.tree_leaves(state), strict=True))


def test_params_required():
    opt = make(Local(), 2)
    params = {"a": torch.randn(3)}
    with pytest.raises(ValueError, match="needs the params"):
        opt.update({"a": torch.randn(3)}, opt.init(params), step=1)


@pytest.mark.parametrize("factory", [fn.onebit_lamb, fn.onebit_adam])
def test_a_step_ahead_of_the_count_is_taken_as_given(factory):
    """A loop that counts a step it did not make (``step=1``, then ``step=3``): the update runs
    at the ``step`` given, as 1-bit Adam's does (1-bit LAMB raised a bare StopIteration
    from the log line of its first compressed update)."""
    params = {"w": torch.linspace(-1.0, 1.0, 4)}
    tx = factory(lr=0.1, freeze_step=3, comm=Local())
    state = tx.init(params)
    grads = {"w": torch.tensor([0.5, -1.0, 2.0, -0.25])}
    _, state = tx.update(grads, state, params, step=1)
    updates, state = tx.update(grads, state, params, step=3)
    assert int(state.count) == 2 and bool(torch.isfinite(updates["w"]).all())
