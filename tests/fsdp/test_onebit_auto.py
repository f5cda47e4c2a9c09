"""freeze_step="auto" on fn.fsdp.OnebitAdam and fn.fsdp.OnebitLamb, 2 gloo ranks: a switch forced
by max_updates equals the fixed freeze_step bit for bit; a switch the criterion decides is the
same on every rank and resumes bit for bit through DCP on both sides of it; a fixed-step
checkpoint is refused by an automatic optimizer."""

from __future__ import annotations

import os

import pytest
import torch

import fn
import fn.fsdp
from tests._distributed import run_distributed
from tests.fsdp.test_onebit import full_params
from tests.fsdp.test_onebit_checkpoint import KINDS, build, train_step

STEPS = 10
SETTLING = fn.AutoFreeze(min_updates=2, max_updates=20, tolerance=0.95)  # decides in a few updates


def optimizer(kind: str, model: torch.nn.Module, freeze_step) -> fn.fsdp.ShardedOnebitOptimizer:
    return KINDS[kind][0](model, lr=1e-2, freeze_step=freeze_step, betas=(0.9, 0.99))


def run(kind: str, rank: int, freeze_step, root: str | None = None) -> tuple[dict, int]:
    """Trains ``STEPS`` updates (a checkpoint after each under ``root``): the params after
    each update and the first compressed update."""
    model = build(kind)
    opt = optimizer(kind, model, freeze_step)
    history = {}
    for t in range(1, STEPS + 1):
        train_step(model, opt, rank, t)
        history[t] = full_params(model)
        if root is not None:
            fn.fsdp.TrainingCheckpoint(model, opt, step=t).save(os.path.join(root, str(t)))
    switch = int(opt._state.auto.freeze_at) if opt._state.auto is not None else freeze_step
    return history, switch


def _worker(rank: int, world_size: int, kind: str, root: str) -> dict:
    forced, forced_switch = run(kind, rank, fn.AutoFreeze(min_updates=3, max_updates=3))
    fixed, _ = run(kind, rank, 4)
    history, switch = run(kind, rank, SETTLING, root)
    mismatches = [
        ("forced", t, k)
        for t in fixed
        for k in fixed[t]
        if not torch.equal(forced[t][k], fixed[t][k])
    ]
    for start in (switch - 1, switch):  # the update that decided, and the switch itself
        model = build(kind, seed=1)
        opt = optimizer(kind, model, SETTLING)
        fn.fsdp.TrainingCheckpoint(model, opt).load(os.path.join(root, str(start)))
        for t in range(start + 1, STEPS + 1):
            train_step(model, opt, rank, t)
            got = full_params(model)
            mismatches += [(start, t, k) for k in got if not torch.equal(got[k], history[t][k])]
    model = build(kind, seed=1)
    opt = optimizer(kind, model, 4)
    try:
        fn.fsdp.TrainingCheckpoint(model, opt).load(os.path.join(root, "1"))
        refused = None
    except ValueError as error:
        refused = str(error)
    return dict(
        forced_switch=forced_switch,
        switch=switch,
        mismatches=mismatches,
        last=history[STEPS],
        refused=refused,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(KINDS))
def test_auto_switch_on_shards_agrees_and_resumes(tmp_path, kind):
    results = run_distributed(_worker, 2, kind, str(tmp_path), timeout=240)
    for rank, result in enumerate(results):
        assert result["forced_switch"] == 4
        assert result["mismatches"] == [], (rank, result["mismatches"][:5])
        assert 3 <= result["switch"] <= STEPS, result["switch"]  # decided by the criterion
        assert result["switch"] == results[0]["switch"]
        for k, value in result["last"].items():
            assert torch.equal(value, results[0]["last"][k]), k
        assert result["refused"] is not None and "settings" in result["refused"]
