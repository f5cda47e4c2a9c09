"""fn.fsdp.OnebitAdam's and fn.fsdp.OnebitLamb's DCP checkpoints (fn.fsdp.TrainingCheckpoint) on
gloo ranks: saved in the warmup, just before the freeze, just after it and in the compressed
phase, and resumed in fresh processes, a run continues bit for bit (also with the optimizer as a
plain DCP Stateful); at another world size the momentum is kept and the error feedback restarts
with a warning; checkpoints that do not match (or are in the format before fn's per-rank keys)
are refused with nothing loaded, and so is another rank's ``state_dict()``."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import fn.fsdp
from tests._distributed import run_distributed
from tests.fsdp import test_onebit, test_onebit_lamb
from tests.fsdp.test_onebit import (
    FREEZE,
    MASKS,
    STEPS,
    WORLD,
    batch,
    from_x,
    full_params,
    masks_of,
)

SAVES = (1, FREEZE - 1, FREEZE, FREEZE + 2)  # warmup, before the freeze, after it, compressed
# per optimizer: its class and the test module whose model it trains
KINDS = {"adam": (fn.fsdp.OnebitAdam, test_onebit), "lamb": (fn.fsdp.OnebitLamb, test_onebit_lamb)}
OPTIMIZER = fn.fsdp.ShardedOnebitOptimizer


def build(kind: str, **kwargs) -> nn.Module:
    return KINDS[kind][1].build(**kwargs)


def optimizer(
    kind: str, model: nn.Module, freeze_step: int = FREEZE, masked: bool = True
) -> OPTIMIZER:
    masks = masks_of(model) if masked else None  # the momentum read back is masked
    return KINDS[kind][0](
        model, lr=1e-2, freeze_step=freeze_step, weight_decay=0.1, exp_avg_mask=masks
    )


def train_step(model: nn.Module, opt: OPTIMIZER, rank: int, t: int) -> None:
    opt.param_groups[0]["lr"] = 1e-2 / t  # a schedule: the resumed run reads it back
    opt.zero_grad()
    x, y = batch(rank, t)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def full_momentum(opt: OPTIMIZER) -> dict[str, torch.Tensor]:
    """Every param's full momentum (the same on all ranks): 1-bit LAMB's shards, or 1-bit Adam's
    from the packed signs of its module, times the masks."""
    if opt.keeps_momentum_shards:
        return {k: m.full_tensor() for k, m in opt.state_dict()["exp_avg"].items()}
    out = {}
    for module in opt._modules:
        layout, signs = module.layout, module.signs
        x = signs.values(WORLD * layout.padded_row)
        like = [slot.param for slot in layout.slots]
        out.update(zip([s.name for s in layout.slots], from_x(x, like), strict=True))
    for k, mask in MASKS.items():
        out[k] = out[k] * mask
    return out


def _worker_save(rank: int, world_size: int, root: str, kind: str) -> dict:
    model = build(kind)
    opt = optimizer(kind, model)
    history, saved = {}, {}
    for t in range(1, STEPS + 1):
        train_step(model, opt, rank, t)
        history[t] = full_params(model)
        if t in SAVES:
            fn.fsdp.TrainingCheckpoint(model, opt, step=t).save(os.path.join(root, str(t)))
        if t in (SAVES[0], SAVES[-1]) and rank == 0:  # as DDP users save: rank 0's alone
            torch.save(opt.state_dict(), os.path.join(root, f"rank0-{t}.pt"))
        if t == FREEZE:  # the optimizer alone as a DCP Stateful, as torch users save one
            state = {"model": get_model_state_dict(model), "optim": opt}
            dcp.save(state, checkpoint_id=os.path.join(root, "stateful"))
        if t == SAVES[-1]:
            state = opt.state_dict()
            saved = dict(
                momentum=full_momentum(opt),
                variance={k: v.full_tensor() for k, v in state["exp_avg_sq"].items()},
            )
            # the format before fn's per-rank convention: format 1, the errors under rank<r>
            old = dict(state, header=state["header"].clone())
            old["header"][0] = 1
            old.update(old.pop("per_rank"))
            training = {"model": get_model_state_dict(model), "optim": old, "step": torch.tensor(t)}
            dcp.save({"training": training}, checkpoint_id=os.path.join(root, "format1"))
    other = build(kind)
    adamw = torch.optim.AdamW(other.parameters())
    fn.fsdp.TrainingCheckpoint(other, adamw).save(os.path.join(root, "adamw"))
    return dict(history=history, saved=saved)


def _refused(model: nn.Module, opt: OPTIMIZER, path: str) -> tuple[str, bool]:
    before = full_params(model)
    try:
        fn.fsdp.TrainingCheckpoint(model, opt).load(path)
        message = "loaded"
    except Exception as error:  # noqa: BLE001 -- the test reports which one
        message = f"{type(error).__name__}: {error}"
    after = full_params(model)
    unchanged = opt.count == 0 and all(torch.equal(before[k], after[k]) for k in before)
    return message, unchanged


def _worker_resume(rank: int, world_size: int, root: str, history: dict, kind: str) -> dict:
    mismatches, counts = [], {}
    starts = [(os.path.join(root, str(t)), t) for t in SAVES]
    for path, start in starts:
        model = build(kind, seed=1)  # other weights: the load must overwrite them
        opt = optimizer(kind, model)
        ckpt = fn.fsdp.TrainingCheckpoint(model, opt)
        ckpt.load(path)
        counts[start] = (opt.count, ckpt.step, opt.param_groups[0]["lr"])
        got = full_params(model)
        mismatches += [(path, k) for k in got if not torch.equal(got[k], history[start][k])]
        for t in range(start + 1, STEPS + 1):
            train_step(model, opt, rank, t)
            got = full_params(model)
            mismatches += [(path, t, k) for k in got if not torch.equal(got[k], history[t][k])]
    model = build(kind, seed=1)
    opt = optimizer(kind, model)
    state = {"model": get_model_state_dict(model), "optim": opt}
    dcp.load(state, checkpoint_id=os.path.join(root, "stateful"))
    set_model_state_dict(model, state["model"])
    counts["stateful"] = (opt.count, FREEZE, opt.param_groups[0]["lr"])
    for t in range(FREEZE + 1, STEPS + 1):
        train_step(model, opt, rank, t)
        got = full_params(model)
        mismatches += [("stateful", t, k) for k in got if not torch.equal(got[k], history[t][k])]
    foreign = {}  # rank 0's state_dict(), loaded on every rank
    for t in (SAVES[0], SAVES[-1]):
        model = build(kind, seed=1)
        opt = optimizer(kind, model)
        state = torch.load(os.path.join(root, f"rank0-{t}.pt"), weights_only=False)
        try:
            opt.load_state_dict(state)
            foreign[t] = ("loaded", opt.count)
        except ValueError as error:
            foreign[t] = (str(error), opt.count)
    refusals = {}
    compressed = os.path.join(root, str(SAVES[-1]))

    class Wider(KINDS[kind][1].Net):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Linear(5, 4)
            self.head = nn.Linear(4, 2)

    torch.manual_seed(0)
    wider = Wider()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
    torch.distributed.fsdp.fully_shard(wider.block, mesh=mesh)
    torch.distributed.fsdp.fully_shard(wider, mesh=mesh)
    refusals["model"] = _refused(wider, optimizer(kind, wider, masked=False), compressed)
    model = build(kind, seed=1)
    refusals["settings"] = _refused(model, optimizer(kind, model, freeze_step=4), compressed)
    model = build(kind, seed=1)
    refusals["adamw"] = _refused(model, optimizer(kind, model), os.path.join(root, "adamw"))
    model = build(kind, seed=1)
    refusals["corrupt"] = _refused(model, optimizer(kind, model), os.path.join(root, "corrupt"))
    model = build(kind, seed=1)
    refusals["format 1"] = _refused(model, optimizer(kind, model), os.path.join(root, "format1"))
    return dict(mismatches=mismatches, counts=counts, refusals=refusals, foreign=foreign)


def _worker_other_world_size(rank: int, world_size: int, root: str, kind: str) -> dict:
    model = build(kind, seed=1, world=world_size)
    opt = optimizer(kind, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn.fsdp.TrainingCheckpoint(model, opt).load(os.path.join(root, str(SAVES[-1])))
    warned = [str(w.message) for w in caught if "error feedback restarts" in str(w.message)]
    momentum = {k: m.clone() for k, m in opt._state.exp_avg.items()}
    variance = {k: v.clone() for k, v in opt._state.exp_avg_sq.items()}
    count = opt.count
    for t in range(SAVES[-1] + 1, STEPS + 1):
        train_step(model, opt, rank, t)
    params = full_params(model)
    return dict(warned=warned, momentum=momentum, variance=variance, count=count, params=params)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(KINDS))
def test_resumes_bit_for_bit_at_every_phase_and_refuses_mismatches(tmp_path, kind):
    root = str(tmp_path)
    saved = run_distributed(_worker_save, WORLD, root, kind, timeout=240)
    history = saved[0]["history"]
    for rank in range(WORLD):
        for t, params in saved[rank]["history"].items():
            assert all(torch.equal(v, history[t][k]) for k, v in params.items()), (rank, t)
    corrupt = os.path.join(root, "corrupt")
    os.makedirs(corrupt)
    for name in os.listdir(os.path.join(root, str(SAVES[-1]))):
        with open(os.path.join(root, str(SAVES[-1]), name), "rb") as source:
            data = source.read()
        with open(os.path.join(corrupt, name), "wb") as target:
            target.write(data[: len(data) // 2] if name.endswith(".distcp") else data)
    results = run_distributed(_worker_resume, WORLD, root, history, kind, timeout=240)
    for rank, result in enumerate(results):
        assert result["mismatches"] == [], rank
        for start in SAVES:
            assert result["counts"][start] == (start, start, 1e-2 / start)
        assert result["counts"]["stateful"] == (FREEZE, FREEZE, 1e-2 / FREEZE)
        refusals = result["refusals"]
        assert (
            refusals["model"][0].startswith("ValueError")
            and "another model" in (refusals["model"][0])
        )
        assert (
            refusals["settings"][0].startswith("ValueError")
            and "settings" in (refusals["settings"][0])
        )
        assert (
            refusals["adamw"][0].startswith("ValueError")
            and KINDS[kind][0].__name__ in (refusals["adamw"][0])
        )
        assert refusals["corrupt"][0].startswith("ValueError: cannot read the checkpoint")
        assert refusals["format 1"][0].startswith("ValueError") and (
            "format 1, this fn reads 2" in refusals["format 1"][0]
        ), refusals["format 1"]
        assert all(unchanged for _, unchanged in refusals.values()), refusals
        for t, (outcome, count) in result["foreign"].items():
            if rank == 0:  # its own
                assert (outcome, count) == ("loaded", t)
            else:
                assert "holds the entries of ['rank0'], not of this rank (rank1)" in outcome
                assert count == 0, outcome

    (one,) = run_distributed(_worker_other_world_size, 1, root, kind, timeout=240)
    assert len(one["warned"]) == 1 and one["count"] == SAVES[-1]
    expected = saved[0]["saved"]
    for k, m in one["momentum"].items():
        assert torch.equal(m, expected["momentum"][k]), k
        assert torch.equal(one["variance"][k], expected["variance"][k]), k
    assert all(torch.isfinite(v).all() for v in one["params"].values())
