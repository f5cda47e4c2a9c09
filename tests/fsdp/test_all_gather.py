"""QuantizedAllGather (ZeRO++ qwZ) called directly and inside FSDP2, on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fn.fsdp import QuantizedAllGather, loco_reduce_scatter, quantized_all_gather
from tests._distributed import run_distributed
from tests.fsdp import test_fsdp

N = 37  # values per rank's shard: not a multiple of the group


def shards(world_size: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(world_size, N, generator=g) * torch.logspace(-2, 1, N)).to(dtype)


def _worker(rank: int, world_size: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        gather = QuantizedAllGather(bits=8, group_size=8)
        output = gather.allocate((world_size * N,), dtype=dtype, device=torch.device("cpu"))
        output[rank * N : (rank + 1) * N] = shards(world_size, dtype)[rank]  # FSDP2's copy-in
        gather(output, output[rank * N : (rank + 1) * N], dist.group.WORLD)
        out[dtype] = output.clone()
    ints = torch.arange(4, dtype=torch.uint8) + rank
    gathered = torch.empty(world_size * 4, dtype=torch.uint8)
    QuantizedAllGather()(gathered, ints, dist.group.WORLD)
    out["bytes"] = gathered

    x, _ = test_fsdp.batch(0, 0)  # the same input on both ranks
    dense = test_fsdp.build(world_size)
    model = test_fsdp.build(world_size)
    gathers = quantized_all_gather(model, bits=8, group_size=4)
    handle = loco_reduce_scatter(model, bits=4, group_size=4)
    out["forward"] = dense(x, True).detach(), model(x, True).detach(), sorted(gathers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    test_fsdp.train(model, optimizer, rank, range(2))
    out["trained"] = model(x, True).detach(), int(handle.reduce_scatters["block0"].count)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=240)


@pytest.mark.timeout(300)
def test_every_rank_gets_every_dequantized_shard(results):
    for dtype in (torch.float32, torch.bfloat16):
        want = shards(2, dtype).double()
        for rank in range(2):
            got = results[rank][dtype].view(2, N)
            assert got.dtype == dtype
            assert torch.equal(results[rank][dtype], results[0][dtype])  # own shard included
            step = want.abs().max(1, keepdim=True).values / 128 * 1.001  # one 8-bit step
            slack = want.abs() * 2**-8 if dtype == torch.bfloat16 else 0
            assert ((got.double() - want).abs() <= step + slack).all()
            assert not torch.equal(got.double(), want)  # it was quantized
    assert torch.equal(
        results[1]["bytes"], torch.tensor([0, 1, 2, 3, 1, 2, 3, 4], dtype=torch.uint8)
    )


@pytest.mark.timeout(300)
def test_fsdp_forward_with_quantized_weights(results):
    for rank in range(2):
        dense, quantized, names = results[rank]["forward"]
        assert names == ["<root>", "block0", "block1"]
        assert torch.equal(quantized, results[0]["forward"][1])  # ranks use the same weights
        torch.testing.assert_close(quantized, dense, atol=0.05, rtol=0)
        assert not torch.equal(quantized, dense)
        trained, count = results[rank]["trained"]
        assert count == 2 and torch.isfinite(trained).all()
        assert torch.equal(trained, results[0]["trained"][0])
