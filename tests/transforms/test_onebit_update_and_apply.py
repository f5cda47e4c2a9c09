"""``fn.update_and_apply`` of ``fn.onebit_adam``: its donated compressed updates add the Adam
direction to the params (``fn.kernels.adam_apply``), bit for bit ``update`` then
``apply_updates``, on mirrored ranks, real gloo ranks and ``Simulated`` ones; every check
before the first write; the kernel against its reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn
import fn.kernels as K
from fn.collectives import ProcessGroup, Simulated, replicate, simulate
from fn.kernels import _cpu, _reference
from fn.tree import tree_map
from tests._distributed import run_distributed
from tests._mirror import Mirror, same_bits
from tests.transforms._onebit_harness import make_grads, make_params

STEPS = 7
FREEZE = 3
pytestmark = pytest.mark.filterwarnings("ignore:.* the variance froze")
CONFIGS = {
    "decay": dict(weight_decay=0.01),
    "plain": dict(),
    "exact_decay": dict(safeguard=False, weight_decay=0.1),
    "masked": dict(
        exp_avg_mask={"w": torch.ones(5, 3), "b": (torch.arange(7) % 2).float(), "big": None}
    ),
    "non_freeze": dict(weight_decay=0.01, non_freeze={"w": False, "b": True, "big": False}),
}


def _clone(tree):
    return tree_map(torch.clone, tree)


class _Counting:
    """Counts the calls of ``fn.kernels.adam_apply`` (the fused path)."""

    def __init__(self, monkeypatch=None):
        self.calls = 0
        original = K.adam_apply

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        if monkeypatch is not None:
            monkeypatch.setattr(K, "adam_apply", counted)
        else:
            K.adam_apply = counted


def _compare(comm, rank, world, config, mode, keyword, counter):
    """Runs the pure loop (update + apply_updates) and update_and_apply side by side; asserts
    the same bits of params and state after every step and the params updated in place."""
    opt = fn.onebit_adam(1e-2, FREEZE, comm=comm, **CONFIGS[config])
    params = make_params()
    grads = make_grads(params, world, STEPS)
    pure_params, tensors = _clone(params), dict(params)
    pure_state, state = opt.init(params), opt.init(params)
    spare = _clone(state)
    before = counter.calls
    for t in range(1, STEPS + 1):
        g = grads[t - 1][rank]
        updates, pure_state = opt.update(_clone(g), pure_state, pure_params, step=t)
        pure_params = fn.apply_updates(pure_params, updates)
        kw = {"step": t} if keyword == "step" else {"plan": opt.plan(t)}
        donate = True if mode == "in place" else spare
        params, new_state = fn.update_and_apply(opt, _clone(g), state, params, donate=donate, **kw)
        spare, state = state, new_state
        assert all(params[k] is tensors[k] for k in params), "params not updated in place"
        assert same_bits(params, pure_params), (config, mode, keyword, t, "params")
        assert same_bits(state, pure_state), (config, mode, keyword, t, "state")
    fused_leaves = 2 if config == "non_freeze" else 3
    assert counter.calls - before == fused_leaves * (STEPS - FREEZE + 1), "fused path not taken"


@pytest.mark.parametrize("keyword", ["step", "plan"])
@pytest.mark.parametrize("mode", ["in place", "spare"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_mirrored_update_and_apply_matches_update_then_apply(config, mode, keyword, monkeypatch):
    _compare(Mirror(), 0, 1, config, mode, keyword, _Counting(monkeypatch))


def test_params_that_require_grad_are_updated_in_place_under_no_grad(monkeypatch):
    counter = _Counting(monkeypatch)
    opt = fn.onebit_adam(1e-2, 2, weight_decay=0.01, comm=Mirror())
    params = tree_map(lambda p: p.requires_grad_(), make_params())
    pure_params = tree_map(lambda p: p.detach().clone(), params)
    state, pure_state = opt.init(pure_params), opt.init(pure_params)
    for t, g in enumerate(make_grads(params, 1, 4), start=1):
        updates, pure_state = opt.update(_clone(g[0]), pure_state, pure_params, step=t)
        pure_params = fn.apply_updates(pure_params, updates)
        with torch.no_grad():
            params, state = fn.update_and_apply(opt, _clone(g[0]), state, params, step=t)
        assert same_bits(params, pure_params) and same_bits(state, pure_state), t
    assert counter.calls == 3 * 3


def _gloo_worker(rank, world_size):
    counter = _Counting()
    comm = ProcessGroup()
    for config in CONFIGS:
        for mode in ("in place", "spare"):
            _compare(comm, rank, world_size, config, mode, "step", counter)
    return True


@pytest.mark.timeout(300)
def test_gloo_update_and_apply_matches_update_then_apply():
    assert run_distributed(_gloo_worker, 2, timeout=240) == [True, True]


@pytest.mark.parametrize("config", ["decay", "masked"])
def test_simulated_update_and_apply_matches_update_then_apply(config):
    comm = Simulated(2)
    opt = fn.onebit_adam(1e-2, FREEZE, comm=comm, **CONFIGS[config])
    params = make_params()
    grads = make_grads(params, 2, STEPS)
    state = replicate(opt.init(params), comm)
    pure_params, p = replicate(params, comm), replicate(params, comm)
    mine = _clone(state)
    pure = simulate(opt.update, comm)
    fused = simulate(lambda g, s, p, step: fn.update_and_apply(opt, g, s, p, step=step)[::-1], comm)
    for t in range(1, STEPS + 1):
        g = {k: torch.stack([grads[t - 1][r][k] for r in range(2)]) for k in params}
        updates, state = pure(_clone(g), state, pure_params, step=t)
        pure_params = fn.apply_updates(pure_params, updates)
        mine, p = fused(_clone(g), mine, p, step=t)
        assert same_bits(p, pure_params) and same_bits(mine, state), t


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_failing_collective_leaves_params_and_buffers_intact():
    """A fused compressed step whose collective call k fails, for every k: params, live state,
    donated spare and gradients stay as they were; the retry gives the uninterrupted bits."""
    comm = Mirror()
    opt = fn.onebit_adam(1e-2, freeze_step=2, weight_decay=0.1, comm=comm)
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(n, generator=gen) for k, n in (("a", 300), ("b", 35), ("c", 64))}
    state = opt.init(params)
    for t in (1, 2, 3):
        grads = tree_map(lambda p: torch.randn(p.shape, generator=gen) * 0.1, params)
        state = fn.update_and_apply(opt, grads, state, params, step=t)[1]
    grads = tree_map(lambda p: torch.randn(p.shape, generator=gen) * 0.1, params)
    want_updates, want_state = opt.update(_clone(grads), state, params, step=4)
    want_params = fn.apply_updates(params, want_updates)
    comm.calls = 0
    fn.update_and_apply(opt, _clone(grads), _clone(state), _clone(params), donate=True, step=4)
    calls = comm.calls
    assert calls == 3 * len(params)  # per leaf: scales, signs, the server's signs and scale
    for fail_at in range(1, calls + 1):
        p, live, spare, g = (_clone(x) for x in (params, state, state, grads))
        before = _clone((p, live, spare, g))
        comm.calls, comm.fail_at = 0, fail_at
        with pytest.raises(ConnectionError):
            fn.update_and_apply(opt, g, live, p, donate=spare, step=4)
        comm.fail_at = None
        assert same_bits((p, live, spare, g), before), f"call {fail_at} of {calls}: written"
        got = fn.update_and_apply(opt, g, live, p, donate=spare, step=4)
        assert same_bits(got, (want_params, want_state))


@pytest.fixture(scope="module")
def c_kernels():
    if _cpu.library() is None:
        pytest.skip("no working C compiler: the CPU kernels fall back to the reference")
    return _cpu


def _values(n, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return x * torch.logspace(-3, 3, n) if n else x


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 3000),
    bound=st.sampled_from([None, 7.27, 0.0, float("inf")]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    seed=st.integers(0, 2**16),
)
def test_adam_apply_matches_direction_then_add(c_kernels, n, bound, weight_decay, seed):
    m, p, v = _values(n, seed), _values(n, seed + 1), _values(n, seed + 2).square()
    if n > 5:
        v[3], m[1], p[1], p[2] = 0.0, 0.0, -0.0, -0.0
    eta = torch.tensor(3e-4)
    want = p.clone()
    u = torch.empty(n)
    decayed = want if weight_decay else None
    _reference.adam_direction(m, v, decayed, eta, u, 1e-8, bound, weight_decay)
    want.add_(u)
    for impl in (_reference, c_kernels):
        got = p.clone()
        impl.adam_apply(m, v, eta, got, torch.empty(n), 1e-8, bound, weight_decay)
        assert same_bits(got, want), impl.__name__


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.integers(1, 4),
    row_bytes=st.integers(1, 40),
    short=st.integers(0, 17),
    bound=st.sampled_from([None, 7.27]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    seed=st.integers(0, 2**16),
)
def test_adam_apply_with_signs_matches_unpack_then_apply(
    c_kernels, ranks, row_bytes, short, bound, weight_decay, seed
):
    """``m`` written from packed signs in the pass that uses it: the bits of
    ``unpack_scaled`` into ``m`` followed by ``adam_apply`` (a zero scale gives -0.0 / +0.0)."""
    n = max(0, ranks * row_bytes * 8 - short)
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (ranks, row_bytes), dtype=torch.uint8, generator=gen)
    scales = torch.rand(ranks, generator=gen) * torch.logspace(-3, 1, ranks)
    scales[0] = 0.0
    p, v = _values(n, seed + 1), _values(n, seed + 2).square()
    eta = torch.tensor(3e-4)
    want_m, want = torch.full((n,), 7.0), p.clone()
    _reference.unpack_scaled(packed, scales, want_m)
    _reference.adam_apply(want_m, v, eta, want, torch.empty(n), 1e-8, bound, weight_decay)
    for impl in (_reference, c_kernels):
        got_m, got = torch.full((n,), 7.0), p.clone()
        impl.adam_apply(
            got_m, v, eta, got, torch.empty(n), 1e-8, bound, weight_decay, (packed, scales)
        )
        assert same_bits(got_m, want_m) and same_bits(got, want), impl.__name__


def test_public_adam_apply_with_signs_writes_the_momentum_and_checks_them():
    m, p = torch.zeros(2, 4), torch.ones(2, 4)
    packed = torch.tensor([[0b10100000], [0b11111111]], dtype=torch.uint8)
    K.adam_apply(m, torch.ones(2, 4), torch.tensor(0.5), p, eps=0.0, signs=(packed, torch.ones(2)))
    assert m.flatten().tolist() == [1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0]
    assert p.flatten().tolist() == [0.5, 1.5, 0.5, 1.5, 1.5, 1.5, 1.5, 1.5]
    big = torch.ones(3, 4)
    with pytest.raises(ValueError, match="hold the params' 12 values"):
        K.adam_apply(big, big, torch.tensor(0.5), big, eps=0.0, signs=(packed[:1], torch.ones(1)))
    with pytest.raises(ValueError, match="weights must have shape"):
        K.adam_apply(m, m, torch.tensor(0.5), p, eps=0.0, signs=(packed, torch.ones(3)))


def test_public_adam_apply_checks_and_writes_the_params():
    p = torch.ones(4)
    out = K.adam_apply(torch.ones(4), torch.ones(4), torch.tensor(0.5), p, eps=0.0)
    assert out is p and p.tolist() == [0.5] * 4
    with pytest.raises(ValueError, match="fp32 of the params' shape"):
        K.adam_apply(torch.ones(3), torch.ones(4), torch.tensor(0.5), p, eps=0.0)
