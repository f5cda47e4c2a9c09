"""The per-group checkpoint record: the stored dict round-trips, malformed records are a clear
ValueError and change nothing."""

from __future__ import annotations

import pytest
import torch

import fn.optim
from fn.optim._checkpoint import GroupRecord
from tests.optim._problem import make_model, save_and_load, train


def _checkpoint(dtype: torch.dtype = torch.float32) -> tuple[torch.optim.Optimizer, dict]:
    model = make_model(dtype=dtype)
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    train(model, opt, 0, range(3))
    return opt, save_and_load(opt.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stored_record_round_trips(dtype):
    _, ckpt = _checkpoint(dtype)
    stored = ckpt["state"][0]
    assert set(stored) == {"step", "world_size", "rank", "shapes", "functional"} | (
        {"master"} if dtype == torch.bfloat16 else set()
    )
    record = GroupRecord.from_dict(stored, 0)
    assert record.step == 3 and record.world_size == 1 and record.rank == 0
    assert record.shapes == ((7, 5), (7,), (3, 7), (3,))
    again = record.to_dict()
    assert again.keys() == stored.keys() and again["shapes"] == stored["shapes"]


BROKEN = [
    (lambda r: r.pop("world_size"), r"lacks \['world_size'\]"),
    (lambda r: r.update(extra=1), r"unknown keys \['extra'\]"),
    (lambda r: r.update(step=-1), r"'step' must be an int >= 0, got -1"),
    (lambda r: r.update(step=2.5), r"'step' must be an int >= 0"),
    (lambda r: r.update(world_size=0), r"'world_size' must be an int >= 1"),
    (lambda r: r.update(shapes=[[7, "5"]]), r"'shapes' must be a list of shapes"),
    (lambda r: r.update(functional=[1, 2]), r"'functional' must be a dict"),
    (lambda r: r.update(master=[0.0]), r"'master' must be a tensor"),
]


@pytest.mark.parametrize("break_record, message", BROKEN, ids=[m for _, m in BROKEN])
def test_a_malformed_record_is_a_value_error_and_changes_nothing(break_record, message):
    _, ckpt = _checkpoint()
    break_record(ckpt["state"][0])
    fresh = fn.optim.OnebitAdam(make_model().parameters(), lr=0.5, freeze_step=2)
    with pytest.raises(ValueError, match=r"param group 0: the checkpoint's record.*" + message):
        fresh.load_state_dict(ckpt)
    state = fresh.state_dict()
    assert state["state"][0]["step"] == 0 and state["param_groups"][0]["lr"] == 0.5
    assert not state["state"][0]["functional"][".exp_avg"].any()


def test_a_missing_group_record_is_a_value_error():
    opt, ckpt = _checkpoint()
    del ckpt["state"][0]
    with pytest.raises(ValueError, match="no state for param group 0"):
        opt.load_state_dict(ckpt)
