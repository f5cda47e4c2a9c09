"""Element counts travel next to the scales of the compressed collectives: ranks that pass tensors
of different sizes all raise a clear ValueError (4 gloo ranks, one launch), at no extra
collective, and the group stays usable."""

from __future__ import annotations

import pytest
import torch

from fn.collectives import (
    ProcessGroup,
    compressed_allreduce,
    init_error_feedback,
    loco_allreduce,
    quantized_reduce_scatter,
)
from tests._distributed import run_distributed

pytestmark = pytest.mark.distributed


def error_message(run):
    """The message of the ValueError that ``run()`` raises, or ``None``."""
    try:
        run()
    except ValueError as err:
        return str(err)
    return None


def _onebit(comm, n):
    we, se = init_error_feedback(n, comm=comm)
    return compressed_allreduce(torch.randn(n), we, se, comm=comm)


def _loco(comm, n, local=None):
    tx = loco_allreduce(comm=comm, local_world_size=local)
    return tx.update({"x": torch.randn(n)}, tx.init({"x": torch.zeros(n)}))


def _loco_donated(comm, n):
    """The donated update (streamed point to point on one hop); the state must stay intact."""
    tx = loco_allreduce(comm=comm)
    state = tx.init({"x": torch.zeros(n)})
    _, state = tx.update({"x": torch.randn(n)}, state, donate=True)
    before = [e.clone() for e in state.errors["x"]]
    try:
        return tx.update({"x": torch.randn(n)}, state, donate=True)
    except ValueError:
        assert all(map(torch.equal, before, state.errors["x"]))
        raise


def _worker(rank, world_size):
    import torch.distributed as dist

    world = ProcessGroup(timeout=20)
    pair = dist.new_group([0, 1])  # called on every rank
    out = {}
    if rank < 2:
        comm = ProcessGroup(pair, timeout=20)
        for name, run in {
            "onebit 64/60": lambda: _onebit(comm, (64, 60)[rank]),
            "onebit 64/96": lambda: _onebit(comm, (64, 96)[rank]),
            "loco 64/96": lambda: _loco(comm, (64, 96)[rank]),
            "reduce_scatter 64/60": lambda: quantized_reduce_scatter(
                torch.randn((64, 60)[rank]), comm=comm
            ),
        }.items():
            out[name] = error_message(run)
        bytes_before = comm.reset_bytes_sent()
        out["after"] = _onebit(comm, 64)[0].shape, bytes_before
    # Two hops (2 nodes of 2): only rank 3 differs, inside node 1; node 0 learns it from the
    # poisoned counts of the inter-node hop.
    out["two hops"] = error_message(lambda: _loco(world, 100 if rank == 3 else 64, local=2))
    out["two hops after"] = _loco(world, 64, local=2)[0]["x"].shape
    # Donated, one hop: the counts follow the chunks to every peer (same padded size: 512).
    out["donated"] = error_message(lambda: _loco_donated(world, 190 if rank == 2 else 200))
    out["donated after"] = _loco_donated(world, 200)[0]["x"].shape
    return out


@pytest.mark.timeout(180)
def test_different_sizes_raise_on_every_rank():
    results = run_distributed(_worker, 4, timeout=150)
    for rank, out in enumerate(results):
        if rank < 2:
            assert "rank 0: 64 elements, rank 1: 60 elements" in out["onebit 64/60"]
            assert "compressed_allreduce" in out["onebit 64/60"]
            assert "rank 0: 64 elements, rank 1: 96 elements" in out["onebit 64/96"]
            assert "rank 0: 64 elements, rank 1: 96 elements" in out["loco 64/96"]
            assert "quantized allreduce" in out["loco 64/96"]
            assert "different sizes" in out["reduce_scatter 64/60"]
            assert out["after"][0] == torch.Size([64])
        message = out["two hops"]
        assert message is not None and "different sizes" in message
        assert out["two hops after"] == torch.Size([64])
        assert "rank 1: 200 elements, rank 2: 190 elements" in out["donated"]
        assert out["donated after"] == torch.Size([200])
    assert "100 elements" in results[3]["two hops"]
    assert "a mismatch seen earlier" in results[0]["two hops"]


def test_matching_sizes_send_the_count_next_to_the_scales():
    """The count is 8 bytes per scale row; the results do not change (tests/collectives/*)."""
    from fn.collectives import Simulated, replicate, simulate

    comm = Simulated(2)
    n = 64
    we, se = replicate(init_error_feedback(n, comm=comm), comm)
    simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm)(
        torch.randn(2, n), we, se
    )
    # signs all_to_all (n/8 bytes, half sent) + (scale, count) all_gather (12 bytes)
    # + server signs (n/16 bytes) and server scale all_gathers
    assert comm.bytes_sent == n // 8 // 2 + 12 + n // 16 + 4
