"""The fast steps of fn/transforms/onebit_fast.py against the pure rules, bit for bit: every
step kind of 1-bit Adam, 0/1 Adam and 1-bit LAMB, donated (``update(..., donate=...)``, into a
spare state and in place) and applied (``fn.update_and_apply``), over leaves that need
padding, an empty leaf and a leaf without gradient, with and without ``exp_avg_mask`` and
``non_freeze``; on one process (``Local``, mirrored ranks), ``Simulated`` ranks and real gloo
ranks (world sizes 1 to 4); and a collective failing at any call leaves every buffer intact."""

from __future__ import annotations

import warnings

import pytest
import torch

import fn
import fn.transforms.onebit_fast as fast
from fn.collectives import Local, ProcessGroup, Simulated, replicate, simulate
from fn.tree import tree_map
from tests._distributed import run_distributed
from tests._mirror import Mirror, same_bits

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the unsafe-variance warning

SHAPES = {"w": (5, 3), "b": (7,), "big": (4, 33), "empty": (0,), "frozen": (6,)}
MASK = {"w": torch.ones(5, 3), "b": (torch.arange(7) % 2).float(), "big": None}
MASK.update(empty=torch.ones(0), frozen=None)
NON_FREEZE = {"w": False, "b": True, "big": False, "empty": False, "frozen": False}
STEPS = 8

CASES = {
    "onebit_adam": lambda comm, **level: fn.onebit_adam(
        1e-2, 3, weight_decay=0.01, comm=comm, **level
    ),
    "onebit_adam_masked": lambda comm, **level: fn.onebit_adam(
        1e-2, 3, exp_avg_mask=MASK, safeguard=False, comm=comm
    ),
    "onebit_adam_non_freeze": lambda comm, **level: fn.onebit_adam(
        1e-2, 3, weight_decay=0.01, non_freeze=NON_FREEZE, comm=comm
    ),
    "zero_one_adam": lambda comm, **level: fn.zero_one_adam(
        1e-2,
        var_freeze_step=4,
        var_update_scaler=1,
        local_step_scaler=2,
        local_step_clipper=2,
        weight_decay=0.01,
        comm=comm,
        **level,
    ),  # fmt: skip
    "zero_one_adam_masked": lambda comm, **level: fn.zero_one_adam(
        1e-2,
        var_freeze_step=5,
        var_update_scaler=1,
        local_step_scaler=1,
        local_step_clipper=2,
        exp_avg_mask=MASK,
        comm=comm,
        **level,
    ),  # fmt: skip
    "onebit_lamb": lambda comm, **level: fn.onebit_lamb(
        1e-2, 3, weight_decay=0.01, comm=comm, **level
    ),
    "onebit_lamb_masked": lambda comm, **level: fn.onebit_lamb(
        1e-2, 4, exp_avg_mask=MASK, comm=comm, **level
    ),
}


def _params():
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}


def _grads(world: int, rank: int, t: int):
    """Rank ``rank``'s gradients of update ``t``: a shared drift plus rank noise; ``None``
    for the frozen param."""
    shared = torch.Generator().manual_seed(100 * t)
    own = torch.Generator().manual_seed(100 * t + 1 + rank)
    return {
        k: None
        if k == "frozen"
        else torch.randn(s, generator=shared) + torch.randn(s, generator=own) * 0.5
        for k, s in SHAPES.items()
    }


def _kind(plan) -> str:
    if isinstance(plan, fn.transforms.ZeroOneAdamPlan):
        kinds = ("variance", "1-bit", "local", "sync")
        return kinds[0 if plan.variance else 3 if plan.sync else 2 if plan.frozen else 1]
    return ", ".join(f for f in plan._fields if getattr(plan, f)) or "warmup"


def _clone(tree):
    return tree_map(lambda x: x.clone(), tree)


class _Counted:
    """Counts the exchanges of the fast steps (so the tests know the fast path ran)."""

    def __init__(self, monkeypatch=None):
        self.calls = 0
        original = fast.compressed_allreduce_exchange

        def counted(*args, **kwargs):
            exchange = original(*args, **kwargs)
            self.calls += exchange is not None
            return exchange

        if monkeypatch is None:
            fast.compressed_allreduce_exchange = counted
        else:
            monkeypatch.setattr(fast, "compressed_allreduce_exchange", counted)


def _run_case(name: str, comm, world: int, rank: int, **level) -> dict[str, int]:
    """Runs the pure loop, the donated one (into a spare and in place) and update_and_apply
    side by side; asserts the same bits after every update. Returns the kinds of step seen.
    ``level``: ``local_world_size`` for the hierarchical collective, or nothing (flat)."""
    opt = CASES[name](comm, **level)
    params = _params()
    pure_p, applied_p = _clone(params), _clone(params)
    pure_s = opt.init(params)
    spare_s, inplace_s, applied_s = _clone(pure_s), _clone(pure_s), _clone(pure_s)
    spare = _clone(pure_s)
    kinds: dict[str, int] = {}
    for t in range(1, STEPS + 1):
        plan = opt.plan(t)
        kind = _kind(plan)
        kinds[kind] = kinds.get(kind, 0) + 1
        g = _grads(world, rank, t)
        where = f"{name} t={t} ({kind})"
        got_u, new = opt.update(_clone(g), spare_s, pure_p, step=t, donate=spare)
        spare, spare_s = spare_s, new
        got_in_place = opt.update(_clone(g), inplace_s, pure_p, step=t, donate=True)
        want_u, pure_s = opt.update(_clone(g), pure_s, pure_p, step=t)
        pure_p = fn.apply_updates(pure_p, want_u)
        assert same_bits((got_u, spare_s), (want_u, pure_s)), f"{where}: donated into a spare"
        inplace_s = got_in_place[1]
        assert same_bits(got_in_place, (want_u, pure_s)), f"{where}: donated in place"
        applied_p, applied_s = fn.update_and_apply(
            opt, _clone(g), applied_s, applied_p, donate=True, plan=plan
        )
        assert same_bits((applied_p, applied_s), (pure_p, pure_s)), f"{where}: applied"
    return kinds


def _want_fast(name: str, world: int) -> bool:
    return world > 1 and not name.startswith("onebit_lamb")


@pytest.mark.parametrize("name", list(CASES))
def test_mirrored_fast_steps_match_the_pure_rules(name, monkeypatch):
    counter = _Counted(monkeypatch)
    kinds = _run_case(name, Mirror(), 2, 0)
    assert (counter.calls > 0) == _want_fast(name, 2), "the fast path was not taken"
    every = {
        "onebit_adam": {"warmup", "compressed"},
        "zero_one_adam": {"variance", "1-bit", "local", "sync"},
        "onebit_lamb": {"warmup", "copies_variance", "compressed, sets_scaling", "compressed"},
    }
    assert every[next(k for k in every if name.startswith(k))] <= set(kinds), kinds


@pytest.mark.parametrize("name", list(CASES))
def test_one_worker_donated_steps_match_the_pure_rules(name):
    _run_case(name, Local(), 1, 0)


@pytest.mark.parametrize(("world", "local"), [(2, None), (3, None), (4, None), (4, 2)])
def test_simulated_donated_steps_match_the_pure_rules(world, local):
    """Under vmap the fast steps take the pure rules (and copy): still the same bits."""
    comm = Simulated(world)
    for name in ("onebit_adam_non_freeze", "zero_one_adam_masked", "onebit_lamb"):
        opt = CASES[name](comm, local_world_size=local)
        params = replicate(_params(), comm)
        pure_s, spare_s = replicate(opt.init(_params()), comm), None
        spare_s, spare = _clone(pure_s), _clone(pure_s)
        update = simulate(opt.update, comm)

        def donated(g, s, p, d, t, opt=opt):
            return opt.update(g, s, p, step=t, donate=d)

        for t in range(1, STEPS + 1):
            per_rank = [_grads(world, r, t) for r in range(world)]
            g = {
                k: None if k == "frozen" else torch.stack([x[k] for x in per_rank]) for k in SHAPES
            }
            want_u, pure_s = update(_clone(g), pure_s, params, step=t)
            got_u, new = simulate(lambda g, s, p, d, t=t: donated(g, s, p, d, t), comm)(
                _clone(g), spare_s, params, spare
            )
            spare, spare_s = spare_s, new
            assert same_bits((got_u, spare_s), (want_u, pure_s)), f"{name} W={world} t={t}"
            params = fn.apply_updates(params, want_u)


def _gloo_worker(rank: int, world_size: int, local: int | None = None) -> dict[str, int]:
    warnings.simplefilter("ignore", RuntimeWarning)
    counter = _Counted()
    comm = ProcessGroup()
    fast_calls = {}
    for name in CASES:
        before = counter.calls
        _run_case(name, comm, world_size, rank, local_world_size=local)
        fast_calls[name] = counter.calls - before
    return fast_calls


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("world", "local"), [(2, None), (3, None), (4, None), (4, 2)])
def test_gloo_fast_steps_match_the_pure_rules(world, local):
    results = run_distributed(_gloo_worker, world, local, timeout=500)
    for rank, calls in enumerate(results):
        for name, n in calls.items():
            assert (n > 0) == _want_fast(name, world), (rank, name, n)


@pytest.mark.parametrize(
    "name, step",
    [
        ("onebit_adam_non_freeze", 4),  # a dense leaf communicates between the compressed ones
        ("onebit_adam_masked", 4),
        ("zero_one_adam", 3),  # a 1-bit step
    ],
)
@pytest.mark.parametrize("apply", [False, True])
def test_a_failing_collective_leaves_every_buffer_intact(name, step, apply):
    """A fast step whose collective call k fails, for every k: params, live state, donated
    spare and gradients stay as they were; the retry gives the uninterrupted bits."""
    comm = Mirror()
    opt = CASES[name](comm)
    params, state = _params(), opt.init(_params())
    for t in range(1, step):
        state = fn.update_and_apply(opt, _grads(2, 0, t), state, params, step=t)[1]
    grads = _grads(2, 0, step)
    want_u, want_s = opt.update(_clone(grads), state, params, step=step)
    want_p = fn.apply_updates(params, want_u)

    def run(g, live, p, spare):
        if apply:
            return fn.update_and_apply(opt, g, live, p, donate=spare, step=step)
        return opt.update(g, live, p, step=step, donate=spare)

    comm.calls = 0
    run(_clone(grads), _clone(state), _clone(params), _clone(state))
    calls = comm.calls
    assert calls > 0
    for fail_at in range(1, calls + 1):
        p, live, spare, g = (_clone(x) for x in (params, state, state, grads))
        before = _clone((p, live, spare, g))
        comm.calls, comm.fail_at = 0, fail_at
        with pytest.raises(ConnectionError):
            run(g, live, p, spare)
        comm.fail_at = None
        assert same_bits((p, live, spare, g), before), f"call {fail_at} of {calls}: written"
        got = run(g, live, p, spare)
        assert same_bits(got, (want_p, want_s) if apply else (want_u, want_s))
