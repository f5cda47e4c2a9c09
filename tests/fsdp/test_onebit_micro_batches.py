"""fn.fsdp.OnebitAdam when the ranks run different numbers of micro-batches before ``step()``,
on 2 gloo ranks.

On HSDP with one rank per node (``N = 2`` x ``L = 1``) FSDP2 runs no collective across the
nodes, so both ranks reach ``step()``, whose first exchange compares the counts: the same
``RuntimeError`` on both, nothing changed, and the next correct updates train as if the bad one
never happened (bit for bit), in the warmup and compressed. A ``step()`` without any backward
against one after a backward is the same mismatch (0 against 1).

On a 1-D mesh the rank with more micro-batches waits in FSDP2's all-gather of its next forward,
a collective fn never sees, while the other waits in ``step()``'s first exchange, which runs on
a process group of the optimizer's own: no SIGABRT (gloo aborts a process when two ranks' calls
of one collective differ in size), rank 0 raises fn's ``CollectiveTimeoutError`` naming the
cause within ``FN_TIMEOUT``, and rank 1's all-gather fails once rank 0's connections close (as
they do when its process ends: here rank 0 aborts the group, without waiting for its exit). A
launch of its own: it leaves the process groups unusable."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fn
import fn.fsdp
from tests._distributed import run_distributed
from tests.fsdp.test_onebit_failures import attempt

FREEZE = 3


def build(hsdp: bool) -> tuple[nn.Module, fn.fsdp.OnebitAdam]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        shard, replicate = mesh["shard"], mesh["replicate"]
    else:
        shard, replicate = init_device_mesh("cpu", (2,)), None
    fully_shard(model[0], mesh=shard)
    fully_shard(model, mesh=shard)
    # the ranks meet first: under load one may start seconds late, past _one_dim's FN_TIMEOUT,
    # which the constructor's agreement runs under too
    dist.barrier()
    return model, fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=FREEZE, replicate=replicate)


def backwards(model: nn.Module, rank: int, t: int, count: int) -> None:
    for k in range(count):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1000 * t + 10 * k + rank))
        model(x).square().mean().backward()


def full(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def _hsdp(rank: int) -> dict:
    """Updates 1 to 6, each of 2 micro-batches, but for a bad attempt before updates 2 (warmup)
    and 5 (compressed): 1 micro-batch on rank 0 and 2 on rank 1, then (update 5 only) a
    ``step()`` with no backward on rank 0 after one on rank 1; each attempt is followed by
    ``zero_grad``. Against the same run without the bad attempts."""
    model, optimizer = build(hsdp=True)
    reference, plain = build(hsdp=True)
    out = {"errors": [], "unchanged": []}
    for t in range(1, 7):
        if t in (2, FREEZE + 2):
            bad = [(1 if rank == 0 else 2)] + ([0 if rank == 0 else 1] if t > FREEZE else [])
            for count in bad:
                optimizer.zero_grad()
                before, updates = full(model), optimizer.count
                backwards(model, rank, t, count)
                out["errors"].append(attempt(optimizer.step))
                out["unchanged"].append(
                    torch.equal(full(model), before) and optimizer.count == updates
                )
        for opt, net in ((optimizer, model), (plain, reference)):
            opt.zero_grad()
            backwards(net, rank, t, 2)
            opt.step()
    out["params"], out["reference"], out["count"] = full(model), full(reference), optimizer.count
    return out


def _one_dim(rank: int) -> str:
    """3 micro-batches on rank 0, 4 on rank 1, then ``step()``."""
    os.environ["FN_TIMEOUT"] = "6"  # read when the optimizer builds its communicators
    model, optimizer = build(hsdp=False)
    optimizer.zero_grad()
    backwards(model, rank, 1, 1)
    optimizer.step()  # a correct update first
    optimizer.zero_grad()
    outcome = attempt(lambda: (backwards(model, rank, 2, 3 + rank), optimizer.step()))
    if rank == 0:  # as its process would on exit: its connections close, rank 1's fail
        model[0].weight.device_mesh.get_group(0).abort()
    return outcome


def _worker_hsdp(rank: int, world_size: int) -> dict:
    del world_size
    return _hsdp(rank)


def _worker_one_dim(rank: int, world_size: int) -> str:
    del world_size
    return _one_dim(rank)


@pytest.mark.distributed
def test_uneven_micro_batches_on_hsdp_raise_on_every_rank_with_nothing_changed():
    hsdp = run_distributed(_worker_hsdp, 2, timeout=240)
    for r in hsdp:
        assert len(r["errors"]) == 3 and all(r["unchanged"]), r
        assert all("different numbers of micro-batches" in e for e in r["errors"]), r["errors"]
        assert "rank 0: 1, rank 1: 2" in r["errors"][0]
        assert "rank 0: 0, rank 1: 1" in r["errors"][2]
        assert r["count"] == 6
        assert torch.equal(r["params"], r["reference"])  # the bad attempts left no trace
    assert torch.equal(hsdp[0]["params"], hsdp[1]["params"])


@pytest.mark.distributed
def test_uneven_micro_batches_on_a_1d_mesh_time_out_in_step_without_an_abort():
    """Rank 0 waits in step(), rank 1 in FSDP2's all-gather; no SIGABRT on either (a launch of
    its own: the process groups are unusable after it)."""
    zero, one = run_distributed(_worker_one_dim, 2, timeout=240)
    assert zero.startswith("CollectiveTimeoutError") and "micro-batches" in zero, zero
    assert "never reached step()'s first exchange" in zero
    assert one.startswith("RuntimeError") and "Connection closed" in one, one
