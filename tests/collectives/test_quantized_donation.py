"""Buffer donation of the quantized collectives: donated results are bit-identical to the pure
call (on Simulated, and on real gloo ranks where the fused kernels run), a failing call leaves
every buffer intact, and the steady state allocates no full-size buffer."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from fn.collectives import (
    ProcessGroup,
    Simulated,
    loco_allreduce,
    quantized_allreduce,
    quantized_padded_numel,
    quantized_reduce_scatter,
    replicate,
    simulate,
)
from fn.tree import tree_map
from tests._distributed import run_distributed, run_together
from tests._mirror import Mirror, same_bits
from tests.collectives.test_onebit_donate import _tree_mirror_case

GROUP = 32
STEPS = 5
RESET_T = 2  # the errors are reset before calls 0, 2 and 4


def _clone(tree):
    return tree_map(lambda t: t.clone(), tree)


def _inputs(w: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100 * w + n)
    return torch.randn(STEPS, w, n, generator=g) * torch.logspace(-3, 3, n)


def _loco(comm, local, bits=4):
    return loco_allreduce(bits, GROUP, 0.8, RESET_T, comm=comm, local_world_size=local)


def _compare_donation(update, init, xs) -> None:
    """Pure vs in place (donate=True) vs into a separate donated state, call after call."""
    pure, inplace, current, spare = init(), init(), init(), init()
    for x in xs:
        y_pure, pure = update({"x": x.clone()}, pure)

        updates = {"x": x.clone()}
        y, inplace = update(updates, inplace, donate=True)
        assert y["x"] is updates["x"]
        assert torch.equal(y["x"], y_pure["x"])

        before = _clone(current)
        y, new = update({"x": x.clone()}, current, donate=spare)
        assert torch.equal(y["x"], y_pure["x"])
        for kept, now in zip(before.errors["x"], current.errors["x"], strict=True):
            assert torch.equal(kept, now)  # the state given (not donated) is not written
        for got, buffer in zip(new.errors["x"], spare.errors["x"], strict=True):
            assert got is buffer  # written into the donated state's buffers
        current, spare = new, current

        for state in (inplace, current):
            assert torch.equal(state.count, pure.count)
            for a, b in zip(pure.errors["x"], state.errors["x"], strict=True):
                assert torch.equal(a, b)


@pytest.mark.parametrize(("w", "local"), [(2, None), (4, None), (4, 2)])
def test_loco_donated_matches_pure_on_simulated(w, local):
    comm = Simulated(w)
    tx = _loco(comm, local)
    n = 1000
    update = simulate(tx.update, comm)
    _compare_donation(
        lambda u, s, **kw: update(u, s, **kw),
        lambda: replicate(tx.init({"x": torch.zeros(n)}), comm),
        _inputs(w, n),
    )


def test_quantized_allreduce_and_reduce_scatter_donated_on_simulated():
    comm = Simulated(2)
    tx = quantized_allreduce(4, GROUP, comm=comm)
    x = _inputs(2, 300)[0]
    pure, _ = simulate(tx.update, comm)({"x": x.clone()}, tx.init(None))
    updates = {"x": x.clone()}
    donated, _ = simulate(lambda u, s: tx.update(u, s, donate=True), comm)(updates, tx.init(None))
    assert torch.equal(pure["x"], donated["x"])

    def shard(x, out=None):
        return quantized_reduce_scatter(x, comm=comm, group_size=GROUP, out=out)

    out = torch.full((2, 160), 7.0)
    assert torch.equal(simulate(shard, comm)(x), simulate(shard, comm)(x, out))
    with pytest.raises(ValueError, match="out must be fp32"):
        quantized_reduce_scatter(x[0], comm=Simulated(2), group_size=GROUP, out=torch.empty(3))


# Real gloo ranks: the fused kernels run (no vmap).


def _gloo_compare(rank, world_size, local, n):
    comm = ProcessGroup()
    torch.manual_seed(0)
    xs = _inputs(world_size, n)[:, rank]
    tx = _loco(comm, local)
    _compare_donation(tx.update, lambda: tx.init({"x": torch.zeros(n)}), xs)

    plain = quantized_allreduce(4, GROUP, comm=comm, local_world_size=local)
    for x in xs[:2]:
        pure, _ = plain.update({"x": x.clone()}, plain.init(None))
        updates = {"x": x.clone()}
        donated, _ = plain.update(updates, plain.init(None), donate=True)
        assert donated["x"] is updates["x"] and torch.equal(donated["x"], pure["x"])
        half = {"x": x.clone().to(torch.bfloat16)}
        pure, _ = plain.update({"x": half["x"].clone()}, plain.init(None))
        donated, _ = plain.update(half, plain.init(None), donate=True)
        assert donated["x"] is half["x"] and torch.equal(donated["x"], pure["x"])
        kwargs = dict(comm=comm, group_size=GROUP, local_world_size=local)
        shard = quantized_reduce_scatter(x, **kwargs)
        out = torch.full_like(shard, 7.0)
        assert quantized_reduce_scatter(x, **kwargs, out=out) is out
        assert torch.equal(out, shard)
    return True


@pytest.fixture(scope="module")
def gloo() -> dict[str, list]:
    """The workers of this file but the page-fault counts, in one launch on 2 ranks and one on
    4 (n = 1000 pads to whole chunks; 4096 ranks' chunks are whole vectors of 32 values)."""
    two = {
        f"{case} {local}": (worker, args)
        for local in (None, 1)
        for case, worker, args in (
            ("compare", _gloo_compare, (local, 1000)),
            ("non-finite", _gloo_non_finite, (local,)),
        )
    }
    four = {
        "compare 2": (_gloo_compare, (2, 4096)),
        "streamed": (_gloo_compare_streamed, ()),
        "non-finite None": (_gloo_non_finite, (None,)),
    }
    return {
        **{f"2 {name}": r for name, r in run_together(two, 2, timeout=300).items()},
        **{f"4 {name}": r for name, r in run_together(four, 4, timeout=400).items()},
    }


@pytest.mark.distributed
@pytest.mark.timeout(800)
def test_donated_matches_pure_on_gloo(gloo):
    for local in (None, 1):
        assert gloo[f"2 compare {local}"] == [True] * 2
    assert gloo["4 compare 2"] == [True] * 4


def _gloo_compare_streamed(rank, world_size):
    """One hop on 4 ranks: the chunks go point to point; n = 1 leaves 3 chunks all padding."""
    for n in (1000, 1):
        _gloo_compare(rank, world_size, None, n)
    return True


@pytest.mark.distributed
@pytest.mark.timeout(800)
def test_donated_streamed_matches_pure_on_four_gloo_ranks(gloo):
    assert gloo["4 streamed"] == [True] * 4


def _gloo_non_finite(rank, world_size, local):
    comm = ProcessGroup()
    n = 1000
    tx = _loco(comm, local)
    state = tx.init({"x": torch.zeros(n)})
    x = _inputs(world_size, n)[:, rank]
    _, state = tx.update({"x": x[0].clone()}, state, donate=True)
    _, state = tx.update({"x": x[1].clone()}, state, donate=True)  # errors now nonzero
    bad = x[2].clone()
    if rank == 1:
        bad[17] = torch.nan
    before, bad_before = _clone(state), bad.clone()
    with pytest.raises(ValueError, match="non-finite"):
        tx.update({"x": bad}, state, donate=True)
    assert torch.equal(bad.isnan(), bad_before.isnan())
    assert torch.equal(torch.nan_to_num(bad), torch.nan_to_num(bad_before))
    for a, b in zip(before.errors["x"], state.errors["x"], strict=True):
        assert torch.equal(a, b)
    out = torch.full((quantized_padded_numel(n, world_size, GROUP) // world_size,), 7.0)
    with pytest.raises(ValueError, match="non-finite"):
        quantized_reduce_scatter(bad, comm=comm, group_size=GROUP, local_world_size=local, out=out)
    assert bool((out == 7.0).all())
    return True


@pytest.mark.distributed
@pytest.mark.timeout(800)
def test_non_finite_on_one_rank_raises_everywhere_buffers_intact(gloo):
    for local in (None, 1):
        assert gloo[f"2 non-finite {local}"] == [True, True]
    # rank 1's NaN is in the chunk it sends to rank 0 only: ranks 2 and 3 learn it from the
    # flag that follows the chunks
    assert gloo["4 non-finite None"] == [True] * 4


WINDOWS = 4  # of 3 calls each, after 2 warm-up calls
FRESH = "spawn"  # ranks that read the MALLOC_* settings at their start and own their whole heap


def count_full_size_faults_only(monkeypatch) -> None:
    """Makes the ranks' glibc map every block from 4 MiB (each full-size buffer in these tests:
    n or n / W fp32 values) afresh, so that such an allocation faults in every window, and
    serve smaller ones from one heap it never trims. The small temporaries the donation
    protocol allows (the received 4-bit codes, 2 MiB; the scales) still grow that heap now and
    then: the tests take the fewest faults of a few windows."""
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(4 << 20))
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(1 << 30))


def _gloo_page_faults(rank, world_size, donate):
    """The fewest minor page faults of WINDOWS windows of 3 steady-state loco_allreduce calls."""
    comm = ProcessGroup()
    n = 1 << 22
    tx = _loco(comm, None)
    torch.manual_seed(rank)
    updates = {"x": torch.randn(n)}
    state = tx.init(updates)
    kwargs = {"donate": True} if donate else {}
    for _ in range(2):  # warm-up: workspaces and kernels
        updates, state = tx.update(updates, state, **kwargs)
    windows = []
    for _ in range(WINDOWS):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            updates, state = tx.update(updates, state, **kwargs)
        windows.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
    return min(windows)


@pytest.mark.distributed
@pytest.mark.timeout(560)  # two launches of fresh ranks, 250 s each at most
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc tuning needs glibc")
def test_donated_loco_steady_state_allocates_no_full_size_buffer(monkeypatch):
    count_full_size_faults_only(monkeypatch)
    pages_of_one_buffer = (1 << 22) * 4 // resource.getpagesize()
    faults = run_distributed(_gloo_page_faults, 2, True, timeout=250, start_method=FRESH)
    assert max(faults) < pages_of_one_buffer // 4, faults
    # The measure can fail: the pure path faults in several full-size buffers per call.
    faults = run_distributed(_gloo_page_faults, 2, False, timeout=250, start_method=FRESH)
    assert min(faults) >= pages_of_one_buffer // 4, faults


@pytest.mark.parametrize(
    "make",
    [lambda comm: loco_allreduce(comm=comm), lambda comm: quantized_allreduce(comm=comm)],
    ids=["loco_allreduce", "quantized_allreduce"],
)
def test_a_later_leafs_failed_check_leaves_earlier_leaves_intact(make):
    _tree_mirror_case(make, "c")


@pytest.mark.parametrize(
    "make",
    [lambda comm: loco_allreduce(comm=comm), lambda comm: quantized_allreduce(comm=comm)],
    ids=["loco_allreduce", "quantized_allreduce"],
)
def test_donated_zero_dim_and_empty_leaves_match_pure(make):
    """On two (mirrored) ranks, through the fused donated path."""
    tx = make(Mirror())
    gen = torch.Generator().manual_seed(0)
    params = {"x": torch.randn(300, generator=gen), "s": torch.tensor(0.3), "e": torch.zeros(0)}
    pure_state, state = tx.init(params), tx.init(params)
    for _ in range(3):
        grads = tree_map(lambda p: torch.randn(p.shape, generator=gen), params)
        want, pure_state = tx.update(tree_map(torch.clone, grads), pure_state)
        got, state = tx.update(grads, state, donate=True)
        assert same_bits((got, state), (want, pure_state))
        assert got["x"] is grads["x"]
