"""fn.diloco with sharded workers, in one launch of 4 gloo ranks = 2 workers x 2 shards (mesh
``("worker", "shard")``; each worker's model ``fully_shard`` on ``mesh["shard"]``, DiLoCo's
group ``mesh["worker"]``: the workers' ranks at one shard position).

- With ``torch.optim.AdamW`` inside a worker: the same bits as the unsharded 2-worker run (the
  nesterov rule with fp32 is elementwise), every outer step the reference outer step on the
  workers' full params, and every rank of a shard position holds the same params after every
  outer step; the same bits with HSDP inside each worker (a mesh ``("worker", "replicate",
  "shard")`` of 2 x 2 x 1). (``fn.fsdp.OnebitAdam`` refuses a shard mesh that does not hold
  every rank, so it is not an inner optimizer here.)
- Streaming DiLoCo's fragments (``delay=0``): the same bits as unsharded; a delay is refused.
- A NaN on one rank skips the outer step on every rank of every shard position.
- Checkpoints through ``fn.fsdp.TrainingCheckpoint`` (DCP, one name per worker, DiLoCo as an
  extra Stateful): a resumed run is the uninterrupted one bit for bit, with the error feedback
  of the top-k compressor; a checkpoint of other settings is refused with nothing changed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fn.diloco
import fn.fsdp
from tests._distributed import run_distributed
from tests.diloco import _reference

WORKERS, SHARDS = 2, 2
H, OUTER_STEPS = 2, 3
TOPK = {"compression": "topk", "compression_options": {"k": 2, "chunk_size": 4}}


class Net(nn.Module):
    """Shards of unequal size on 2 ranks (3 rows, a bias of 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block(x)))


def _model(shard_mesh=None) -> nn.Module:
    torch.manual_seed(0)
    model = Net()
    if shard_mesh is not None:
        fully_shard(model.block, mesh=shard_mesh)
        fully_shard(model, mesh=shard_mesh)
    return model


def _full(model) -> list[torch.Tensor]:
    return [
        (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()  # (may alias)
        for p in model.parameters()
    ]


class Worker:
    """One worker's model, inner optimizer and DiLoCo on this rank, with the full params before
    and after every outer step (``shards``: the mesh dimensions a worker's model is sharded on;
    none: unsharded)."""

    def __init__(self, mesh, shards=("shard",), poison=None, **kwargs) -> None:
        self.worker = mesh.get_coordinate()[0]
        self.model = _model(mesh[shards] if shards else None)
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.before, self.after, self.step = [], [], 0
        self.poison = poison
        self.inner.register_step_post_hook(self._before_outer_step)  # runs before DiLoCo's
        group = mesh["worker"].get_group()
        self.diloco = fn.diloco.DiLoCo(self.model, self.inner, group=group, sync_every=H, **kwargs)

    def _before_outer_step(self, *_) -> None:
        if (self.step + 1) % H == 0:
            if self.poison is not None and torch.distributed.get_rank() == self.poison:
                with torch.no_grad():
                    next(self.model.parameters()).to_local()[0, 0] = float("nan")
            self.before.append(_full(self.model))

    def train(self, steps: int) -> None:
        for _ in range(steps):
            g = torch.Generator().manual_seed(1000 * self.worker + self.step)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
            torch.nn.functional.mse_loss(self.model(x), y).backward()
            self.inner.step()
            self.inner.zero_grad()
            self.step += 1
            if self.step % H == 0:
                self.after.append(_full(self.model))

    def checkpoint(self) -> fn.fsdp.TrainingCheckpoint:
        return fn.fsdp.TrainingCheckpoint(
            self.model, self.inner, extra={"diloco": self.diloco}, key=f"worker{self.worker}"
        )


def _sharded(rank, world_size, path):
    del world_size
    mesh = init_device_mesh("cpu", (WORKERS, SHARDS), mesh_dim_names=("worker", "shard"))
    results = {}
    streaming = {"fragments": 2}  # Streaming DiLoCo: one fragment per inner step (H = 2)
    for name, shards, kwargs in [
        ("adamw", ("shard",), {}),
        ("unsharded", (), {}),
        ("fragments", ("shard",), streaming),
        ("fragments unsharded", (), streaming),
    ]:
        run = Worker(mesh, shards, **kwargs)
        run.train(H * OUTER_STEPS)
        results[name] = (run.before, run.after)
    try:
        Worker(mesh, delay=1, **streaming)
        results["delay"] = "not refused"
    except NotImplementedError as err:
        results["delay"] = str(err)
    # HSDP inside each worker: 2 replicas of 1 shard (a 2-D mesh of DTensor params)
    hsdp = init_device_mesh("cpu", (WORKERS, 2, 1), mesh_dim_names=("worker", "replicate", "shard"))
    run = Worker(hsdp, ("replicate", "shard"))
    run.train(H * OUTER_STEPS)
    results["hsdp"] = (run.before, run.after)
    # a NaN on rank 3 (worker 1, shard 1): every rank of every shard position skips
    run = Worker(mesh, poison=3)
    start = _full(run.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train(H)
    results["nan"] = (start, run.after[0], run.diloco.skipped_steps, len(caught))
    # DCP: saved after 2 outer steps, resumed for 1, against the uninterrupted run
    full = Worker(mesh, **TOPK)
    full.train(H * OUTER_STEPS)
    part = Worker(mesh, **TOPK)
    part.train(H * 2)
    part.checkpoint().save(f"{path}/sharded")
    saved_feedback = part.diloco.state_dict()["per_rank"][f"rank{rank}"]["error_feedback"]
    resumed = Worker(mesh, **TOPK)
    resumed.checkpoint().load(f"{path}/sharded")
    resumed.step = H * 2
    resumed.train(H)
    results["dcp"] = (
        full.after[-1],
        resumed.after[-1],
        any(bool(e.ne(0).any()) for e in saved_feedback),
    )
    # other settings: refused on every rank, the model and DiLoCo unchanged
    other = Worker(mesh, **{**TOPK, "compression_options": {"k": 1, "chunk_size": 4}})
    other.train(1)
    params, state = _full(other.model), other.diloco.state_dict()
    try:
        other.checkpoint().load(f"{path}/sharded")
        refused = "not refused"
    except ValueError as err:
        refused = str(err)
    unchanged = all(torch.equal(a, b) for a, b in zip(params, _full(other.model), strict=True))
    unchanged &= other.diloco.state_dict()["counts"] == state["counts"]
    results["refused"] = (refused, unchanged)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sharded"))
    return run_distributed(_sharded, WORKERS * SHARDS, path, timeout=200)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_sharded_workers_step_as_unsharded_ones(ranks):
    for rank, result in enumerate(ranks):
        _, sharded = result["adamw"]
        _, unsharded = result["unsharded"]
        for s in range(OUTER_STEPS):
            assert _equal(sharded[s], unsharded[s]), (rank, s)
            assert _equal(result["fragments"][1][s], result["fragments unsharded"][1][s]), s
            assert not _equal(result["fragments"][1][s], unsharded[s]), s  # another schedule
            assert _equal(result["hsdp"][1][s], unsharded[s]), (rank, s)
            assert _equal(sharded[s], ranks[0]["adamw"][1][s]), (rank, s)
        assert "delay > 0 with sharded workers is not built" in result["delay"], result["delay"]
    # the outer step on the workers' full params (the ranks of worker w: 2w, 2w + 1)
    for name in ("adamw",):
        before = [ranks[SHARDS * w][name][0] for w in range(WORKERS)]
        anchor = _model().parameters()
        for j, a in enumerate(anchor):
            workers = [[before[w][s][j] for w in range(WORKERS)] for s in range(OUTER_STEPS)]
            expected = _reference.nesterov_steps(a.detach(), workers, lr=0.7, momentum=0.9)
            for rank, result in enumerate(ranks):
                for s in range(OUTER_STEPS):
                    assert torch.equal(result[name][1][s][j], expected[s]), (name, rank, j, s)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_nan_on_one_rank_skips_every_rank(ranks):
    for result in ranks:
        start, after, skipped, warned = result["nan"]
        assert _equal(start, after) and skipped == 1 and warned == 1


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_sharded_checkpoint_resumes_bit_for_bit_through_dcp(ranks):
    for rank, result in enumerate(ranks):
        full, resumed, had_feedback = result["dcp"]
        assert had_feedback, rank
        assert _equal(full, resumed), rank
        refused, unchanged = result["refused"]
        assert "settings" in refused and "nothing was loaded" in refused, refused
        assert unchanged, rank
