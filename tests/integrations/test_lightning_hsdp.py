"""fn.integrations.lightning with fn.fsdp.OnebitAdam on HSDP (``replicate=``) under Lightning's
ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2) on 4 gloo ranks under
``torchrun`` (tests/integrations/_lightning_hsdp.py): FnCallback accepts it; the run equals a
plain fn.fsdp HSDP loop, every rank ends with the same params, and the compressed updates send
less; runs resumed from a checkpoint in the warmup, before the freeze and at it end
bit-identical (params and optimizer state) to the uninterrupted run; a checkpoint of the
2 x 2 mesh resumes on 1 x 4 (resharded, the error feedback restarted with one warning), every
rank ending with the same params; Lightning's own sampler deals the batches
by node (why the recipe deals them by global rank)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is in the 'lightning' extra")
from tests._distributed import ROOT  # noqa: E402
from tests.integrations.test_hsdp_example import torchrun_4  # noqa: E402

FREEZE, RESUME, STEPS = 3, (1, 2, 3), 5  # _lightning_hsdp.py's
WORLD = 4


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hsdp_under_model_parallel_strategy_resumes_bit_for_bit(tmp_path):
    torchrun_4(ROOT / "tests" / "integrations" / "_lightning_hsdp.py", str(tmp_path), timeout=300)
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
    # Lightning's sampler: num_replicas = the nodes, rank = the node's index
    batches = [r["sampler"] for r in ranks]
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[2], batches[3])
    assert not torch.equal(batches[0], batches[2])
