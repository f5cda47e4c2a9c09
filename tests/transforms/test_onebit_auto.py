"""``freeze_step="auto"`` and ``exp_avg_mask="auto"`` of 1-bit Adam and 1-bit LAMB: the switch
follows the documented criterion and is the same on every rank, an automatic run equals the
fixed run at the decided update with the hand-made mask bit for bit, a compiled step compiles
once per plan, and bad input is refused."""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fn
from fn.collectives import Local, Simulated, replicate, simulate
from fn.tree import tree_leaves

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

AUTO = fn.AutoFreeze(min_updates=2, max_updates=14, tolerance=0.7)
BETAS = (0.8, 0.95)  # the criterion reads both betas
STEPS = 18
SHAPES = {"emb": (6, 4), "b": (5,)}
FACTORIES = {"onebit_adam": fn.onebit_adam, "onebit_lamb": fn.onebit_lamb}


def make_params():
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def make_grads(world):
    """grads[t - 1][r]: a scale that decays, then settles; rows 0-1 of ``emb`` never used,
    element (2, 0) used on one rank only (its mean is not zero), element (2, 1) with gradients
    that cancel over the ranks (its mean is exactly zero)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for t in range(1, STEPS + 1):
        scale = 1.0 + 4.0 * math.exp(-t / 2)
        ranks = []
        for r in range(world):
            g = {k: scale * torch.randn(s, generator=gen) for k, s in SHAPES.items()}
            g["emb"][:2] = 0.0
            if r > 0:
                g["emb"][2, 0] = 0.0
            g["emb"][2, 1] = 1.0 if r % 2 == 0 else -1.0
            ranks.append(g)
        out.append(ranks)
    return out


def stacked(grads, t):
    return {k: torch.stack([g[k] for g in grads[t - 1]]) for k in SHAPES}


def run(opt, comm, grads, use_plan=False):
    """Params after every update (rank-stacked), the plans and the final state."""
    init = make_params()
    params, state = replicate(init, comm), replicate(opt.init(init), comm)
    update = simulate(opt.update, comm)
    history, plans = [], []
    for t in range(1, STEPS + 1):
        plan = opt.plan(t, state)
        when = {"plan": plan} if use_plan else {"step": t}
        updates, state = update(stacked(grads, t), state, params, **when)
        params = fn.apply_updates(params, updates)
        history.append(params)
        plans.append(plan)
    return history, plans, state


def reference_switch(grads, settings, betas):
    """The documented criterion, in Python floats, from the averaged gradients."""
    b1, b2 = betas
    total = recent = 0.0
    for t in range(1, STEPS + 1):
        q = 0.0
        for k in SHAPES:
            mean = sum(g[k] for g in grads[t - 1]) / len(grads[t - 1])
            _, rms, _ = fn.kernels.sign_compress(mean.reshape(-1).abs().neg())
            q += float(rms) ** 2 * mean.numel()
        total = b2 * total + (1 - b2) * q
        recent = b1 * recent + (1 - b1) * q
        settled = total >= (1 - settings.tolerance) * recent / (1 - b1**t)
        if t >= settings.min_updates and (settled or t >= settings.max_updates):
            return t + 1
    return None


def hand_mask(grads, freeze_at):
    """1 where the averaged gradient was non-zero at some warmup update, else 0."""
    seen = {k: torch.zeros(s, dtype=torch.bool) for k, s in SHAPES.items()}
    for t in range(1, freeze_at):
        for k in SHAPES:
            seen[k] |= (sum(g[k] for g in grads[t - 1]) / len(grads[t - 1])) != 0
    return {k: v.float() for k, v in seen.items()}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_auto_equals_the_fixed_run_at_the_decided_update_with_the_hand_made_mask(name):
    comm = Simulated(2)
    grads = make_grads(2)
    factory = FACTORIES[name]
    auto = factory(1e-2, AUTO, BETAS, comm=comm, exp_avg_mask="auto")
    history, plans, state = run(auto, comm, grads)
    freeze_at = state.auto.freeze_at
    assert freeze_at[0] == freeze_at[1]  # the same on every rank
    decided = int(freeze_at[0])
    assert decided == reference_switch(grads, AUTO, BETAS)
    assert AUTO.min_updates < decided <= AUTO.max_updates < STEPS  # settled, not the bound
    assert [p.compressed for p in plans] == [t >= decided for t in range(1, STEPS + 1)]
    assert [p.freezes for p in plans if hasattr(p, "freezes")] in (
        [],
        [t == decided for t in range(1, STEPS + 1)],
    )
    mask = hand_mask(grads, decided)
    assert mask["emb"][:2].eq(0).all() and mask["emb"][2, 0] == 1 and mask["emb"][2, 1] == 0
    fixed = factory(1e-2, decided, BETAS, comm=comm, exp_avg_mask=mask)
    want, _, fixed_state = run(fixed, comm, grads)
    for got_params, want_params in zip(history, want, strict=True):
        for k in SHAPES:
            assert torch.equal(got_params[k], want_params[k])
            assert torch.equal(got_params[k][0], got_params[k][1])  # the ranks agree
    auto_mask = simulate(lambda s: fn.transforms.momentum_of(s, "auto"), comm)(state)
    fixed_momentum = simulate(lambda s: fn.transforms.momentum_of(s, mask), comm)(fixed_state)
    for k in SHAPES:
        assert torch.equal(auto_mask[k], fixed_momentum[k])
    # the plan path gives the same bits
    auto = factory(1e-2, AUTO, BETAS, comm=comm, exp_avg_mask="auto")
    by_plan, _, _ = run(auto, comm, grads, True)
    for a, b in zip(tree_leaves(history), tree_leaves(by_plan), strict=True):
        assert torch.equal(a, b)


def test_bounds_force_and_delay_the_switch():
    comm = Simulated(2)
    grads = make_grads(2)
    late = fn.AutoFreeze(min_updates=9, max_updates=9, tolerance=0.5)
    _, plans, state = run(fn.onebit_adam(1e-2, late, comm=comm), comm, grads)
    assert int(state.auto.freeze_at[0]) == 10
    assert state.auto.always_zero is None
    never = fn.AutoFreeze(min_updates=2, max_updates=100, tolerance=1e-9)
    _, plans, state = run(fn.onebit_adam(1e-2, never, comm=comm), comm, grads)
    assert int(state.auto.freeze_at[0]) == 0 and not any(p.compressed for p in plans)


def test_first_compressed_update_and_the_state_argument():
    opt = fn.onebit_adam(1e-2, "auto", comm=Local())
    state = opt.init(make_params())
    assert opt.first_compressed_update(5000) == 1001 and opt.first_compressed_update(1000) is None
    assert opt.first_compressed_update(5000, state) == 1001
    with pytest.raises(TypeError, match="state"):
        opt.plan(3)
    decided = state._replace(auto=state.auto._replace(freeze_at=torch.tensor(7)))
    assert opt.first_compressed_update(100, decided) == 7
    assert opt.plan(7, decided) == fn.transforms.OnebitAdamPlan(True, True)
    assert not opt.is_compressed(6, decided) and opt.is_compressed(8, decided)


@pytest.mark.timeout(120)
def test_compiled_step_compiles_once_per_plan():
    opt = fn.onebit_adam(1e-2, fn.AutoFreeze(2, 5, 0.5), comm=Local())
    params = make_params()
    grads = make_grads(1)
    state = opt.init(params)

    def step(params, state, grads, plan):
        updates, state = opt.update(grads, state, params, plan=plan)
        return fn.apply_updates(params, updates), state

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")  # dynamo guards: one graph per plan
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=False)
    got, want, plans = (params, state), (params, state), set()
    for t in range(1, 12):
        plan = opt.plan(t, got[1])
        plans.add(plan)
        got = compiled(*got, grads[t - 1][0], plan)
        want = step(*want, grads[t - 1][0], opt.plan(t, want[1]))
        for a, b in zip(tree_leaves(got), tree_leaves(want), strict=True):
            assert torch.equal(a, b)
    torch._dynamo.reset()
    assert len(plans) == 3 and counter.frame_count == 3


@pytest.mark.parametrize("name", list(FACTORIES))
def test_bad_input_is_refused(name):
    factory, comm = FACTORIES[name], Local()
    for bad, match in (
        (fn.AutoFreeze(min_updates=5, max_updates=4), "above max_updates"),
        (fn.AutoFreeze(min_updates=0), "min_updates"),
        (fn.AutoFreeze(tolerance=1.5), "tolerance"),
        ("automatic", "auto"),
    ):
        with pytest.raises(ValueError, match=match):
            factory(1e-2, bad, comm=comm)
    with pytest.raises(ValueError, match="exp_avg_mask"):
        factory(1e-2, 5, comm=comm, exp_avg_mask="zeros")
    params = make_params()
    auto, fixed = factory(1e-2, "auto", comm=comm), factory(1e-2, 5, comm=comm)
    masked = factory(1e-2, 5, comm=comm, exp_avg_mask="auto")
    with pytest.raises(ValueError, match="fixed one"):
        auto.check_state(fixed.init(params))
    with pytest.raises(ValueError, match="fixed one"):
        fixed.check_state(auto.init(params))
    with pytest.raises(ValueError, match="exp_avg_mask"):
        fixed.check_state(masked.init(params))
    assert masked.check_state(masked.init(params)).auto.freeze_at is None


def test_auto_with_only_non_freeze_leaves_and_zero_one_adam_are_refused():
    with pytest.raises(ValueError, match="non_freeze"):
        fn.onebit_adam(1e-2, "auto", comm=Local(), non_freeze={"emb": True, "b": True})
    fn.onebit_adam(1e-2, "auto", comm=Local(), non_freeze={"emb": True, "b": False})
    with pytest.raises(NotImplementedError, match="auto"):
        fn.zero_one_adam(1e-2, var_freeze_step="auto", comm=Local())
