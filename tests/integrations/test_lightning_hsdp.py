"""fn.integrations.lightning with fn.fsdp.OnebitAdam on HSDP (``replicate=``, 2 nodes x 2) under
Lightning's ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1) on 4 gloo ranks
under ``torchrun`` (tests/integrations/_lightning_hsdp.py): FnCallback accepts it; the run
equals a plain fn.fsdp HSDP loop, every rank ends with the same params, and the compressed
updates send less; runs resumed from a checkpoint in the warmup, before the freeze and at it end
bit-identical (params and optimizer state) to the uninterrupted run; a checkpoint of the
2 x 2 mesh resumes on 1 x 4 (resharded, the error feedback restarted with one warning), every
rank ending with the same params. Under Lightning's own sampler the ranks' batches of one epoch
cover the data without a repeat; with the strategy's default sizes (data_parallel_size = the
nodes, which would deal the batches by node) FnCallback refuses on every rank before the first
batch. With accumulate_grad_batches=4 and gradient_clip_val=1.0: the same, bytes across the
nodes once per update, the clip acting in both phases."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is in the 'lightning' extra")
from tests.integrations.test_lightning_fsdp import (  # noqa: E402
    assert_resumed_bit_for_bit,
    check_accumulation_runs,
    scenarios,
)

FREEZE, RESUME, STEPS, BATCH = 3, (1, 2, 3), 5, 2  # _lightning_hsdp.py's
WORLD, SAMPLES = 4, 64  # examples/lightning_ddp.py's data


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return scenarios("_lightning_hsdp.py", WORLD, tmp_path_factory.mktemp("lightning_hsdp"), 400)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(500)
def test_hsdp_under_model_parallel_strategy_resumes_bit_for_bit(runs):
    ranks = runs["main"]
    for rank, result in enumerate(ranks):
        full = result["full"]
        assert full["warnings"] == []
        for name, value in full["params"].items():
            assert torch.equal(value, result["bare"][name]), name  # Lightning adds nothing
            assert torch.equal(value, ranks[0]["full"]["params"][name]), (rank, name)
        # the reduce-scatter inside the node stays dense; across the nodes 1 bit per element
        dense, compressed = full["sent"][: FREEZE - 1], full["sent"][FREEZE:]
        assert max(compressed) < min(dense), full["sent"]
        assert f"per_rank.rank{rank}.net.worker" in full["state"]  # its errors, by global rank
        for step in RESUME:
            assert_resumed_bit_for_bit(full, result["resumed"][step], rank, step)
        other = result["other shape"]  # resharded: the error feedback restarts, once
        assert other["step"] == STEPS, other["step"]
        restarted = [w for w in other["warnings"] if "error feedback restarts" in w]
        assert len(restarted) == 1 and "2 x 2" in restarted[0], other["warnings"]
        for name, value in other["params"].items():
            assert torch.equal(value, ranks[0]["other shape"]["params"][name]), (rank, name)
            assert bool(value.isfinite().all()), name
    # Lightning's own sampler: every row once in the epoch, over the 4 ranks
    world = [r["sampler"]["world"] for r in ranks]
    seen = torch.cat([w["rows"] for w in world])
    assert torch.equal(seen.sort().values, torch.arange(SAMPLES)), seen
    assert all(w["error"] is None and w["batches"] == SAMPLES // (WORLD * BATCH) for w in world)
    # by node (num_replicas = the nodes): refused on every rank, with the fix, nothing trained
    by_node = [r["sampler"]["by node"] for r in ranks]
    message = by_node[0]["error"]
    assert message is not None and "2 replicas, not the 4 ranks" in message, message
    assert "data_parallel_size=4, tensor_parallel_size=1" in message, message
    for rank, result in enumerate(by_node):
        assert result["error"] == message and result["batches"] == 0, (rank, result)
        assert result["unchanged"], rank


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_hsdp_accumulation_and_clipping_train_and_resume_bit_for_bit(runs):
    """accumulate_grad_batches=4 and gradient_clip_val=1.0 on HSDP (2 nodes x 2): the run equals
    a plain fn.fsdp HSDP loop, sends across the nodes once per update, the clip acts in both
    phases, resumed runs are bit-identical; bad clipping is refused on every rank."""
    check_accumulation_runs(runs["accumulation"], hsdp=True)
