"""QuantizedAllGather (ZeRO++ qwZ) called directly and inside FSDP2, on 2 gloo ranks; the
arguments of quantized_all_gather and loco_reduce_scatter checked at install, on every rank."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from fn.fsdp import QuantizedAllGather, loco_reduce_scatter, quantized_all_gather
from tests._distributed import run_together
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
def two_ranks() -> dict[str, list]:
    """The workers of this file on the same 2 ranks, in one launch."""
    return run_together({"gather": (_worker, ()), "refused": (_worker_refused, ())}, 2, timeout=400)


@pytest.fixture(scope="module")
def results(two_ranks):
    return two_ranks["gather"]


@pytest.mark.timeout(500)
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


@pytest.mark.timeout(500)
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


FAST_S = 30.0  # a refusal on every rank well within this (the gloo timeout: 240 s)

GATHER_DIFFER = "the ranks passed different bits or group_size (this rank: "
LOCO_DIFFER = "the ranks passed different bits, group_size, err_beta, reset_T or local_world_size"
# by installer: (its arguments on rank 0, on rank 1, the error every rank raises, what rank 0's
# message holds, what rank 1's holds: "", the same); a refusal is the same message on every rank
REFUSED = {
    "quantized_all_gather": [
        (dict(bits=8.0), dict(bits=8.0), TypeError, "bits must be an int, got 8.0 (float)", ""),
        (
            dict(bits=8.0),
            dict(bits=8),
            TypeError,
            "rank(s) [0] refused the model or the settings: bits must be an int",
            "",
        ),
        (dict(bits=True), dict(bits=True), TypeError, "bits must be an int, got True (bool)", ""),
        (dict(bits="8"), dict(bits="8"), TypeError, "bits must be an int, got '8' (str)", ""),
        (
            dict(group_size=128.0),
            dict(group_size=128.0),
            TypeError,
            "group_size must be an int",
            "",
        ),
        (
            dict(group_size=4),
            dict(group_size=None),
            TypeError,
            "rank(s) [1] refused the model or the settings: group_size",
            "",
        ),
        (dict(bits=3), dict(bits=3), ValueError, "bits must be 4 or 8, got 3", ""),
        (dict(bits=8), dict(bits=4), ValueError, GATHER_DIFFER + "(8, 128))", "(4, 128))"),
        (dict(group_size=8), dict(group_size=4), ValueError, GATHER_DIFFER + "(8, 8))", "(8, 4))"),
    ],
    "loco_reduce_scatter": [
        (dict(bits=8.0), dict(bits=8.0), TypeError, "bits must be an int, got 8.0 (float)", ""),
        (
            dict(bits=4),
            dict(bits=4.0),
            TypeError,
            "rank(s) [1] refused the model or the settings: bits must be an int",
            "",
        ),
        (dict(group_size="4"), dict(group_size="4"), TypeError, "group_size must be an int", ""),
        (dict(reset_T=True), dict(reset_T=True), TypeError, "reset_T must be an int", ""),
        (
            dict(err_beta="0.8"),
            dict(err_beta=0.8),
            TypeError,
            "rank(s) [0] refused the model or the settings: err_beta must",
            "",
        ),
        (dict(local_world_size=1.0), dict(local_world_size=1.0), TypeError, "local_world_size", ""),
        (dict(bits=4), dict(bits=8), ValueError, LOCO_DIFFER, "(8, 128, 0.8, 1024, None)"),
        (
            dict(group_size=8),
            dict(group_size=4),
            ValueError,
            LOCO_DIFFER,
            "(4, 4, 0.8, 1024, None)",
        ),
        (dict(err_beta=0.8), dict(err_beta=0.5), ValueError, "(4, 128, 0.8, 1024", "0.5"),
        (dict(reset_T=3), dict(reset_T=4), ValueError, "(4, 128, 0.8, 3, None)", "4, None)"),
        (dict(local_world_size=None), dict(local_world_size=2), ValueError, LOCO_DIFFER, "2)"),
    ],
}
INSTALL = {"quantized_all_gather": quantized_all_gather, "loco_reduce_scatter": loco_reduce_scatter}


def _worker_refused(rank: int, world_size: int) -> dict:
    out = {}
    model = test_fsdp.build(world_size)
    for name, cases in REFUSED.items():
        for i, case in enumerate(cases):
            started = time.monotonic()
            try:
                INSTALL[name](model, **case[rank])
                outcome = "installed"
            except Exception as error:  # noqa: BLE001 -- the test reports which one
                outcome = f"{type(error).__name__}: {error}"
            out[name, i] = outcome, time.monotonic() - started
    # nothing installed: the forward and the gradients are dense FSDP2's, bit for bit
    dense = test_fsdp.build(world_size)
    x, _ = test_fsdp.batch(0, 0)
    out["dense_forward"] = torch.equal(model(x, True), dense(x, True))
    got, want = test_fsdp.grads(model, rank), test_fsdp.grads(dense, rank)
    out["dense_grads"] = got.keys() == want.keys() and all(
        torch.equal(got[k], want[k]) for k in want
    )
    # the right arguments then install, and train with the ranks agreeing
    quantized_all_gather(model, bits=8, group_size=4)
    loco_reduce_scatter(model, bits=4, group_size=4)
    out["quantized_forward"] = not torch.equal(model(x, True), dense(x, True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    test_fsdp.train(model, optimizer, rank, range(2))
    out["trained"] = model(x, True).detach()
    return out


@pytest.mark.timeout(500)
def test_bad_or_differing_settings_are_refused_on_every_rank_at_install(two_ranks):
    results = two_ranks["refused"]
    for name, cases in REFUSED.items():
        for i, (*args, kind, words0, words1) in enumerate(cases):
            for rank, words in enumerate((words0, words1 or words0)):  # "": as rank 0's
                message, seconds = results[rank][name, i]
                assert message.startswith(f"{kind.__name__}: fn.fsdp.{name}: "), (args, message)
                assert words in message, (args, rank, message)
                assert seconds < FAST_S, (args, rank, seconds)
            if kind is ValueError and args[0] != args[1]:  # each names its own settings
                assert "the ranks passed different" in results[1][name, i][0]
            else:
                assert results[0][name, i][0] == results[1][name, i][0], args
    for result in results:
        assert result["dense_forward"] and result["dense_grads"] and result["quantized_forward"]
        assert torch.isfinite(result["trained"]).all()
        assert torch.equal(result["trained"], results[0]["trained"])
