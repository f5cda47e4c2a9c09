"""fn.diloco with sharded workers, in one launch of 4 gloo ranks = 2 workers x 2 shards (mesh
``("worker", "shard")``; each worker's model ``fully_shard`` on ``mesh["shard"]``, DiLoCo's
group ``mesh["worker"]``: the workers' ranks at one shard position).

- With ``torch.optim.AdamW`` inside a worker: the same bits as the unsharded 2-worker run (the
  nesterov rule with fp32 is elementwise), every outer step the reference outer step on the
  workers' full params, and every rank of a shard position holds the same params after every
  outer step; the same bits with HSDP inside each worker (a mesh ``("worker", "replicate",
  "shard")`` of 2 x 2 x 1).
- Streaming DiLoCo's fragments (``delay=0``): the same bits as unsharded. With a delay and
  ``mix``, after every inner step: with AdamW inside (also on HSDP), the loop over unsharded workers
  (``_reference.streaming_run``) bit for bit; with ``fn.fsdp.OnebitAdam`` inside, that loop
  given each worker's params before every outer step (its inner steps replayed); and a
  checkpoint through ``fn.fsdp.TrainingCheckpoint`` taken while an exchange is in flight
  resumes bit for bit.
- With ``fn.fsdp.OnebitAdam`` inside a worker (``world=`` the worker's ranks, both phases,
  clipped; on the worker's 1-D shard mesh and on HSDP of 2 x 1), and ``OnebitLamb`` on the 1-D
  mesh: between outer steps each worker's inner steps are a standalone 2-rank run's bit for
  bit (at the end of the launch the worker's ranks form a default group of their own and
  replay them from the anchors), and every outer step is the reference outer step on the
  workers' full params.
- A NaN on one rank makes its worker sit out the outer step at every shard position (the
  other worker's step applied on every rank), also with ``fn.fsdp.OnebitAdam``, whose
  non-finite gradient on one rank raises on that worker's ranks only.
- Checkpoints through ``fn.fsdp.TrainingCheckpoint`` (DCP, one name per worker, DiLoCo as an
  extra Stateful): a resumed run is the uninterrupted one bit for bit, with the error feedback
  of the top-k compressor; a checkpoint of other settings is refused with nothing changed. With
  ``fn.fsdp.OnebitAdam`` inside, each worker saves and loads a checkpoint of its own over its
  ranks (``group=``), resumed bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

import fn.diloco
import fn.fsdp
from tests._distributed import run_distributed
from tests.diloco import _reference

WORKERS, SHARDS = 2, 2
H, OUTER_STEPS = 2, 3
ONEBIT = {"lr": 1e-2, "freeze_step": 2, "max_grad_norm": 0.5}  # t = 1 warmup, then compressed
# the runs with fn.fsdp's 1-bit optimizers inside the workers: (optimizer, HSDP inside)
ONEBIT_RUNS = {
    "onebit": (fn.fsdp.OnebitAdam, False),
    "onebit hsdp": (fn.fsdp.OnebitAdam, True),
    "onebit lamb": (fn.fsdp.OnebitLamb, False),
}
TOPK = {"compression": "topk", "compression_options": {"k": 2, "chunk_size": 4}}
# Streaming with a delay: fragment 0 (block.weight) starts after steps 1, 5 and is applied after
# 2, 6; fragment 1 (the rest) after 3, 7 and 4, 8
DELAYED = {"sync_every": 4, "fragments": 2, "delay": 1, "mix": 0.5}
DELAYED_FRAGMENTS, DELAYED_STEPS = [[0], [1, 2, 3]], 8


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
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()  # (may alias)
        for p in model.parameters()
    ]


class Worker:
    """One worker's model, inner optimizer and DiLoCo on this rank, with the full params before
    and after every ``every``-th inner step's outer step (``shards``: the mesh dimensions a
    worker's model is sharded on; none: unsharded)."""

    def __init__(self, mesh, shards=("shard",), poison=None, every=H, **kwargs) -> None:
        self.worker = mesh.get_coordinate()[0]
        self.model = _model(mesh[shards] if shards else None)
        self.inner = self._inner(mesh)
        self.before, self.after, self.step, self.every = [], [], 0, every
        self.poison = poison
        self.inner.register_step_post_hook(self._before_outer_step)  # runs before DiLoCo's
        group = mesh["worker"].get_group()
        kwargs = {"sync_every": H, **kwargs}
        self.diloco = fn.diloco.DiLoCo(self.model, self.inner, group=group, **kwargs)

    def _before_outer_step(self, *_) -> None:
        if (self.step + 1) % H == 0:
            if self.poison is not None and torch.distributed.get_rank() == self.poison:
                with torch.no_grad():
                    next(self.model.parameters()).to_local()[0, 0] = float("nan")
        if (self.step + 1) % self.every == 0:
            self.before.append(_full(self.model))

    def _inner(self, mesh) -> torch.optim.Optimizer:
        del mesh
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _batch(self.worker, 0, self.step)  # the same on the worker's ranks

    def train(self, steps: int) -> None:
        for _ in range(steps):
            x, y = self.batch()
            torch.nn.functional.mse_loss(self.model(x), y).backward()
            self.inner.step()
            self.inner.zero_grad()
            self.step += 1
            if self.step % self.every == 0:
                self.after.append(_full(self.model))

    def checkpoint(self, group=None) -> fn.fsdp.TrainingCheckpoint:
        return fn.fsdp.TrainingCheckpoint(
            self.model,
            self.inner,
            extra={"diloco": self.diloco},
            key=f"worker{self.worker}",
            group=group,
        )


class OnebitWorker(Worker):
    """A worker whose inner optimizer is ``fn.fsdp.OnebitAdam`` (or ``kind``) on its shard mesh,
    spanning the worker's ranks (``world``; on HSDP with ``replicate=mesh["replicate"]``); each
    rank of a worker its own data."""

    def __init__(self, mesh, world, hsdp=False, kind=fn.fsdp.OnebitAdam, **kwargs) -> None:
        self.world, self.hsdp, self.kind = world, hsdp, kind
        super().__init__(mesh, **kwargs)

    def _inner(self, mesh) -> torch.optim.Optimizer:
        hsdp = {"replicate": mesh["replicate"]} if self.hsdp else {}
        return self.kind(self.model, **ONEBIT, **hsdp, world=self.world)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _batch(self.worker, torch.distributed.get_rank() % SHARDS, self.step)


def _batch(worker: int, shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s batch of inner step ``step`` on its rank ``shard``."""
    g = torch.Generator().manual_seed(1000 * worker + 100 * shard + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def _onebit_workers(rank, mesh, path):
    """DiLoCo around fn.fsdp.OnebitAdam, on the worker's 1-D shard mesh and on HSDP inside the
    worker (2 replicas of 1 shard, ``world=`` a ``dist.new_group`` of the worker's ranks): the
    full params before and after every outer step; and a NaN gradient on rank 3 (worker 1) in
    the compressed phase, then a NaN param there at the outer step: which ranks raised, and the
    skipped outer step. A checkpoint per worker (``group=`` its ranks): saved after an outer
    step, resumed for one, against the uninterrupted run."""
    world = mesh["shard"].get_group()
    hsdp = init_device_mesh("cpu", (WORKERS, 2, 1), mesh_dim_names=("worker", "replicate", "shard"))
    groups = [torch.distributed.new_group([SHARDS * w, SHARDS * w + 1]) for w in range(WORKERS)]
    result = {}
    for name, (kind, on_hsdp) in ONEBIT_RUNS.items():
        if on_hsdp:
            run = OnebitWorker(hsdp, groups[rank // SHARDS], hsdp=True, kind=kind)
        else:
            run = OnebitWorker(mesh, world, kind=kind)
        run.train(H * OUTER_STEPS)
        result[name] = (run.before, run.after)
    full, part = OnebitWorker(mesh, world), OnebitWorker(mesh, world)
    full.train(2 * H)
    part.train(H)
    own = f"{path}/worker{rank // SHARDS}"
    part.checkpoint(world).save(own)
    resumed = OnebitWorker(mesh, world)
    resumed.checkpoint(world).load(own)
    resumed.step = H
    resumed.train(H)
    result["onebit checkpoint"] = (full.after[-1], resumed.after[-1])
    run = OnebitWorker(mesh, world, poison=3)
    start = _full(run.model)
    raised = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train(1)  # t = 1, the warmup
        x, y = run.batch()  # t = 2 (H): compressed, then the outer step
        if rank == 3:
            x[0, 0] = float("nan")
        for inputs in (x, run.batch()[0]):
            torch.nn.functional.mse_loss(run.model(inputs), y).backward()
            try:
                run.inner.step()
                break
            except fn.NonFiniteError:  # worker 1 drops the batch and steps on a good one
                raised.append(rank)
            finally:
                run.inner.zero_grad()
    messages = [str(w.message) for w in caught]
    counts = (run.diloco.skipped_steps, run.diloco.sat_out)
    result["onebit nan"] = (start, _full(run.model), counts, messages, raised)
    return result


def _onebit_standalone(rank, afters, path):
    """This rank's worker's inner steps as standalone fn.fsdp.OnebitAdam runs, on a 1-D mesh and
    on HSDP (2 x 1): the 4-rank world ended, the worker's 2 ranks form a default group of their
    own, and the params are set to the DiLoCo run's anchor (``afters``, by run) after every
    outer step; the full params before every outer step, by run. The 2-rank group is left for
    the launcher to end."""
    worker, shard = divmod(rank, SHARDS)
    torch.distributed.destroy_process_group()
    store = torch.distributed.FileStore(f"{path}/standalone{worker}", SHARDS)
    torch.distributed.init_process_group("gloo", store=store, rank=shard, world_size=SHARDS)
    befores = {}
    for name, (kind, hsdp) in ONEBIT_RUNS.items():
        if hsdp:
            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
            model = _model(mesh["shard"])
            inner = kind(model, **ONEBIT, replicate=mesh["replicate"])
        else:
            model = _model(init_device_mesh("cpu", (SHARDS,)))
            inner = kind(model, **ONEBIT)
        befores[name] = []
        for s in range(OUTER_STEPS):
            if s > 0:
                with torch.no_grad():
                    for p, full in zip(model.parameters(), afters[name][s - 1], strict=True):
                        local = distribute_tensor(
                            full, p.device_mesh, p.placements, src_data_rank=None
                        )
                        p.to_local().copy_(local.to_local())
            for t in range(H):
                x, y = _batch(worker, shard, H * s + t)
                torch.nn.functional.mse_loss(model(x), y).backward()
                inner.step()
                inner.zero_grad()
            befores[name].append(_full(model))
    return befores


def _delayed(mesh, hsdp, path):
    """Streaming DiLoCo with a delay and mix (``DELAYED``), the full params before and after
    every inner step's outer step: with AdamW inside (on the 1-D shard mesh and on HSDP), and
    with ``fn.fsdp.OnebitAdam`` (``world=`` the worker's ranks); a checkpoint through DCP after
    step 5 (fragment 0's exchange in flight), resumed in a fresh run: its params and in-flight
    entry."""
    world = mesh["shard"].get_group()
    adamw = Worker(mesh, every=1, **DELAYED)
    adamw.train(DELAYED_STEPS)
    on_hsdp = Worker(hsdp, ("replicate", "shard"), every=1, **DELAYED)
    on_hsdp.train(DELAYED_STEPS)
    onebit = OnebitWorker(mesh, world, every=1, **DELAYED)
    onebit.train(DELAYED_STEPS)
    part = Worker(mesh, **DELAYED)
    part.train(5)
    part.checkpoint().save(f"{path}/delayed")
    resumed = Worker(mesh, **DELAYED)
    resumed.checkpoint().load(f"{path}/delayed")
    resumed.step = 5
    resumed.train(DELAYED_STEPS - 5)
    checkpoint = (_full(resumed.model), part.diloco.state_dict()["in_flight"])
    return {
        "delayed": (adamw.before, adamw.after),
        "delayed hsdp": (on_hsdp.before, on_hsdp.after),
        "delayed onebit": (onebit.before, onebit.after),
        "delayed checkpoint": checkpoint,
    }


def _batchnorm(mesh):
    """BatchNorm inside sharded workers, each rank its own data: its statistics before and
    after the outer step; and HSDP whose replicate dimension is the workers' (FSDP2 averaging
    the gradients across the workers): refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    fully_shard(model, mesh=mesh["shard"])
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = []
    inner.register_step_post_hook(lambda *_: before.append([b.clone() for b in model[1].buffers()]))
    group = mesh["worker"].get_group()
    fn.diloco.DiLoCo(model, inner, group=group, sync_every=H)
    for step in range(H):
        x, y = _batch(mesh.get_coordinate()[0], torch.distributed.get_rank() % SHARDS, step)
        torch.nn.functional.mse_loss(model(x + torch.distributed.get_rank()), y).backward()
        inner.step()
        inner.zero_grad()
    across = init_device_mesh("cpu", (WORKERS, SHARDS), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    hsdp = fully_shard(Net(), mesh=across)
    try:
        adamw = torch.optim.AdamW(hsdp.parameters(), lr=1e-2)
        fn.diloco.DiLoCo(hsdp, adamw, group=across["replicate"].get_group(), sync_every=H)
        refused = "not refused"
    except ValueError as err:
        refused = str(err)
    return before[-1], [b.clone() for b in model[1].buffers()], refused


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
    # HSDP inside each worker: 2 replicas of 1 shard (a 2-D mesh of DTensor params)
    hsdp = init_device_mesh("cpu", (WORKERS, 2, 1), mesh_dim_names=("worker", "replicate", "shard"))
    run = Worker(hsdp, ("replicate", "shard"))
    run.train(H * OUTER_STEPS)
    results["hsdp"] = (run.before, run.after)
    results.update(_delayed(mesh, hsdp, path))
    # a NaN on rank 3 (worker 1, shard 1): worker 1 sits out at every shard position
    run = Worker(mesh, poison=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train(H)
    counts = (run.diloco.skipped_steps, run.diloco.sat_out)
    results["nan"] = (run.before[0], run.after[0], counts, [str(w.message) for w in caught])
    results["batchnorm"] = _batchnorm(mesh)
    results.update(_onebit_workers(rank, mesh, path))
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
    # a checkpoint per worker (group=: the worker's ranks save and load it alone)
    own, group = f"{path}/adamw{rank // SHARDS}", mesh["shard"].get_group()
    part.checkpoint(group).save(own)
    resumed = Worker(mesh, **TOPK)
    resumed.checkpoint(group).load(own)
    resumed.step = H * 2
    resumed.train(H)
    results["own checkpoint"] = (full.after[-1], resumed.after[-1])
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
    afters = {name: results[name][1] for name in ONEBIT_RUNS}
    results["standalone"] = _onebit_standalone(rank, afters, path)  # the last
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
    # the outer step on the workers' full params (the ranks of worker w: 2w, 2w + 1)
    for name in ("adamw", *ONEBIT_RUNS):
        before = [ranks[SHARDS * w][name][0] for w in range(WORKERS)]
        anchor = _model().parameters()
        for j, a in enumerate(anchor):
            workers = [[before[w][s][j] for w in range(WORKERS)] for s in range(OUTER_STEPS)]
            expected = _reference.nesterov_steps(a.detach(), workers, lr=0.7, momentum=0.9)
            for rank, result in enumerate(ranks):
                for s in range(OUTER_STEPS):
                    assert torch.equal(result[name][1][s][j], expected[s]), (name, rank, j, s)


def _delayed_reference(models, inner_step) -> list[list[list[torch.Tensor]]]:
    """Every worker's params after every inner step of ``DELAYED``, from the loop over the
    unsharded ``models`` (one per worker), ``inner_step(r, t)`` worker ``r``'s step ``t``."""
    return _reference.streaming_run(
        [list(m.parameters()) for m in models],
        inner_step,
        steps=DELAYED_STEPS,
        sync_every=DELAYED["sync_every"],
        fragments=DELAYED_FRAGMENTS,
        delay=DELAYED["delay"],
        mix=DELAYED["mix"],
        outer=_reference.nesterov_outer(lr=0.7, momentum=0.9),
    )


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_sharded_streaming_with_a_delay_is_the_loop_over_workers(ranks):
    models = [_model() for _ in range(WORKERS)]
    inners = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]

    def adamw_step(r: int, t: int) -> None:
        x, y = _batch(r, 0, t)
        torch.nn.functional.mse_loss(models[r](x), y).backward()
        inners[r].step()
        inners[r].zero_grad()

    replayed = [_model() for _ in range(WORKERS)]

    def onebit_step(r: int, t: int) -> None:  # the worker's params before step t's outer step
        with torch.no_grad():
            before = ranks[SHARDS * r]["delayed onebit"][0][t]
            for p, x in zip(replayed[r].parameters(), before, strict=True):
                p.copy_(x)

    expected = _delayed_reference(models, adamw_step)
    expected_onebit = _delayed_reference(replayed, onebit_step)
    for rank, result in enumerate(ranks):
        for t in range(DELAYED_STEPS):
            assert _equal(result["delayed"][1][t], expected[t][rank // SHARDS]), (rank, t)
            assert _equal(result["delayed hsdp"][1][t], expected[t][rank // SHARDS]), (rank, t)
            got = result["delayed onebit"][1][t]
            assert _equal(got, expected_onebit[t][rank // SHARDS]), (rank, t)
        resumed, in_flight = result["delayed checkpoint"]
        assert in_flight == {"fragment": 0, "started_at": 5, "trainable": [0, 1, 2, 3]}, in_flight
        assert _equal(resumed, result["delayed"][1][-1]), rank
    # mix keeps a share of each worker's own params: the workers differ after an outer step
    assert not _equal(ranks[0]["delayed"][1][1], ranks[SHARDS]["delayed"][1][1])


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_onebit_adam_inside_workers_steps_as_a_standalone_run(ranks):
    for name in ONEBIT_RUNS:
        for rank, result in enumerate(ranks):
            before, after = result[name]
            for s in range(OUTER_STEPS):
                assert _equal(before[s], result["standalone"][name][s]), (name, rank, s)
                assert _equal(after[s], ranks[0][name][1][s]), (name, rank, s)
        # the workers' data differ, and so do their inner steps
        assert not _equal(ranks[0][name][0][0], ranks[SHARDS][name][0][0])


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_nan_on_one_rank_makes_its_worker_sit_out(ranks):
    """Worker 1 (ranks 2, 3) sits out at both shard positions: worker 0's outer step alone is
    applied, on every rank."""
    before = ranks[0]["nan"][0]  # worker 0's full params
    expected = [
        _reference.nesterov_steps(a.detach(), [[before[j]]], lr=0.7, momentum=0.9)[0]
        for j, a in enumerate(_model().parameters())
    ]
    for result in ranks:
        _, after, counts, warned = result["nan"]
        assert _equal(after, expected) and counts == (0, [0, 1]), counts
        assert warned == ranks[0]["nan"][3] and len(warned) == 1, warned
        assert "worker(s) 1 sat out the outer step" in warned[0]
        start, after, counts, warned, raised = result["onebit nan"]
        assert _equal(after, ranks[0]["onebit nan"][1]) and not _equal(start, after)
        assert counts == (0, [0, 1]) and len(warned) == 1, warned
        assert "its inner optimizer's state was kept (OnebitAdam refuses" in warned[0]
    # fn.fsdp.OnebitAdam's non-finite check spans its worker only
    assert [r for result in ranks for r in result["onebit nan"][4]] == [2, 3]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_batchnorm_statistics_are_averaged_over_every_rank_of_every_worker(ranks):
    """Over the workers at each shard position (ranks 0, 2 and 1, 3), then over a worker's
    shard positions, in rank order: every rank holds the same buffers."""
    before = [result["batchnorm"][0] for result in ranks]
    for k in range(2):  # running_mean, running_var
        per_position = [
            _reference.cast_mean([before[p][k], before[p + SHARDS][k]], torch.float32)
            for p in range(SHARDS)
        ]
        expected = _reference.cast_mean(per_position, torch.float32)
        assert not torch.equal(before[0][k], before[1][k])  # each rank's data
        for result in ranks:
            assert torch.equal(result["batchnorm"][1][k], expected), k
    for result in ranks:
        assert int(result["batchnorm"][1][2]) == H
        refused = result["batchnorm"][2]
        assert "the parameters' device mesh (FSDP2's collectives) spans a group, which holds 2" in (
            refused
        ), refused


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
        full, resumed = result["own checkpoint"]  # a checkpoint per worker, group=
        assert _equal(full, resumed), rank
        full, resumed = result["onebit checkpoint"]
        assert _equal(full, resumed), rank
