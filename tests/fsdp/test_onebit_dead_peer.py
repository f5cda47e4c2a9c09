"""fn.fsdp.OnebitAdam when peers die mid-run, on gloo ranks: on HSDP 2 x 2 with the second node
(ranks 2 and 3) gone at the start of an update or a rank of the first node gone after its
forward, and on a 1-D mesh of 2 ranks with rank 1 gone after its forward, every survivor's
``step()`` raises ``CollectiveTimeoutError`` within ``FN_TIMEOUT`` plus a few seconds, however
many modules the model has (12 here: one failure's diagnosis, not one per module), its message
states the seconds since the failed collective (or the failed module's reduce-scatter)
started, and nothing was updated. On HSDP a collective failure that one node's ranks found is
raised as one on the other ranks too."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fn.fsdp
from fn.app.launch import WorkerError
from fn.collectives import CollectiveTimeoutError
from fn.collectives.process_group import TIMEOUT_ENV
from tests._distributed import run_distributed

pytestmark = pytest.mark.distributed

DEPTH, FREEZE = 12, 2
LIMIT_S = 4.0
# were each module to wait out its own diagnosis (LIMIT_S / 2), the 12 would take 24 s
BOUND_S = LIMIT_S + 6.0
CASES = {  # (HSDP, the update whose start the peers do not survive, the dead ranks)
    "hsdp-warmup": (True, 1, (2, 3)),
    "hsdp-compressed": (True, FREEZE + 1, (2, 3)),
    "hsdp-node-peer": (True, 1, (1,)),
    "1d-warmup": (False, 1, (1,)),
    "1d-compressed": (False, FREEZE + 1, (1,)),
}
# the cases whose survivors' backward makes a collective with the dead rank: the later modules
# then send nothing, and step()'s message counts from the failed module's reduce-scatter
IN_BACKWARD = {"hsdp-node-peer": (0,), "1d-warmup": (0,)}


def _full(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.to_local().reshape(-1) for p in model.parameters()])


def _worker(rank: int, world_size: int, case: str, folder: str) -> None:
    """Trains until the update ``CASES[case]`` names, at whose start the dead ranks end (on
    the 1-D mesh after their forward: FSDP2's own parameter all-gathers would fail first, and
    with ``reshard_after_forward=False`` its backward makes none); each survivor saves how and
    when that update failed, then every rank ends at once (gloo would wait for the abandoned
    collectives until the process group's own timeout)."""
    hsdp, fatal, dead = CASES[case]
    os.environ[TIMEOUT_ENV] = f"{LIMIT_S:g}"
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(DEPTH)])
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        shard, replicate = mesh["shard"], mesh["replicate"]
    else:
        shard, replicate = init_device_mesh("cpu", (world_size,)), None
    for layer in model:
        fully_shard(layer, mesh=shard, reshard_after_forward=False)
    fully_shard(model, mesh=shard)
    # FN_TIMEOUT bounds the collectives, not a set-up slowed by other tests on the cores: the
    # ranks start the optimizer's agreement together
    dist.barrier()
    optimizer = fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=FREEZE, replicate=replicate)
    shared = None
    for t in range(1, fatal + 1):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * t + rank))
        if t == fatal and case in ("hsdp-warmup", "hsdp-compressed") and rank in dead:
            os._exit(0)
        started = time.monotonic()
        optimizer.zero_grad()
        loss = model(x).square().mean()
        if t == fatal and rank in dead:
            os._exit(0)
        loss.backward()  # never raises: step() does
        if hsdp and t == fatal - 1:  # as if shard rank 1's collective across the nodes failed
            if rank % 2 == 1:
                optimizer._problems.append(CollectiveTimeoutError("injected", [rank + 2]))
            try:
                optimizer.step()
            except CollectiveTimeoutError as error:
                shared = (str(error), error.missing_ranks, optimizer.count)
            continue
        before, count = _full(model), optimizer.count
        try:
            optimizer.step()
        except CollectiveTimeoutError as error:
            out = {"t": t, "s": time.monotonic() - started, "message": str(error)}
            out["missing"] = error.missing_ranks
            out["unchanged"] = torch.equal(_full(model), before) and optimizer.count == count
            break
    else:
        out = {"t": None}
    out["shared"] = shared
    torch.save(out, os.path.join(folder, f"{rank}.pt"))
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_survivors_raise_within_the_timeout_whatever_the_depth(case, tmp_path):
    hsdp, fatal, dead = CASES[case]
    world_size = 4 if hsdp else 2
    with pytest.raises(WorkerError, match="exited without a result"):
        run_distributed(_worker, world_size, case, str(tmp_path), timeout=100)
    for rank in sorted(set(range(world_size)) - set(dead)):
        out = torch.load(tmp_path / f"{rank}.pt")
        assert out["t"] == fatal, (rank, out)
        assert out["s"] < BOUND_S, (rank, out["s"])
        assert out["unchanged"], rank
        if rank in IN_BACKWARD.get(case, ()):  # its node's reduce-scatter met the dead rank
            assert out["missing"] == list(dead), (rank, out)
            pattern = r"raises it ([\d.]+) s after the reduce-scatter of module \d+ started "
            stated = re.search(pattern + r"\(the (\d+) later module", out["message"])
            assert stated, out["message"]
            assert int(stated[2]) == DEPTH - 1  # the first module reduce-scattered failed
        else:  # step()'s first collective met it
            assert out["missing"] and set(out["missing"]) <= set(range(world_size)) - {rank}
            stated = re.search(r"never reached it in ([\d.]+) s|waited ([\d.]+) s", out["message"])
            assert stated, out["message"]
        # the message's count starts at the failed collective, the measured one at the forward
        seconds = float(next(group for group in stated.groups() if group))
        assert out["s"] - 2.0 < seconds <= out["s"] + 0.1, (out["s"], out["message"])
        if case == "hsdp-compressed":
            message, missing, count = out["shared"]
            assert count == fatal - 2  # that update was not made
            assert missing == [3], message
            assert (message == "injected") if rank == 1 else ("rank 3 never reached" in message)
