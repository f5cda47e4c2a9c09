"""fn.fsdp.OnebitAdam and OnebitLamb checkpoints resharded across mesh shapes, on 4 gloo ranks:
saved on 2 x 2 (HSDP), 1 x 4 (a 1-D mesh) or 4 x 1 (HSDP, one rank per node) and loaded on each
other shape (docs/algorithms.md, "1-bit Adam and 1-bit LAMB on HSDP"). ``v`` and the momentum
arrive exactly (compared with the saving run's full tensors, gathered in memory), the error
feedback restarts from zero with a warning (none in the warmup), and training goes on with every
rank holding the same params. One rank per node also trains on its own: every rank agrees, and
its warmup is native HSDP + torch.optim.Adam's."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fn.fsdp
from fn.fsdp.onebit_layout import params_of_x, shard_of
from tests._distributed import run_distributed
from tests.fsdp import test_onebit_hsdp as hsdp
from tests.fsdp.test_onebit import FREEZE, full_params, masks_of

WORLD = 4
SHAPES = ((2, 2), (1, 4), (4, 1))  # replicate x shard
SAVES = (FREEZE - 1, FREEZE + 1)  # the last warmup update, the first after the freeze
MASKS = {"adam": "auto", "lamb": "hand"}  # exp_avg_mask="auto" for Adam, by hand for LAMB


def meshes(shape: tuple[int, int]) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The shard mesh and ``replicate`` (``None`` for the 1-D mesh) of a mesh shape."""
    if shape[0] == 1:
        return init_device_mesh("cpu", (WORLD,)), None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    return mesh["shard"], mesh["replicate"]


def build(kind: str, shape: tuple[int, int]):
    shard, replicate = meshes(shape)
    model = hsdp.build(kind, seed=1, mesh=shard)
    masks = "auto" if MASKS[kind] == "auto" else masks_of(model)
    return model, hsdp.optimizer(kind, model, replicate, weight_decay=0.1, exp_avg_mask=masks)


def full_state(opt) -> dict[str, dict[str, torch.Tensor]]:
    """``v``, the momentum the next update starts from (the packed signs' values times the
    mask, or the shards' ``m``: before the freeze, and LAMB's) and the masks, full size,
    gathered over the shard group."""
    params = {slot.name: slot.param for m in opt._modules for slot in m.layout.slots}
    state = {
        "v": {k: shard_of(v, params[k]).full_tensor() for k, v in opt._state.exp_avg_sq.items()},
        "m": {},
        "mask": {},
    }
    for held in opt._modules:
        layout, bits = held.layout, held.mask
        names = [slot.name for slot in layout.slots]
        if held.signs is None or opt.keeps_momentum_shards:  # (LAMB's signs: scaled momenta)
            m = [shard_of(opt._state.exp_avg[k], params[k]).full_tensor() for k in names]
        else:
            row = held.own_row().values(layout.padded_row)
            m = params_of_x(layout, opt.comm.all_gather(row).view(opt.comm.world_size, -1))
        if bits is not None:
            rows = fn.kernels.unpackbits(bits, layout.world_size * layout.padded_row)
            mask = params_of_x(layout, (rows > 0).float().view(layout.world_size, -1))
            state["mask"].update(zip(names, mask, strict=True))
            m = [x * keep for x, keep in zip(m, mask, strict=True)]
        state["m"].update(zip(names, m, strict=True))
    return state


def _worker_save(rank: int, world_size: int, root: str) -> dict:
    saved = {}
    for kind in ("adam", "lamb"):
        for shape in SHAPES:
            model, opt = build(kind, shape)
            for t in range(1, SAVES[-1] + 1):
                hsdp.train_step(model, opt, rank, t)
                if t in SAVES:
                    path = os.path.join(root, f"{kind}-{shape[0]}x{shape[1]}-{t}")
                    fn.fsdp.TrainingCheckpoint(model, opt, step=t).save(path)
                    saved[kind, shape, t] = dict(params=full_params(model), state=full_state(opt))
    return saved


def _worker_load(rank: int, world_size: int, root: str, saved: dict) -> dict:
    out = {}
    for (kind, shape, t), expected in saved.items():
        for other in SHAPES:
            if other == shape:
                continue
            model, opt = build(kind, other)
            path = os.path.join(root, f"{kind}-{shape[0]}x{shape[1]}-{t}")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn.fsdp.TrainingCheckpoint(model, opt).load(path)
            state = full_state(opt)
            params = full_params(model)
            mismatches = [k for k, v in params.items() if not torch.equal(v, expected["params"][k])]
            for field in ("v", "m", "mask"):
                got, want = state[field], expected["state"][field]
                mismatches += [(field, k) for k in want if not torch.equal(got.get(k), want[k])]
            errors = [held.errors for held in opt._modules]
            hsdp.train_step(model, opt, rank, t + 1)
            out[kind, shape, t, other] = dict(
                count=opt.count,
                mismatches=mismatches,
                warnings=[str(w.message) for w in caught],
                errors_reset=all(e is None for e in errors),
                params=full_params(model),
            )
    return out


def _worker_one_rank_per_node(rank: int, world_size: int) -> dict:
    """4 x 1: every kind trains through the freeze; the warmup against native HSDP + Adam."""
    out = {}
    for kind in ("adam", "lamb"):
        model, opt = build(kind, (4, 1))
        history = {}
        for t in range(1, 7):
            hsdp.train_step(model, opt, rank, t)
            history[t] = full_params(model)
        out[kind] = dict(history=history, bytes=opt.bytes_sent)
    return out


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reshard"))
    saved = run_distributed(_worker_save, WORLD, root, timeout=300)
    return saved, run_distributed(_worker_load, WORLD, root, saved[0], timeout=300)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_state_arrives_exactly_on_every_other_mesh_shape(resharded):
    saved, loaded = resharded
    for rank in range(WORLD):  # what was saved is the same on every rank
        for case, state in saved[rank].items():
            for k, v in state["params"].items():
                assert torch.equal(v, saved[0][case]["params"][k]), (rank, case, k)
    cases = loaded[0].keys()
    assert len(cases) == 2 * len(SHAPES) * len(SAVES) * (len(SHAPES) - 1)
    for case in cases:
        kind, shape, t, other = case
        for rank, out in enumerate(loaded):
            result = out[case]
            assert result["mismatches"] == [], (rank, case, result["mismatches"][:4])
            assert result["count"] == t + 1 and result["errors_reset"], case
            restarted = [w for w in result["warnings"] if "error feedback restarts" in w]
            if t < FREEZE:  # nothing compressed yet: nothing to restart
                assert restarted == [], (case, result["warnings"])
            else:
                assert (
                    len(restarted) == 1
                    and f"{shape[0]} x {shape[1]}" in restarted[0]
                    or (shape[0] == 1 and f"world size {shape[1]}" in restarted[0])
                ), (case, restarted)
            for k, v in result["params"].items():
                assert torch.equal(v, loaded[0][case]["params"][k]), (rank, case, k)
                assert bool(v.isfinite().all()), (case, k)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_one_rank_per_node_trains_with_every_rank_equal():
    results = run_distributed(_worker_one_rank_per_node, WORLD, timeout=240)
    for kind in ("adam", "lamb"):
        first = results[0][kind]["history"]
        for rank, out in enumerate(results):
            assert out[kind]["bytes"] > 0
            for t, params in out[kind]["history"].items():
                assert all(torch.equal(v, first[t][k]) for k, v in params.items()), (rank, kind, t)
        assert not all(torch.equal(v, first[1][k]) for k, v in first[6].items())
    for result in run_distributed(hsdp._worker_native, WORLD, (4, 1), timeout=240):
        assert result["worst"] < 1e-6, result
