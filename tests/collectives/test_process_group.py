"""ProcessGroup on real gloo processes: one launch of 4 ranks runs every case (world, sub-groups
of 3 and 2 ranks, split(2)); the parent compares each rank's results with Simulated and the
loop-over-ranks references, and the byte counts with Simulated's."""

from __future__ import annotations

import pytest
import torch

from fn.base import EmptyState
from fn.collectives import (
    ProcessGroup,
    Simulated,
    compressed_allreduce,
    init_error_feedback,
    loco_allreduce,
    quantized_allreduce,
    simulate,
)
from tests._distributed import run_distributed
from tests.collectives import _reference as ref
from tests.collectives import test_comm, test_onebit, test_quantized

pytestmark = pytest.mark.distributed

WORLD = 4
QUANTIZED_CASES = [  # (world size, local_world_size, loco)
    (2, None, True),
    (3, None, True),
    (4, None, True),
    (4, None, False),
    (4, 2, True),
    (4, 2, False),
]
QUANTIZED_SIZES = (1, 1000, 4099)
LOCO = dict(beta=0.8, reset_t=2)


def _quantized_tx(comm, local, loco):
    if loco:
        return loco_allreduce(
            4,
            test_quantized.GROUP,
            LOCO["beta"],
            LOCO["reset_t"],
            comm=comm,
            local_world_size=local,
        )
    return quantized_allreduce(4, test_quantized.GROUP, comm=comm, local_world_size=local)


def _worker(rank, world_size):
    import torch.distributed as dist

    world = ProcessGroup()
    subgroups = {w: dist.new_group(list(range(w))) for w in (3, 2)}  # called on every rank
    comms = {WORLD: world}
    comms.update({w: ProcessGroup(g) for w, g in subgroups.items() if rank < w})
    out = {}
    for w, comm in comms.items():
        inputs = test_comm.per_rank_inputs(w)
        res = test_comm.collectives(
            comm, inputs["vec"][rank], inputs["chunked"][rank], inputs["bytes"][rank]
        )
        out["collectives", w] = res, comm.reset_bytes_sent()
        out["received", w] = comm.reset_bytes_received()
    for hop in (0, 1):
        sub = world.split(2)[hop]
        inputs = test_comm.per_rank_inputs(WORLD, seed=hop)
        c, b = inputs["chunked"][rank][: sub.world_size], inputs["bytes"][rank][: sub.world_size]
        res = test_comm.collectives(sub, inputs["vec"][rank], c, b)
        out["split", hop] = res, world.reset_bytes_sent()
        out["received by hop", hop] = world.bytes_received_by_hop
        world.reset_bytes_received()
    for w, comm in comms.items():
        for n in test_onebit.SIZES:
            x = test_onebit.make_inputs(w, n, test_onebit.STEPS)
            we, se = init_error_feedback(n, comm=comm)
            ys = []
            for t in range(test_onebit.STEPS):
                y, we, se = compressed_allreduce(x[t, rank], we, se, comm=comm)
                ys.append(y)
            out["onebit", w, n] = (torch.stack(ys), we, se), comm.reset_bytes_sent()
    for w, local, loco in QUANTIZED_CASES:
        if w not in comms:
            continue
        tx = _quantized_tx(comms[w], local, loco)
        for n in QUANTIZED_SIZES:
            x = test_quantized.make_inputs(w, n, 3)
            state = tx.init({"x": torch.zeros(n)})
            ys = []
            for t in range(3):
                y, state = tx.update({"x": x[t, rank]}, state)
                ys.append(y["x"])
            out["quantized", w, local, loco, n] = (
                (torch.stack(ys), state),
                comms[w].reset_bytes_sent(),
            )
    # point to point (the donated quantized allreduce on one hop): each rank receives from
    # every peer what it sends to it
    world.reset_bytes_received()
    tx = quantized_allreduce(4, test_quantized.GROUP, comm=world)
    tx.update({"x": torch.randn(1000)}, EmptyState(), donate=True)
    out["point to point"] = world.reset_bytes_sent(), world.reset_bytes_received()
    # Non-finite values on rank 1 only: every rank must raise (nobody may wait forever).
    bad = torch.randn(300)
    if rank == 1:
        bad[7] = float("nan")
    raised = []
    we, se = init_error_feedback(300, comm=world)
    for run in (
        lambda: compressed_allreduce(bad, we, se, comm=world),
        lambda: _with_raising_kernel(lambda: compressed_allreduce(bad, we, se, comm=world)),
        lambda: _quantized_tx(world, None, True).update({"x": bad}, _state(world, None)),
        lambda: _quantized_tx(world, 2, True).update({"x": bad}, _state(world, 2)),
    ):
        try:
            run()
            raised.append(False)
        except ValueError as err:
            raised.append("non-finite" in str(err))
    out["non_finite"] = raised
    return out


def _with_raising_kernel(run):
    """Runs ``run`` with a sign_compress that raises on a non-finite scale, as the contract
    allows kernels to do: the raising rank must still let the others raise instead of hang."""
    from fn import kernels

    original = kernels.sign_compress

    def raising(m, error=None):
        packed, scale, new_error = original(m, error)
        if not torch.isfinite(scale):
            raise ValueError("sign_compress: non-finite scale")
        return packed, scale, new_error

    kernels.sign_compress = raising
    try:
        return run()
    finally:
        kernels.sign_compress = original


def _state(comm, local):
    return _quantized_tx(comm, local, True).init({"x": torch.zeros(300)})


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout=150)


@pytest.mark.timeout(180)
def test_plain_collectives_and_bytes(results):
    for w in (4, 3, 2):
        inputs = test_comm.per_rank_inputs(w)
        expected = test_comm.reference(inputs)
        for r in range(w):
            got, nbytes = results[r]["collectives", w]
            for key, want in expected.items():
                torch.testing.assert_close(got[key], torch.as_tensor(want[r]), msg=key)
            assert nbytes == test_comm.expected_bytes(w, w)


@pytest.mark.timeout(180)
def test_every_rank_counts_what_it_receives(results):
    """A collective receives what it sends (the count of Simulated, by level); point to point,
    each message once, at its receiver."""
    for w in (4, 3, 2):
        for r in range(w):
            assert results[r]["received", w] == test_comm.expected_bytes(w, w)
    for hop in (0, 1):
        level = ("intra", "inter")[hop]
        expected = {"world": 0, "intra": 0, "inter": 0, level: test_comm.expected_bytes(WORLD, 2)}
        assert all(results[r]["received by hop", hop] == expected for r in range(WORLD))
    comm = Simulated(WORLD)
    tx = quantized_allreduce(4, test_quantized.GROUP, comm=comm)
    x = {"x": torch.randn(WORLD, 1000)}
    simulate(tx.update, comm)(x, tx.init(x))
    for r in range(WORLD):
        sent, received = results[r]["point to point"]
        assert sent == received == comm.bytes_received == comm.bytes_sent, (r, sent, received)


@pytest.mark.timeout(180)
def test_split_groups(results):
    intra, inter = ref.split_groups(WORLD, 2)
    for hop, groups in ((0, intra), (1, inter)):
        expected = test_comm.reference(test_comm.per_rank_inputs(WORLD, seed=hop), groups)
        for r in range(WORLD):
            got, nbytes = results[r]["split", hop]
            for key, want in expected.items():
                torch.testing.assert_close(got[key], torch.as_tensor(want[r]), msg=key)
            assert nbytes == test_comm.expected_bytes(WORLD, 2)


@pytest.mark.timeout(180)
def test_onebit_matches_simulated_bit_identical_on_ranks(results):
    for w in (4, 3, 2):
        for n in test_onebit.SIZES:
            x = test_onebit.make_inputs(w, n, test_onebit.STEPS)
            sim_y, sim_we, sim_se, sim_bytes = test_onebit.simulated_run(x)
            first = results[0]["onebit", w, n][0][0]
            for r in range(w):
                (y, we, se), nbytes = results[r]["onebit", w, n]
                assert torch.equal(y, first), (w, n, r)  # bit-identical on every rank
                torch.testing.assert_close(y, sim_y[:, r], atol=1e-6, rtol=0)
                torch.testing.assert_close(we, sim_we[r], atol=1e-6, rtol=0)
                torch.testing.assert_close(se, sim_se[r], atol=1e-6, rtol=0)
                assert nbytes == sim_bytes


@pytest.mark.timeout(180)
def test_quantized_and_loco_match_simulated(results):
    for w, local, loco in QUANTIZED_CASES:
        for n in QUANTIZED_SIZES:
            x = test_quantized.make_inputs(w, n, 3)
            comm = Simulated(w)
            tx = _quantized_tx(comm, local, loco)
            state = simulate(tx.init, comm)({"x": torch.zeros(w, n)})
            update = simulate(tx.update, comm)
            sim_y = []
            for t in range(3):
                y, state = update({"x": x[t]}, state)
                sim_y.append(y["x"])
            sim_y = torch.stack(sim_y, 1)  # [W, steps, n]
            first = results[0]["quantized", w, local, loco, n][0][0]
            for r in range(w):
                (y, pg_state), nbytes = results[r]["quantized", w, local, loco, n]
                assert torch.equal(y, first)
                torch.testing.assert_close(y, sim_y[r], atol=1e-6, rtol=0)
                if loco:
                    for e_pg, e_sim in zip(pg_state.errors["x"], state.errors["x"], strict=True):
                        torch.testing.assert_close(e_pg, e_sim[r], atol=1e-6, rtol=0)
                assert nbytes == comm.bytes_sent, (w, local, loco, n)


@pytest.mark.timeout(180)
def test_non_finite_on_one_rank_raises_on_every_rank(results):
    for r in range(WORLD):
        assert results[r]["non_finite"] == [True] * 4
