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
from tests._distributed import ROOT, torchrun  # noqa: E402
from tests.integrations.test_lightning_fsdp import check_accumulation_runs  # noqa: E402

FREEZE, RESUME, STEPS, BATCH = 3, (1, 2, 3), 5, 2  # _lightning_hsdp.py's
WORLD, SAMPLES = 4, 64  # examples/lightning_ddp.py's data


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hsdp_under_model_parallel_strategy_resumes_bit_for_bit(tmp_path):
    torchrun(
        ROOT / "tests" / "integrations" / "_lightning_hsdp.py", str(tmp_path), nproc=4, timeout=300
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for rank, result in enumerate(ranks):
        full = result["full"]
        assert full["warnings"] == []
        for name, value in full["params"].items():
            assert torch.equal(value, result["bare"][name]), name  # Lightning adds nothing
            assert torch.equal(value, ranks[0]["full"]["params"][name]), (rank, name)
        # the reduce-scatter inside the node stays dense; across the nodes 1 bit per element
        dense, compressed = full["sent"][: FREEZE - 1], full["sent"][FREEZE:]
        assert max(compressed) < min(dense), full["sent"]
        assert f"rank{rank}.net.worker" in full["state"]  # its error feedback, by global rank
        for step in RESUME:
            resumed = result["resumed"][step]
            for name, value in full["params"].items():
                assert torch.equal(value, resumed["params"][name]), (rank, step, name)
            assert resumed["state"].keys() == full["state"].keys()
            for key, value in full["state"].items():
                assert torch.equal(value, resumed["state"][key]), (rank, step, key)
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
@pytest.mark.timeout(120)
def test_hsdp_accumulation_and_clipping_train_and_resume_bit_for_bit(tmp_path):
    """accumulate_grad_batches=4 and gradient_clip_val=1.0 on HSDP (2 nodes x 2): the run equals
    a plain fn.fsdp HSDP loop, sends across the nodes once per update, the clip acts in both
    phases, resumed runs are bit-identical; bad clipping is refused on every rank."""
    script = ROOT / "tests" / "integrations" / "_lightning_hsdp.py"
    torchrun(script, str(tmp_path), "accumulation", nproc=4, timeout=100)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    check_accumulation_runs(ranks, hsdp=True)
