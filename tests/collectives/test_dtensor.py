"""fn/collectives/dtensor.py: a param's local shard and a shard laid out again as its param, on
plain tensors and on FSDP2's DTensors (2 gloo ranks), and each rank's row as its part of one
DTensor; ``import fn`` does not load DTensor."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fn.collectives import as_sharded_like, local_shard
from fn.collectives.dtensor import rows_of_ranks
from tests._distributed import run_distributed


def test_plain_tensors_are_their_own_shard():
    x = torch.arange(4.0)
    assert local_shard(x) is x
    assert as_sharded_like(x, torch.zeros(4)) is x
    assert as_sharded_like(None, torch.zeros(4)) is None


def _worker(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    param = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    mine = local_shard(param)
    mine.add_(100.0)  # a view: writing it writes the param's shard
    again = as_sharded_like(torch.full_like(mine, float(rank)), param)
    rows = rows_of_ranks(torch.full((3,), 10.0 + rank, dtype=torch.float64), param)
    return {
        "rows": rows.full_tensor(),
        "own row": rows.to_local(),
        "local": mine.clone(),
        "param": param.to_local().clone(),
        "sharded": isinstance(again, DTensor) and again.placements == param.placements,
        "full": again.full_tensor(),
        "not a tensor": as_sharded_like(3, param),
    }


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_dtensor_shards_round_trip_on_two_ranks():
    results = run_distributed(_worker, 2, timeout=100)
    for rank, out in enumerate(results):
        rows = torch.arange(12.0).reshape(6, 2)[3 * rank : 3 * rank + 3]
        assert torch.equal(out["local"], rows + 100.0) and torch.equal(out["param"], rows + 100.0)
        assert out["sharded"] and out["not a tensor"] == 3
        assert torch.equal(out["full"], torch.tensor([0.0] * 6 + [1.0] * 6).reshape(6, 2))
        every_row = torch.tensor([10.0] * 3 + [11.0] * 3, dtype=torch.float64)
        assert torch.equal(out["rows"], every_row)  # rank 0's row, then rank 1's
        assert torch.equal(out["own row"], every_row[3 * rank : 3 * rank + 3])


def test_import_fn_does_not_load_dtensor():
    check = "import sys, fn, fn.collectives; print('torch.distributed.tensor' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
