"""Buffer donation in the compressed updates of the 1-bit family: bit-identical to the pure
updates on real gloo ranks (in place and with a separate donated state), every check before the
first write, and no fresh full-size tensor in steady state (counted as minor page faults)."""

from __future__ import annotations

import resource
import warnings

import pytest
import torch

import fn
from fn.collectives import PackedSigns, ProcessGroup, Simulated, replicate, simulate
from fn.tree import tree_flatten, tree_map
from tests._distributed import run_together
from tests._mirror import Mirror, same_bits
from tests.collectives.test_onebit_donate import assert_steady_state_faults
from tests.transforms._onebit_harness import make_grads, make_params

STEPS = 12
pytestmark = pytest.mark.filterwarnings("ignore:.* the variance froze")
OPTIMIZERS = {
    "onebit_adam": lambda c: fn.onebit_adam(1e-2, 3, weight_decay=0.01, comm=c),
    "onebit_adam_exact_masked": lambda c: fn.onebit_adam(
        1e-2,
        3,
        safeguard=False,
        comm=c,
        exp_avg_mask={"w": torch.ones(5, 3), "b": (torch.arange(7) % 2).float(), "big": None},
    ),
    # variance steps 1-3 and 5, a 1-bit step 4, then local steps and syncs
    "zero_one_adam": lambda c: fn.zero_one_adam(
        1e-2,
        (0.9, 0.999),
        1e-8,
        0.01,
        5,
        2,
        2,
        4,
        comm=c,
        exp_avg_mask={"w": None, "b": (torch.arange(7) % 3).float(), "big": None},
    ),
    "onebit_lamb": lambda c: fn.onebit_lamb(1e-2, 3, weight_decay=0.01, comm=c),
    "onebit_adam_bf16_errors": lambda c: fn.onebit_adam(
        1e-2, 2, weight_decay=0.01, comm=c, error_dtype=torch.bfloat16
    ),
}


def _clone(tree):
    return tree_map(torch.clone, tree)


def _equal_trees(a, b) -> bool:
    la, lb = tree_flatten(a)[0], tree_flatten(b)[0]
    return len(la) == len(lb) and all(
        (x is None and y is None) or torch.equal(x, y) for x, y in zip(la, lb, strict=True)
    )


def _run(name, comm, rank, world_size, mode):
    """Per step (updates, state) of ``mode``: "pure", "inplace" (donate=True) or "spare" (the
    state of two steps back donated, as the torch.optim adapter does)."""
    opt = OPTIMIZERS[name](comm)
    params = make_params()
    grads = make_grads(params, world_size, STEPS)
    state, p = opt.init(params), dict(params)
    spare = _clone(state)
    writes = name.startswith("onebit_adam") or name == "zero_one_adam"
    out = []
    for t in range(1, STEPS + 1):
        g = _clone(grads[t - 1][rank])
        if mode == "pure":
            updates, new = opt.update(g, state, p, step=t)
        elif mode == "inplace":
            updates, new = opt.update(g, state, p, step=t, donate=True)
        else:
            updates, new = opt.update(g, state, p, step=t, donate=spare)
        plan = opt.plan(t)
        target = state if mode == "inplace" else spare
        if mode != "pure" and name == "onebit_lamb" and plan.compressed:
            assert isinstance(new.exp_avg, PackedSigns)  # the fused allreduce's result
            if target.worker_error is not None:  # allocated by the first compressed update
                assert new.worker_error is target.worker_error  # the fused allreduce's errors
                assert new.server_error is target.server_error
        if mode != "pure" and writes and plan.compressed and not getattr(plan, "sync", False):
            assert new.exp_avg_sq["w"] is state.exp_avg_sq["w"]  # frozen: the same tensor
            assert updates["w"] is g["w"]  # written into the donated gradient
            if name == "zero_one_adam":
                assert new.exp_avg["w"] is target.exp_avg["w"]
            else:  # the momentum is kept as the packed signs the exchange received
                assert isinstance(new.exp_avg["w"], PackedSigns)
            allocated = target.worker_error["w"] is not None
            if allocated and not getattr(plan, "frozen", False):
                assert new.worker_error["w"] is target.worker_error["w"]
        p = fn.apply_updates(p, updates)
        out.append((_clone(updates), _clone(new)))
        spare, state = state, new
    return out


def _donated_worker(rank, world_size):
    comm = ProcessGroup()
    for name in OPTIMIZERS:
        pure = _run(name, comm, rank, world_size, "pure")
        for mode in ("inplace", "spare"):
            got = _run(name, comm, rank, world_size, mode)
            for t, ((u, s), (uw, sw)) in enumerate(zip(got, pure, strict=True), start=1):
                assert _equal_trees(u, uw), (name, mode, t, "updates")
                assert _equal_trees(s, sw), (name, mode, t, "state")
    return True


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list]:
    """The 2-rank workers of this file but the page-fault count, in one launch."""
    parts = {
        "donated": (_donated_worker, ()),
        "nan": (_nan_worker, ()),
        "nan in a later leaf": (_nan_in_a_later_leaf_worker, ()),
    }
    return run_together(parts, 2, timeout=500)


@pytest.mark.timeout(600)
def test_gloo_donated_updates_match_pure(two_ranks):
    assert two_ranks["donated"] == [True, True]


def test_simulated_donated_updates_match_pure():
    comm = Simulated(2)
    params = make_params()
    grads = make_grads(params, 2, STEPS)
    for make in OPTIMIZERS.values():
        opt = make(comm)
        state = replicate(opt.init(params), comm)
        p = replicate(params, comm)
        pure = simulate(opt.update, comm)
        donated = simulate(
            lambda g, s, p, step, opt=opt: opt.update(g, s, p, step=step, donate=True), comm
        )
        don_state = _clone(state)
        for t in range(1, STEPS + 1):
            g = {k: torch.stack([grads[t - 1][r][k] for r in range(2)]) for k in params}
            want, state = pure(_clone(g), state, p, step=t)
            got, don_state = donated(_clone(g), don_state, p, step=t)
            assert _equal_trees(got, want) and _equal_trees(don_state, state), t
            p = fn.apply_updates(p, want)


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


def _nan_worker(rank, world_size):
    comm = ProcessGroup()
    opt = fn.onebit_adam(1e-2, 2, comm=comm)
    params = make_params()
    grads = make_grads(params, world_size, 3)
    state, p = opt.init(params), dict(params)
    for t in (1, 2):
        updates, state = opt.update(_clone(grads[t - 1][rank]), state, p, step=t, donate=True)
        p = fn.apply_updates(p, updates)
    g = _clone(grads[2][rank])
    if rank == 1:
        g["big"][2, 3] = float("nan")  # the last leaf: the others pass their checks first
    before, g_before = _clone(state), _clone(g)
    with pytest.raises(ValueError, match="non-finite"):
        opt.update(g, state, p, step=3, donate=True)
    for tree, saved in ((state, before), (g, g_before)):
        for a, b in zip(tree_flatten(tree)[0], tree_flatten(saved)[0], strict=True):
            assert (a is None and b is None) or torch.equal(_bits(a), _bits(b))
    return True


@pytest.mark.timeout(600)
def test_gloo_nonfinite_on_one_rank_leaves_donated_state_intact(two_ranks):
    assert two_ranks["nan"] == [True, True]


def _fault_worker(rank, world_size, n, donated):
    comm = ProcessGroup()
    opt = fn.onebit_adam(1e-3, 2, weight_decay=0.01, comm=comm)
    gen = torch.Generator().manual_seed(rank)
    params = {"w": torch.randn(n, generator=gen)}
    g = {"w": torch.empty(n)}
    state = opt.init(params)

    def step(t, state):
        g["w"].normal_(generator=gen)  # in place: the gradient buffer of a training loop
        donate = True if donated and opt.is_compressed(t) else None
        updates, state = opt.update(g, state, params, step=t, donate=donate)
        params["w"].add_(updates["w"])
        return state

    for t in (1, 2, 3):  # one warmup update, two compressed ones
        state = step(t, state)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for t in (4, 5, 6):
        state = step(t, state)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.timeout(540)  # two launches of fresh ranks, 240 s each at most
def test_gloo_donated_compressed_update_allocates_no_full_size_tensor(monkeypatch):
    assert_steady_state_faults(monkeypatch, _fault_worker, 1 << 22)


MIRRORED = {  # (optimizer, a compressed update count that donates)
    "onebit_adam": (
        lambda comm: fn.onebit_adam(1e-2, freeze_step=2, weight_decay=0.1, comm=comm),
        4,
    ),
    "zero_one_adam": (
        lambda comm: fn.zero_one_adam(1e-2, var_freeze_step=10, var_update_scaler=1, comm=comm),
        4,
    ),
    "onebit_lamb": (lambda comm: fn.onebit_lamb(1e-2, freeze_step=2, comm=comm), 4),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the unsafe-variance warning
@pytest.mark.parametrize("name", list(MIRRORED))
def test_a_failing_collective_leaves_the_donated_buffers_intact(name):
    """A compressed update on two (mirrored) ranks, its collective call k failing, for every
    k: the live state, the donated spare and the gradients stay as they were, and the retry
    gives the uninterrupted update's bits."""
    comm = Mirror()
    make, step = MIRRORED[name]
    opt = make(comm)
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(n, generator=gen) for k, n in (("a", 300), ("b", 35), ("c", 64))}
    state = opt.init(params)
    for t in range(1, step + 1):
        grads = tree_map(lambda p: torch.randn(p.shape, generator=gen) * 0.1, params)
        if t < step:
            _, state = opt.update(grads, state, params, step=t)
    want = opt.update(tree_map(torch.clone, grads), state, params, step=step)
    comm.calls = 0  # the donating update's calls (it gathers each server's signs and scale once)
    donating = (tree_map(torch.clone, x) for x in (grads, state))
    opt.update(*donating, params, step=step, donate=True)
    calls = comm.calls
    for fail_at in range(1, calls + 1):
        live, spare, g = (tree_map(torch.clone, x) for x in (state, state, grads))
        before = tree_map(torch.clone, (live, spare, g))
        comm.calls, comm.fail_at = 0, fail_at
        with pytest.raises(ConnectionError):
            opt.update(g, live, params, step=step, donate=spare)
        comm.fail_at = None
        assert same_bits((live, spare, g), before), f"call {fail_at} of {calls}: written"
        got = opt.update(g, live, params, step=step, donate=spare)
        assert same_bits(got, want)
    spare_ids = {id(x) for x in tree_flatten(spare)[0]}
    assert any(id(x) in spare_ids for x in tree_flatten(got[1])[0]), "nothing was donated"


def _nan_in_a_later_leaf_worker(rank, world_size):
    """Every donating compressed update and ``onebit_allreduce`` with a NaN in the last leaf
    of rank 1 only: every rank raises and keeps every buffer (live state, spare, grads)."""
    comm = ProcessGroup()
    warnings.simplefilter("ignore", RuntimeWarning)  # the unsafe-variance warning
    transforms = {name: (make(comm), step) for name, (make, step) in MIRRORED.items()}
    transforms["onebit_allreduce"] = (fn.collectives.onebit_allreduce(comm=comm), None)
    gen = torch.Generator().manual_seed(rank)
    params = {k: torch.randn(n, generator=gen) for k, n in (("a", 300), ("b", 35), ("c", 64))}
    intact = {}
    for name, (opt, step) in transforms.items():
        state = opt.init(params)
        kw = (lambda t: {"step": t}) if step else (lambda t: {})
        for t in range(1, (step or 3)):
            _, state = opt.update(tree_map(torch.randn_like, params), state, params, **kw(t))
        spare, grads = tree_map(torch.clone, state), tree_map(torch.randn_like, params)
        if rank == 1:
            grads["c"][5] = float("nan")
        before = tree_map(torch.clone, (state, spare, grads))
        try:
            opt.update(grads, state, params, donate=spare, **kw(step or 3))
            intact[name] = "no error"
        except ValueError:
            intact[name] = same_bits((state, spare, grads), before)
    return intact


@pytest.mark.timeout(600)
def test_gloo_nonfinite_later_leaf_on_one_rank_leaves_every_buffer_intact(two_ranks):
    for rank, intact in enumerate(two_ranks["nan in a later leaf"]):
        assert all(v is True for v in intact.values()), f"rank {rank}: {intact}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the unsafe-variance warning
@pytest.mark.parametrize(
    ("make", "step"),
    [
        *(pytest.param(make, step, id=name) for name, (make, step) in MIRRORED.items()),
        pytest.param(
            lambda comm: fn.zero_one_adam(
                1e-2, var_freeze_step=2, var_update_scaler=1, local_step_scaler=2, comm=comm
            ),
            6,
            id="zero_one_adam-local",
        ),
    ],
)
def test_donated_gradients_that_require_grad_give_the_pure_update(make, step):
    """A gradient that requires grad fits no result: the donated compressed update (two
    mirrored ranks) computes it as the pure one does."""
    opt = make(Mirror())
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(n, generator=gen) for k, n in (("a", 300), ("b", 35))}
    state = opt.init(params)
    for t in range(1, step):
        _, state = opt.update(tree_map(torch.randn_like, params), state, params, step=t)
    grads = tree_map(lambda p: torch.randn(p.shape, generator=gen), params)

    def tracked():  # leaves that require grad
        return tree_map(lambda g: g.clone().requires_grad_(), grads)

    want = opt.update(tracked(), state, params, step=step)
    got = opt.update(tracked(), state, params, step=step, donate=True)
    assert same_bits(got, want)
