"""compressed_allreduce with output buffers (buffer donation): bit-identical to the pure call on
Simulated and on real gloo ranks, nothing written when a check fails, and no fresh full-size
tensor in steady state (counted as minor page faults)."""

from __future__ import annotations

import resource

import pytest
import torch

from fn.collectives import (
    ProcessGroup,
    Simulated,
    compressed_allreduce,
    init_error_feedback,
    onebit_allreduce,
    replicate,
    simulate,
)
from fn.collectives.onebit import compressed_allreduce_exchange, write_errors, write_result
from fn.tree import tree_map
from tests._distributed import run_distributed, run_together
from tests._mirror import Mirror, same_bits

SIZES = (1, 7, 8, 1000, 4099, 70001)
STEPS = 3


def _inputs(rank: int, n: int, step: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * n + step)
    x = torch.randn(n, generator=g)
    if n >= 8:
        x[0], x[1] = 0.0, -0.0
    return x.to(dtype)


def _clone_all(*tensors):
    return tuple(t.clone() for t in tensors)


def _check_donated_run(comm, rank: int, n: int, dtype) -> None:
    """STEPS calls: pure, in place (out = the inputs), and into separate buffers."""
    we, se = init_error_feedback(n, comm=comm)
    pure = (we, se)
    inplace = _clone_all(we, se)
    spare = _clone_all(we, se)
    for step in range(STEPS):
        x = _inputs(rank, n, step, dtype)
        y, *pure = compressed_allreduce(x, *pure, comm=comm)
        x_in = x.clone()
        got = compressed_allreduce(x_in, *inplace, comm=comm, out=(x_in, *inplace))
        assert got[0] is x_in and got[1] is inplace[0] and got[2] is inplace[1]
        buffers = (torch.empty_like(x), torch.empty_like(spare[0]), torch.empty_like(spare[1]))
        other = compressed_allreduce(x, *spare, comm=comm, out=buffers)
        assert all(a is b for a, b in zip(other, buffers, strict=True))
        spare = other[1:]
        for result in (got, other):
            assert torch.equal(result[0], y), (n, step)
            assert torch.equal(result[1], pure[0]) and torch.equal(result[2], pure[1]), (n, step)


def _check_momentum_run(comm, rank: int, n: int) -> None:
    beta = 0.9
    m = _inputs(rank + 7, n, 0)
    we, se = init_error_feedback(n, comm=comm)
    m_pure, pure = m.clone(), (we, se)
    m_don, don = m.clone(), _clone_all(we, se)
    for step in range(STEPS):
        g = _inputs(rank, n, step)
        x = (beta * m_pure).add_((1 - beta) * g)
        m_pure, *pure = compressed_allreduce(x, *pure, comm=comm)
        exchange = compressed_allreduce_exchange(m_don, *don, comm=comm, grad=g, beta=beta)
        assert exchange is not None
        don = write_errors(exchange, *don)
        assert write_result(exchange, m_don) is m_don
        assert torch.equal(m_don, m_pure), (n, step)
        assert torch.equal(don[0], pure[0]) and torch.equal(don[1], pure[1])


def _donated_worker(rank: int, world_size: int) -> bool:
    comm = ProcessGroup()
    for n in SIZES:
        for dtype in (torch.float32, torch.bfloat16):
            _check_donated_run(comm, rank, n, dtype)
        _check_momentum_run(comm, rank, n)
    return True


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list]:
    """The 2-rank workers of this file but the page-fault counts, in one launch."""
    return run_together(
        {"donated": (_donated_worker, ()), "nan": (_nan_worker, ())}, 2, timeout=400
    )


@pytest.mark.timeout(500)
def test_gloo_donated_matches_pure_on_two_ranks(two_ranks):
    assert two_ranks["donated"] == [True] * 2


@pytest.mark.timeout(300)
def test_gloo_donated_matches_pure_on_three_ranks():
    assert run_distributed(_donated_worker, 3, timeout=240) == [True] * 3


def test_simulated_donated_matches_pure():
    comm = Simulated(3)
    for n in (7, 1000):
        x = torch.randn(STEPS, 3, n)
        we, se = replicate(init_error_feedback(n, comm=comm), comm)
        pure = simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm)

        def donated(x, a, b):
            return compressed_allreduce(x, a, b, comm=comm, out=(x, a, b))

        state_p, state_d = (we, se), (we.clone(), se.clone())
        for t in range(STEPS):
            y, *state_p = pure(x[t], *state_p)
            x_d = x[t].clone()
            got = simulate(donated, comm)(x_d, *state_d)
            state_d = got[1:]
            assert torch.equal(got[0], y) and torch.equal(x_d, y)
            assert all(torch.equal(a, b) for a, b in zip(state_d, state_p, strict=True))


def test_onebit_allreduce_donate_matches_pure():
    comm = Simulated(2)
    tx = onebit_allreduce(comm=comm)
    grads = {"w": torch.randn(2, 5, 3), "b": torch.randn(2, 7)}
    state = simulate(tx.init, comm)(grads)
    update = simulate(tx.update, comm)
    donated = simulate(lambda u, s: tx.update(u, s, donate=True), comm)
    pure_state, don_state = state, tree_map(torch.clone, state)
    for _ in range(STEPS):
        want, pure_state = update(grads, pure_state)
        u = {k: v.clone() for k, v in grads.items()}
        got, don_state = donated(u, don_state)
        for k in grads:
            assert torch.equal(got[k], want[k]) and torch.equal(u[k], want[k])
            assert torch.equal(don_state.worker_error[k], pure_state.worker_error[k])
            assert torch.equal(don_state.server_error[k], pure_state.server_error[k])


def _nan_worker(rank: int, world_size: int) -> bool:
    comm = ProcessGroup()
    n = 1000
    we, se = init_error_feedback(n, comm=comm)
    we.normal_(), se.normal_()
    x = _inputs(rank, n, 0)
    if rank == world_size - 1:
        x[17] = float("nan")
    before = _clone_all(x, we, se)
    for fused in (False, True):
        with pytest.raises(ValueError, match="non-finite"):
            if fused:
                exchange = compressed_allreduce_exchange(
                    x, we, se, comm=comm, grad=x.clone(), beta=0.9
                )
                write_errors(exchange, we, se)
                write_result(exchange, x)
            else:
                compressed_allreduce(x, we, se, comm=comm, out=(x, we, se))
        for a, b in zip((x, we, se), before, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    return True


@pytest.mark.timeout(500)
def test_gloo_nonfinite_on_one_rank_leaves_buffers_intact(two_ranks):
    assert two_ranks["nan"] == [True, True]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _fault_worker(rank: int, world_size: int, n: int, donated: bool) -> int:
    comm = ProcessGroup()
    x = _inputs(rank, n, 0)
    we, se = init_error_feedback(n, comm=comm)
    state = (x, we, se)

    def call(state):
        x, we, se = state
        return compressed_allreduce(x, we, se, comm=comm, out=state if donated else None)

    for _ in range(2):
        state = call(state)
    before = _minor_faults()
    for _ in range(3):
        state = call(state)
    return _minor_faults() - before


def assert_steady_state_faults(monkeypatch, worker, n: int) -> None:
    """Runs ``worker(rank, world_size, n, donated)`` (it returns its minor page faults over a few
    steady-state calls) on 2 gloo ranks: pure, then donated. The pure run must show its fresh
    tensors, the donated one fewer faults than half the pages of one n-element buffer over all
    its calls: one fresh full-size tensor per call would fault them all, while the received
    signs (1/32 of the data per exchange), gloo's buffers and new thread arenas vary between
    about 300 and 1,300 pages at n = 2^22."""
    # glibc serves a 16 MiB tensor from its heap once its adaptive mmap threshold has grown
    # (then a fresh tensor may not fault); a fixed threshold makes every one a fresh mmap, as
    # tensors from 32 MiB on always are. Donated buffers are unaffected. The ranks are fresh
    # interpreters (spawned): glibc reads the setting at a process's start.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    limit = n * 4 // resource.getpagesize() // 2
    pure = run_distributed(worker, 2, n, False, timeout=240, start_method="spawn")
    assert min(pure) > limit, f"the measurement cannot see fresh tensors: {pure}"
    donated = run_distributed(worker, 2, n, True, timeout=240, start_method="spawn")
    assert max(donated) < limit, f"minor page faults per rank {donated} (limit {limit})"


@pytest.mark.timeout(540)  # two launches of fresh ranks, 240 s each at most
def test_gloo_steady_state_allocates_no_full_size_tensor(monkeypatch):
    assert_steady_state_faults(monkeypatch, _fault_worker, 1 << 22)


def _tree_mirror_case(make_transform, leaf):
    """A donated update of a 3-leaf tree on two (mirrored) ranks whose leaf ``leaf`` holds a
    NaN: the error must leave every donated buffer (state, spare and updates) as it was."""
    comm = Mirror()
    tx = make_transform(comm)
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(n, generator=gen) for k, n in (("a", 300), ("b", 35), ("c", 64))}
    state = tx.init(params)
    for _ in range(2):
        _, state = tx.update(tree_map(torch.randn_like, params), state)
    for donate in ("in place", "spare"):
        live, spare = tree_map(torch.clone, state), tree_map(torch.clone, state)
        updates = tree_map(torch.randn_like, params)
        updates[leaf][3] = float("nan")
        before = tree_map(torch.clone, (live, spare, updates))
        with pytest.raises(ValueError, match="non-finite"):
            tx.update(updates, live, donate=True if donate == "in place" else spare)
        assert same_bits((live, spare, updates), before), f"{donate}: a buffer was written"


@pytest.mark.parametrize("leaf", ["b", "c"])
def test_onebit_allreduce_checks_every_leaf_before_writing_any(leaf):
    _tree_mirror_case(lambda comm: onebit_allreduce(comm=comm), leaf)
