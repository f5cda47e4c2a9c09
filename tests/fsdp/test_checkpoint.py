"""fn.fsdp.TrainingCheckpoint on 2 gloo ranks when one rank fails: rank 0 cannot move the new
checkpoint into place (a mount point, or the second rename) or clear an old ``.partial``, and a
rank cannot read the checkpoint it loads (with torch's AdamW and with fn.fsdp.OnebitAdam). Every
rank raises at once (not at the process group's timeout), the failing rank its own error and the
others one that names it; the previous checkpoint stays intact and loadable, nothing is loaded,
and the next save and load work."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fn.fsdp
from fn.fsdp import TrainingCheckpoint
from tests._distributed import run_distributed
from tests.fsdp import test_fsdp, test_onebit

FAST_S = 30.0  # a rank learns of another's failure well within this (the gloo timeout: 240 s)


def _outcome(call) -> tuple[str, str, float]:
    """``call()``'s exception (type name, message) and the seconds it took (``"ok"``: none)."""
    started = time.monotonic()
    try:
        call()
        kind, message = "ok", ""
    except Exception as error:  # noqa: BLE001 -- the test reports which one
        kind, message = type(error).__name__, str(error)
    return kind, message, time.monotonic() - started


def _failing_rename(rank: int, src_of: str):
    """On rank 0: ``os.rename`` raising ``EBUSY`` for the source ``src_of`` (as for a mount
    point); elsewhere nothing patched."""
    real = os.rename

    def rename(src, dst, *args, **kwargs):
        if os.fspath(src) == src_of:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), src_of)
        return real(src, dst, *args, **kwargs)

    return mock.patch("os.rename", rename) if rank == 0 else contextlib.nullcontext()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The full params and the optimizer's state tensors (copies)."""
    state = {f"param.{k}": v.clone() for k, v in test_fsdp.full_params(model).items()}
    for i, s in enumerate(optimizer.state.values()):
        state.update(
            {f"optim.{i}.{k}": v.full_tensor().clone() for k, v in s.items() if k != "step"}
        )
    return state


def _worker_save(rank: int, world_size: int, root: str) -> dict:
    path = os.path.join(root, "ckpt")
    model = test_fsdp.build(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    test_fsdp.train(model, optimizer, rank, range(2))
    TrainingCheckpoint(model, optimizer, step=2).save(path)
    saved = test_fsdp.full_params(model)
    test_fsdp.train(model, optimizer, rank, range(2, 4))
    out = {}
    with _failing_rename(rank, path):  # the mount point: the old checkpoint cannot move away
        out["mount"] = _outcome(lambda: TrainingCheckpoint(model, optimizer, step=4).save(path))
    with _failing_rename(rank, f"{path}.partial"):  # the new one cannot move in: the old back
        out["rename"] = _outcome(lambda: TrainingCheckpoint(model, optimizer, step=4).save(path))
    dist.barrier()
    out["listing"] = sorted(os.listdir(root))
    dist.barrier()
    if rank == 0:  # an old .partial that rank 0 cannot delete
        shutil.rmtree(f"{path}.partial")
        os.symlink(root, f"{path}.partial")
    dist.barrier()
    out["clear"] = _outcome(lambda: TrainingCheckpoint(model, optimizer, step=4).save(path))
    dist.barrier()
    if rank == 0:
        os.remove(f"{path}.partial")
    dist.barrier()
    after = test_fsdp.full_params(model)
    checkpoint = TrainingCheckpoint(model, optimizer)
    checkpoint.load(path)  # the previous checkpoint, intact
    out["kept"] = checkpoint.step, _same(saved, test_fsdp.full_params(model))
    out["moved"] = not _same(saved, after)
    test_fsdp.train(model, optimizer, rank, range(2, 4))
    TrainingCheckpoint(model, optimizer, step=4).save(path)  # a later save works
    final = test_fsdp.full_params(model)
    test_fsdp.train(model, optimizer, rank, range(4, 5))
    checkpoint.load(path)
    out["later"] = checkpoint.step, _same(final, test_fsdp.full_params(model))
    out["final_listing"] = sorted(os.listdir(root))
    return out


def _worker_load(rank: int, world_size: int, root: str) -> dict:
    """Rank 1 loads from a directory missing on its filesystem (here: another path)."""
    out = {}
    model = test_fsdp.build(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    test_fsdp.train(model, optimizer, rank, range(2))
    path = os.path.join(root, "adamw")
    TrainingCheckpoint(model, optimizer, step=2).save(path)
    test_fsdp.train(model, optimizer, rank, range(2, 3))
    before = _state(model, optimizer)
    checkpoint = TrainingCheckpoint(model, optimizer, step=3)
    where = path if rank == 0 else os.path.join(root, "missing")
    out["adamw"] = _outcome(lambda: checkpoint.load(where))
    after = _state(model, optimizer)
    out["adamw_unchanged"] = checkpoint.step == 3 and _same(before, after)
    checkpoint.load(path)
    out["adamw_loaded"] = checkpoint.step

    model = test_onebit.build()
    opt = fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=2)
    for t in range(1, 4):  # into the compressed phase
        opt.zero_grad()
        x, y = test_onebit.batch(rank, t)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    path = os.path.join(root, "onebit")
    TrainingCheckpoint(model, opt, step=3).save(path)
    opt.zero_grad()
    x, y = test_onebit.batch(rank, 4)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    before = test_onebit.full_params(model)
    checkpoint = TrainingCheckpoint(model, opt, step=4)
    where = path if rank == 0 else os.path.join(root, "missing")
    out["onebit"] = _outcome(lambda: checkpoint.load(where))
    after = test_onebit.full_params(model)
    out["onebit_unchanged"] = checkpoint.step == 4 and _same(before, after)
    out["onebit_count"] = opt.count
    checkpoint.load(path)
    out["onebit_loaded"] = checkpoint.step, opt.count
    return out


@pytest.mark.timeout(300)
def test_a_failed_save_raises_on_every_rank_at_once_and_keeps_the_checkpoint(tmp_path):
    results = run_distributed(_worker_save, 2, str(tmp_path), timeout=240)
    path = str(tmp_path / "ckpt")
    for case, words in (
        ("mount", f"could not move the new checkpoint {path}.partial to {path}"),
        ("rename", f"could not move the new checkpoint {path}.partial to {path}"),
        ("clear", f"could not clear {path}.partial"),
    ):
        kind, message, seconds = results[0][case]
        assert kind in ("OSError", "IsADirectoryError", "NotADirectoryError"), (case, message)
        assert seconds < FAST_S, case
        kind, message, seconds = results[1][case]
        assert kind == "RuntimeError" and seconds < FAST_S, (case, kind, message, seconds)
        assert message.startswith("TrainingCheckpoint.save: rank(s) [0] "), message
        assert words in message and f"the previous checkpoint at {path} is intact" in message
    assert "Device or resource busy" in results[0]["mount"][1]
    for result in results:
        # the new checkpoint left in .partial after a failed rename (the next save clears it)
        assert result["listing"] == ["ckpt", "ckpt.partial"]
        assert result["kept"] == (2, True) and result["moved"]
        assert result["later"] == (4, True)
        assert result["final_listing"] == ["ckpt"]


@pytest.mark.timeout(300)
def test_a_rank_that_cannot_read_the_checkpoint_stops_every_rank_with_nothing_loaded(tmp_path):
    results = run_distributed(_worker_load, 2, str(tmp_path), timeout=240)
    for key in ("adamw", "onebit"):
        kind, message, seconds = results[1][key]
        assert kind == "FileNotFoundError" and seconds < FAST_S, (key, kind, message)
        kind, message, seconds = results[0][key]
        assert kind == "ValueError" and seconds < FAST_S, (key, kind, message)
        assert message.startswith(f"cannot read the checkpoint {tmp_path / key}: rank(s) [1] ")
        assert "nothing was loaded" in message
        for result in results:
            assert result[f"{key}_unchanged"], key
    for result in results:
        assert result["adamw_loaded"] == 2
        assert result["onebit_count"] == 4 and result["onebit_loaded"] == (3, 3)
