"""tests/_distributed.py itself: results by rank, failures and hangs raise in the parent."""

from __future__ import annotations

import time

import pytest

from tests._distributed import run_distributed

pytestmark = pytest.mark.distributed


def _echo_or_fail(rank, world_size, mode):
    import torch
    import torch.distributed as dist

    if mode == "fail" and rank == 1:
        raise KeyError("rank one broke")
    if mode == "hang" and rank == 0:
        time.sleep(600)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, world_size, float(total)


@pytest.mark.timeout(120)
def test_results_failures_and_hangs():
    assert run_distributed(_echo_or_fail, 2, "ok", timeout=60) == [(0, 2, 1.0), (1, 2, 1.0)]
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*rank one broke"):
        run_distributed(_echo_or_fail, 2, "fail", timeout=60)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        run_distributed(_echo_or_fail, 2, "hang", timeout=10)
    assert time.monotonic() - start < 40
