"""The hierarchical 1-bit allreduce (``local_world_size``): bit for bit with the loop-over-ranks
reference on Simulated and on gloo ranks, the flat collective at ``L = 1``, the exact mean with
one node, bytes across nodes, and bad input raising on every rank before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fn.collectives import (
    ProcessGroup,
    Simulated,
    compressed_allreduce,
    init_error_feedback,
    onebit_allreduce,
    padded_numel,
    replicate,
    simulate,
)
from fn.collectives.onebit import compressed_allreduce_exchange, write_errors, write_result
from fn.errors import NonFiniteError
from tests._distributed import run_distributed, run_together
from tests.collectives import _reference as ref

# numpy and torch accumulate fp32 norms in different orders: the scales differ in the last bits.
REF_TOL = dict(atol=1e-5, rtol=1e-5)
LEVELS = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 2), (6, 3), (8, 2), (8, 4)]
SIZES = (1, 9, 100, 1027)
STEPS = 3


def _inputs(rank: int, n: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 10 * n + step)
    x = torch.randn(n, generator=g)
    if n >= 8:
        x[0], x[1] = 0.0, -0.0
    return x


@pytest.mark.parametrize(("w", "local"), LEVELS)
def test_padding_and_error_shapes_follow_the_level(w, local):
    comm = Simulated(w)
    for n in (0, 1, 33, 1000):
        n_padded = padded_numel(n, w, local)
        assert n_padded == ref.hierarchical_onebit_padded(n, w, local)
        assert n_padded >= n and n_padded % w == 0
        worker, server = init_error_feedback(n, comm=comm, local_world_size=local)
        assert worker.shape == (n_padded // local,) and server.shape == (n_padded // w,)
    assert padded_numel(77, w, 1) == padded_numel(77, w)


def _simulated_run(w: int, local: int | None, n: int) -> list[tuple[torch.Tensor, ...]]:
    """STEPS calls on Simulated(w): [(y, worker, server)] after each, every rank's row."""
    comm = Simulated(w)
    level = dict(comm=comm, local_world_size=local)
    car = simulate(lambda x, we, se: compressed_allreduce(x, we, se, **level), comm)
    we, se = replicate(tuple(init_error_feedback(n, **level)), comm)
    results = []
    for step in range(STEPS):
        y, we, se = car(torch.stack([_inputs(r, n, step) for r in range(w)]), we, se)
        results.append((y, we, se))
    return results


@pytest.mark.parametrize(("w", "local"), LEVELS)
@pytest.mark.parametrize("n", SIZES)
def test_simulated_matches_reference(w, local, n):
    zeros = init_error_feedback(n, comm=Simulated(w), local_world_size=local)
    ref_we = [zeros[0].numpy().copy() for _ in range(w)]
    ref_se = [zeros[1].numpy().copy() for _ in range(w)]
    for step, (y, we, se) in enumerate(_simulated_run(w, local, n)):
        xs = [_inputs(r, n, step).numpy() for r in range(w)]
        ys, ref_we, ref_se = ref.hierarchical_onebit_step(xs, ref_we, ref_se, local)
        assert all(torch.equal(y[0], y[r]) for r in range(w))  # every rank, the same bits
        np.testing.assert_allclose(y.numpy(), np.stack(ys), **REF_TOL)
        np.testing.assert_allclose(we.numpy(), np.stack(ref_we), **REF_TOL)
        np.testing.assert_allclose(se.numpy(), np.stack(ref_se), **REF_TOL)


@pytest.mark.parametrize(("w", "local"), [(4, 2), (6, 2), (6, 3), (8, 4)])
def test_node_mean_then_flat_across_nodes_bit_for_bit(w, local):
    """The rule's three steps composed by hand from fn's flat collective: the same bits."""
    n, nodes = 1027, w // local
    shard = padded_numel(n, w, local) // local
    across = Simulated(nodes)
    flat = simulate(lambda x, we, se: compressed_allreduce(x, we, se, comm=across), across)
    errors = [replicate(tuple(init_error_feedback(shard, comm=across)), across)] * local
    for step, (y, we, se) in enumerate(_simulated_run(w, local, n)):
        x = torch.zeros(w, local * shard)
        x[:, :n] = torch.stack([_inputs(r, n, step) for r in range(w)])
        pieces = x.view(nodes, local, local, shard)  # [node, rank in node, piece, shard]
        means = pieces[:, 0]
        for i in range(1, local):
            means = means + pieces[:, i]
        means = means / local  # [node, piece]: piece l is rank (node, l)'s shard
        results = []
        for position in range(local):
            y_l, *errors[position] = flat(means[:, position], *errors[position])
            results.append(y_l[0])
            for node in range(nodes):
                assert torch.equal(we[node * local + position], errors[position][0][node])
                assert torch.equal(se[node * local + position], errors[position][1][node])
        expected = torch.cat(results)[:n]
        assert all(torch.equal(y[r], expected) for r in range(w))


@pytest.mark.parametrize("w", [2, 4, 6])
def test_one_rank_per_node_is_the_flat_collective(w):
    comm = Simulated(w)
    n = 1000
    x = torch.stack([_inputs(r, n, 0) for r in range(w)])
    errors = replicate(tuple(init_error_feedback(n, comm=comm)), comm)
    flat = simulate(lambda x, we, se: compressed_allreduce(x, we, se, comm=comm), comm)
    one = simulate(
        lambda x, we, se: compressed_allreduce(x, we, se, comm=comm, local_world_size=1), comm
    )
    for a, b in zip(flat(x, *errors), one(x, *errors), strict=True):
        assert torch.equal(a, b)
    ys, _, _ = ref.onebit_step(list(x.numpy()), *(list(e.numpy()) for e in errors))
    hys, _, _ = ref.hierarchical_onebit_step(list(x.numpy()), *(list(e.numpy()) for e in errors), 1)
    np.testing.assert_array_equal(np.stack(ys), np.stack(hys))


def test_one_node_is_the_exact_mean():
    w = 4
    comm = Simulated(w)
    x = torch.stack([_inputs(r, 50, 0) for r in range(w)])
    errors = replicate(tuple(init_error_feedback(50, comm=comm, local_world_size=w)), comm)
    car = simulate(
        lambda x, we, se: compressed_allreduce(x, we, se, comm=comm, local_world_size=w), comm
    )
    y, we, se = car(x, *errors)
    mean = ((x[0] + x[1]) + x[2] + x[3]) / 4
    assert all(torch.equal(y[r], mean) for r in range(w))
    assert torch.equal(we, errors[0]) and torch.equal(se, errors[1])


def test_bytes_across_nodes_are_a_fraction_of_flat():
    w, local, n = 4, 2, 1 << 16
    x = torch.stack([_inputs(r, n, 0) for r in range(w)])

    def sent(level):
        comm = Simulated(w)
        errors = replicate(tuple(init_error_feedback(n, comm=comm, local_world_size=level)), comm)
        simulate(
            lambda x, we, se: compressed_allreduce(x, we, se, comm=comm, local_world_size=level),
            comm,
        )(x, *errors)
        return comm.bytes_sent_by_hop, comm.bytes_sent

    flat, flat_total = sent(None)
    hier, hier_total = sent(local)
    assert flat["intra"] == flat["inter"] == 0 and flat["world"] == flat_total
    assert hier["world"] == 12 * (w - 1)  # the size record only
    assert hier["inter"] <= flat["world"] / local
    assert hier["intra"] >= 4 * n * (local - 1) / local  # the dense reduce-scatter
    assert sum(hier.values()) == hier_total


@pytest.mark.parametrize("local", [0, -1, 3, 2.0])
def test_bad_local_world_size_raises(local):
    comm = Simulated(4)
    with pytest.raises(ValueError, match="local_world_size"):
        init_error_feedback(8, comm=comm, local_world_size=local)
    with pytest.raises(ValueError, match="local_world_size"):
        onebit_allreduce(comm=comm, local_world_size=local)


def test_flat_errors_are_refused_by_the_hierarchical_call():
    comm = Simulated(4)
    errors = replicate(tuple(init_error_feedback(100, comm=comm)), comm)
    car = simulate(
        lambda x, we, se: compressed_allreduce(x, we, se, comm=comm, local_world_size=2), comm
    )
    with pytest.raises(ValueError, match=r"\(2 per node\) needs errors of shapes \(64,\)"):
        car(torch.zeros(4, 100), *errors)


def test_onebit_allreduce_transform_matches_reference():
    w, local = 4, 2
    comm = Simulated(w)
    tx = onebit_allreduce(comm=comm, local_world_size=local)
    grads = {"a": torch.stack([_inputs(r, 30, 1) for r in range(w)]), "b": None}
    state = simulate(tx.init, comm)(grads)
    assert state.worker_error["a"].shape == (w, padded_numel(30, w, local) // local)
    updates, state = simulate(tx.update, comm)(grads, state)
    zeros_w = [np.zeros(padded_numel(30, w, local) // local, np.float32)] * w
    zeros_s = [np.zeros(padded_numel(30, w, local) // w, np.float32)] * w
    ys, _, _ = ref.hierarchical_onebit_step(list(grads["a"].numpy()), zeros_w, zeros_s, local)
    np.testing.assert_allclose(updates["a"].numpy(), np.stack(ys), **REF_TOL)
    assert updates["b"] is None


# ----------------------------------------------------------------------------- gloo ranks


def _gloo_worker(rank: int, world_size: int, local: int) -> bool:
    """Pure and donated (out=) calls on real ranks against Simulated, bit for bit; the momentum
    exchange against the pure call on the momentum."""
    comm = ProcessGroup()
    level = dict(comm=comm, local_world_size=local)
    for n in SIZES:
        errors = tuple(init_error_feedback(n, **level))
        pure, donated = errors, tuple(e.clone() for e in errors)
        m_pure, m_errors = torch.zeros(n), errors
        m_fast, fast_errors = torch.zeros(n), tuple(e.clone() for e in errors)
        beta = 0.5
        simulated = _simulated_run(world_size, local, n)
        for step in range(STEPS):
            xs = [_inputs(r, n, step) for r in range(world_size)]
            y, *pure = compressed_allreduce(xs[rank], *pure, **level)
            x_in = xs[rank].clone()
            out = compressed_allreduce(x_in, *donated, **level, out=(x_in, *donated))
            assert out[0] is x_in and out[1] is donated[0] and out[2] is donated[1]
            expected = [t[rank] for t in simulated[step]]
            for got in (pure, donated):
                assert torch.equal(y, expected[0]) and torch.equal(out[0], expected[0])
                assert torch.equal(got[0], expected[1]) and torch.equal(got[1], expected[2])

            g = xs[rank]
            momentum = (beta * m_pure).add_((1 - beta) * g)
            m_pure, *m_errors = compressed_allreduce(momentum, *m_errors, **level)
            exchange = compressed_allreduce_exchange(
                m_fast, *fast_errors, grad=g, beta=beta, **level
            )
            if world_size == local:
                assert exchange is None  # one node: the caller takes the pure path
                continue
            fast_errors = write_errors(exchange, *fast_errors)
            assert write_result(exchange, m_fast) is m_fast
            assert torch.equal(m_fast, m_pure), (n, step)
            assert all(torch.equal(a, b) for a, b in zip(fast_errors, m_errors, strict=True))
    return True


NONFINITE = [(2, 3), (2, 0), (4, 1)]  # (local_world_size, the rank with the NaN)


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list]:
    """The 4-rank workers of this file, in one launch; the ranks that disagree on the level
    (and may build different groups) last."""
    parts = {
        "reference": (_gloo_worker, (2,)),
        **{f"nonfinite {case}": (_nonfinite_worker, case) for case in NONFINITE},
        "disagree": (_disagree_worker, ()),
        "split disagree": (_split_disagree_worker, ()),
    }
    return run_together(parts, 4, timeout=600)


@pytest.mark.timeout(700)
def test_gloo_matches_reference_at_two_ranks_per_node(four_ranks):
    assert four_ranks["reference"] == [True] * 4


@pytest.mark.timeout(300)
def test_gloo_matches_reference_on_one_node():
    assert run_distributed(_gloo_worker, 2, 2, timeout=240) == [True] * 2


def _disagree_worker(rank: int, world_size: int) -> list[str]:
    """Two levels, then a flat rank among hierarchical ones (it went on to the signs' exchange
    and timed out, while the others raised)."""
    comm = ProcessGroup(timeout=60)
    messages = []
    for local in (2 if rank == 0 else 4, None if rank == 0 else 2):
        errors = init_error_feedback(100, comm=comm, local_world_size=local)
        with pytest.raises(ValueError, match="different local_world_size") as raised:
            compressed_allreduce(torch.ones(100), *errors, comm=comm, local_world_size=local)
        messages.append(str(raised.value))
    return messages


@pytest.mark.timeout(700)
def test_gloo_ranks_that_disagree_on_the_level_raise_together(four_ranks):
    levels, flat = zip(*four_ranks["disagree"], strict=True)
    assert len(set(levels)) == 1 and "rank 0: 2, rank 1: 4" in levels[0]
    assert len(set(flat)) == 1 and "rank 0: None, rank 1: 2" in flat[0]


def _nonfinite_worker(rank: int, world_size: int, local: int, bad_rank: int) -> bool:
    """The pure, donated and exchange calls in turn, each with a NaN on ``bad_rank``: every
    rank raises and keeps its tensors; then a good call still runs."""
    comm = ProcessGroup(timeout=60)
    level = dict(comm=comm, local_world_size=local)
    for way in ("pure", "donated", "exchange"):
        x = _inputs(rank, 1000, 0)
        we, se = init_error_feedback(1000, **level)
        we, se = we + 0.25, se - 0.5
        if rank == bad_rank:
            x[5] = float("nan")
        kept = (x.clone(), we.clone(), se.clone())
        with pytest.raises(NonFiniteError, match="non-finite"):
            if way == "pure":
                compressed_allreduce(x, we, se, **level)
            elif way == "donated":
                compressed_allreduce(x, we, se, **level, out=(x, we, se))
            elif compressed_allreduce_exchange(x, we, se, **level) is None:  # one node
                compressed_allreduce(x, we, se, **level)
        assert all(_same(a, b) for a, b in zip((x, we, se), kept, strict=True)), way
    good = _inputs(rank, 1000, 1)
    y, *_ = compressed_allreduce(good, *init_error_feedback(1000, **level), **level)
    return bool(torch.isfinite(y).all())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.timeout(700)
@pytest.mark.parametrize(("local", "bad_rank"), NONFINITE)
def test_gloo_nonfinite_on_one_rank_raises_on_every_rank_and_writes_nothing(
    local, bad_rank, four_ranks
):
    assert four_ranks[f"nonfinite {(local, bad_rank)}"] == [True] * 4


def _split_disagree_worker(rank: int, world_size: int) -> str:
    comm = ProcessGroup(timeout=60)
    with pytest.raises(ValueError, match="different local_world_size") as raised:
        onebit_allreduce(comm=comm, local_world_size=1 if rank == 1 else 2)  # builds the groups
    return str(raised.value)


@pytest.mark.timeout(700)
def test_gloo_transforms_built_with_different_levels_raise_together(four_ranks):
    messages = four_ranks["split disagree"]
    assert len(set(messages)) == 1 and "rank 1: 1, rank 2: 2" in messages[0]
