"""The 1-bit family under torch.compile: a training step given ``plan=opt.plan(t)`` compiles once
per distinct plan (not once per step) and matches the eager ``step=t`` path; the plans agree with
the schedules and with DeepSpeed's per-leaf counters (the reference)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fn
from fn.collectives import Local, Simulated, replicate, simulate
from fn.transforms._onebit_schedules import FreezeSchedule, ZeroOneAdamSchedule
from fn.tree import tree_leaves
from tests.transforms._onebit_harness import make_grads, make_params
from tests.transforms._onebit_reference import ZeroOneAdamReference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from torch internals

ZERO_ONE = dict(var_freeze_step=12, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)

# name: (build(comm), updates to run, distinct plans among them). The freeze steps are small so
# that every plan occurs: 1-bit Adam warmup (t < 5) and compressed; 0/1 Adam variance, 1-bit,
# the last unfrozen update (t = 12, a 1-bit one, resets the errors), local and sync steps; 1-bit
# LAMB warmup, the last warmup update (t = 4, copies v), first compressed (t = 5), compressed.
OPTIMIZERS = {
    "onebit_adam": (lambda c: fn.onebit_adam(1e-2, 5, weight_decay=0.01, comm=c), 10, 3),
    "zero_one_adam": (
        lambda c: fn.zero_one_adam(1e-2, weight_decay=0.01, comm=c, **ZERO_ONE),
        20,
        5,
    ),
    "onebit_lamb": (lambda c: fn.onebit_lamb(1e-2, 5, weight_decay=0.01, comm=c), 10, 4),
}


def training_step(opt, comm):
    def step(params, state, grads, **when):
        updates, state = opt.update(grads, state, params, **when)
        return fn.apply_updates(params, updates), state

    return step if comm.world_size == 1 else simulate(step, comm)


def rank_grads(grads, t, world):
    """The gradients of update ``t``: rank 0's tree, or the rank-stacked trees (Simulated)."""
    if world == 1:
        return grads[t - 1][0]
    return {k: torch.stack([g[k] for g in grads[t - 1]]) for k in grads[t - 1][0]}


def set_up(name, world):
    """The optimizer ``name`` on ``world`` ranks (``Local`` or ``Simulated``): the optimizer,
    its comm, the params and state (rank-stacked when simulated), every update's gradients
    and the training step."""
    build, steps, _ = OPTIMIZERS[name]
    comm = Local() if world == 1 else Simulated(world)
    opt = build(comm)
    params = make_params()
    grads = make_grads(params, world, steps)
    state = opt.init(params)
    if world > 1:
        params, state = replicate(params, comm), replicate(state, comm)
    return opt, comm, params, state, grads, training_step(opt, comm)


def run_compiled_and_eager(name, world, backend, compare):
    """Runs the compiled ``plan=`` step and the eager ``step=`` step side by side; ``compare``
    checks every param and state leaf after every update. Returns (frames compiled, plans)."""
    steps = OPTIMIZERS[name][1]
    opt, comm, params, state, grads, step = set_up(name, world)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    # dynamic=False: any Python int reaching the graph would be guarded by value and recompile
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=False)
    got, want, plans = (params, state), (params, state), set()
    for t in range(1, steps + 1):
        g = rank_grads(grads, t, world)
        plans.add(opt.plan(t))
        before = comm.bytes_sent  # the count keeps growing: it must not be guarded on
        got = compiled(*got, g, plan=opt.plan(t))
        middle = comm.bytes_sent
        want = step(*want, g, step=t)
        assert middle - before == comm.bytes_sent - middle, t
        for a, b in zip(tree_leaves(got), tree_leaves(want), strict=True):
            compare(a, b, t)
    torch._dynamo.reset()
    return counter.frame_count, plans


def assert_equal(a, b, t):
    assert a.dtype == b.dtype and torch.equal(a, b), f"t={t}: {(a - b).abs().max()}"


@pytest.mark.timeout(300)  # dynamo's tracing is CPU-bound: 12-46 s on 2 idle cores, over 120 loaded
@pytest.mark.parametrize("world", [1, 2], ids=["local", "simulated2"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_step_compiles_once_per_plan_and_matches_eager(name, world):
    frames, plans = run_compiled_and_eager(name, world, "aot_eager", assert_equal)
    assert len(plans) == OPTIMIZERS[name][2]  # every phase occurred
    assert frames == len(plans)


@pytest.mark.timeout(180)
def test_inductor_matches_eager_to_rounding():
    """Inductor fuses and reorders fp32 arithmetic (it is not bit-exact); over 20 updates of
    0/1 Adam with params ~1 the drift stays at a few ulps (measured <= 3e-7)."""

    def close(a, b, t):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"t={t}: {m}")

    frames, plans = run_compiled_and_eager("zero_one_adam", 1, "inductor", close)
    assert frames == len(plans) == 5


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_plan_and_step_paths_are_bit_identical(name, world):
    """In eager mode, through the phase updates, ``CompressedOptimizer.update`` and ``staged``."""
    build, steps, _ = OPTIMIZERS[name]
    comm = Local() if world == 1 else Simulated(world)
    opt = build(comm)
    params = make_params()
    grads = make_grads(params, world, steps)
    state = opt.init(params)
    if world > 1:
        params, state = replicate(params, comm), replicate(state, comm)
    staged = fn.staged(opt)
    runs = {
        "step": (opt.update, lambda t: {"step": t}),
        "plan": (opt.update, lambda t: {"plan": opt.plan(t)}),
        "phase": (
            lambda g, s, p, plan: (opt.compressed_update if plan.compressed else opt.warmup_update)(
                g, s, p, plan=plan
            ),
            lambda t: {"plan": opt.plan(t)},
        ),
    }
    out = {}
    for kind, (update, when) in runs.items():
        if world > 1:
            update = simulate(update, comm)
        p, s = params, state
        for t in range(1, steps + 1):
            u, s = update(rank_grads(grads, t, world), s, p, **when(t))
            p = fn.apply_updates(p, u)
        out[kind] = tree_leaves((p, s))
    if world == 1:  # staged keeps its own counter; given a plan it does not read it
        p, s = params, staged.init(params)
        for t in range(1, steps + 1):
            u, s = staged.update(rank_grads(grads, t, world), s, p, plan=opt.plan(t))
            p = fn.apply_updates(p, u)
        assert int(s.count) == steps
        out["staged"] = tree_leaves((p, s.inner))
    for kind, leaves in out.items():
        for a, b in zip(leaves, out["step"], strict=True):
            assert_equal(a, b, kind)


FREEZE_STEPS = [0, 1, 2, 5, 37]


@pytest.mark.parametrize("freeze_step", FREEZE_STEPS)
def test_freeze_plans_follow_the_schedule(freeze_step):
    s = FreezeSchedule(freeze_step)
    if freeze_step >= 2:
        adam = fn.onebit_adam(freeze_step=freeze_step, comm=Local())
        lamb = fn.onebit_lamb(freeze_step=freeze_step, comm=Local())
    else:  # the optimizers reject freeze_step <= 1 (test_onebit_arguments); the schedule does not
        adam = SimpleNamespace(plan=s.onebit_adam_plan, is_compressed=s.is_compressed)
        lamb = SimpleNamespace(plan=s.onebit_lamb_plan, is_compressed=s.is_compressed)
    for t in range(1, 201):
        assert adam.plan(t) == fn.OnebitAdamPlan(t >= freeze_step, t == max(freeze_step, 1))
        assert adam.is_compressed(t) == s.is_compressed(t) == (t >= freeze_step)
        plan = lamb.plan(t)
        assert plan.compressed == lamb.is_compressed(t) == (t >= freeze_step)
        assert plan.copies_variance == s.is_last_warmup_step(t) == (t + 1 == freeze_step)
        assert plan.sets_scaling == (t == s.first_compressed_step() == max(freeze_step, 1))
    # freeze_step 2: the only warmup update copies v; <= 1: no warmup at all
    assert len({lamb.plan(t) for t in range(1, 201)}) == {0: 2, 1: 2, 2: 3}.get(freeze_step, 4)


# (var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper), hand-picked so that
# within 200 updates the intervals double several times, get clipped, and the freeze lands on a
# variance step (11, 0) or on a 1-bit step (12, 60).
ZERO_ONE_SCHEDULES = [
    (12, 2, 3, 4),
    (11, 2, 3, 4),
    (0, 2, 2, 16),
    (60, 3, 5, 8),
    (100000, 16, 7, 4),
]


@pytest.mark.parametrize("sched", ZERO_ONE_SCHEDULES, ids=str)
def test_zero_one_adam_plans_follow_the_schedule_and_reference(sched):
    schedule = ZeroOneAdamSchedule(*sched)
    opt = fn.zero_one_adam(comm=Local(), **dict(zip(ZERO_ONE, sched, strict=True)))
    # DeepSpeed's per-leaf counters and flags, kept step by step by the reference
    x = {"x": torch.zeros(3)}
    ref = ZeroOneAdamReference(x, 1, 1e-2, (0.9, 0.999), 1e-8, 0.0, *sched)
    plans = []
    for t in range(1, 201):
        plan = opt.plan(t)
        assert all(isinstance(b, bool) for b in plan)
        assert plan.variance == schedule.is_variance_step(t)
        assert plan.frozen == schedule.frozen(t)
        assert plan.sync == schedule.is_sync_step(t)
        assert plan.reset_errors == schedule.resets_errors(t)
        assert plan.compressed == opt.is_compressed(t) == schedule.is_compressed(t)
        was_reset = ref.errors_reset
        ref.step(t, [{"x": torch.ones(3)}], [x])
        kind = {(True, False): "var", (False, False): "onebit", (False, True): "local"}
        want = "sync" if plan.sync else kind[plan.variance, plan.frozen]
        assert ref.log[-1] == want, t
        assert plan.reset_errors == (ref.errors_reset and not was_reset), t
        plans.append(plan)
    assert len(set(plans)) <= 5


def test_plan_argument_errors():
    opt = fn.zero_one_adam(comm=Local(), **ZERO_ONE)
    params = make_params()
    state = opt.init(params)
    g = make_grads(params, 1, 1)[0][0]
    with pytest.raises(TypeError, match="exactly one"):
        opt.update(g, state, params, step=1, plan=opt.plan(1))
    with pytest.raises(TypeError, match="exactly one"):
        opt.warmup_update(g, state, params)
    with pytest.raises(TypeError, match="ZeroOneAdamPlan"):
        opt.warmup_update(g, state, params, plan=fn.OnebitAdamPlan(False, False))
    with pytest.raises(ValueError, match="not a compressed update"):
        opt.compressed_update(g, state, params, plan=opt.plan(1))
    with pytest.raises(ValueError, match="step"):
        opt.warmup_update(g, state, params, step=0)
    four_fields = fn.CompressedOptimizer(*opt[:4])
    assert four_fields.plan is None
    with pytest.raises(TypeError, match="no plan"):
        four_fields.update(g, state, params, plan=opt.plan(1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2], ids=["local", "simulated2"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_step_given_t_matches_eager_within_the_recompile_limit(name, world):
    """``step=t`` passed into a compiled step: dynamo specializes the first ``t``, then makes it
    a dynamic int guarded by the plan's decisions, and the results are the eager ones, bit for
    bit (under ``Simulated`` too). 1-bit Adam and 1-bit LAMB compile one graph more than their
    plans; 0/1 Adam's doubling intervals keep adding guards (docs/guides/compile.md: pass
    ``plan=`` there)."""
    steps = OPTIMIZERS[name][1]
    _, _, params, state, grads, step = set_up(name, world)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter)
    got, want = (params, state), (params, state)
    for t in range(1, steps + 1):
        g = rank_grads(grads, t, world)
        got = compiled(*got, g, step=t)
        want = step(*want, g, step=t)
        for a, b in zip(tree_leaves(got), tree_leaves(want), strict=True):
            assert_equal(a, b, t)
    torch._dynamo.reset()
    if name != "zero_one_adam":
        assert counter.frame_count == OPTIMIZERS[name][2] + 1
