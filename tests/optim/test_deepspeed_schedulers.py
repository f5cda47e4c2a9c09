"""``fn.optim.scheduler_from_deepspeed``: DeepSpeed 0.18.9's LR schedules as torch schedulers,
against DeepSpeed's own scheduler classes (``deepspeed_data/schedulers.pt``, made by
``deepspeed_data/generate.py``) and against the formulas."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

import fn

DATA = Path(__file__).resolve().parent / "deepspeed_data"
REFERENCE = torch.load(DATA / "schedulers.pt", weights_only=True)["schedulers"]


def _optimizer(lr=0.005, groups=1):
    return torch.optim.Adam(
        [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(groups)], lr=lr
    )


def _values(opt, sched, steps):
    """(lr, betas) of group 0 at the updates 1 .. steps."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scheduler.step() without optimizer.step()
        for _ in range(steps):
            out.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
            sched.step()
    return out


@pytest.mark.parametrize("case", REFERENCE, ids=lambda c: c["type"])
def test_equals_deepspeed_s_scheduler(case):
    opt = _optimizer()
    sched = fn.optim.scheduler_from_deepspeed(
        opt, {"scheduler": {"type": case["type"], "params": case["params"]}}
    )
    ours = _values(opt, sched, len(case["lr"]) - 1)
    # DeepSpeed's value at construction was its init step's; update t used its value t
    for (lr, betas), theirs_lr, theirs_betas in zip(
        ours, case["lr"][1:], case["betas"][1:], strict=True
    ):
        assert lr == pytest.approx(theirs_lr, rel=1e-12, abs=1e-15)
        assert betas == pytest.approx(tuple(theirs_betas), rel=1e-12)


def test_formulas():
    opt = _optimizer(groups=2)
    params = {"warmup_min_lr": [0.0, 0.001], "warmup_max_lr": 0.01, "warmup_num_steps": 10}
    sched = fn.optim.DeepSpeedLR(opt, "WarmupLR", params)
    for i in range(12):
        gamma = math.log(i + 1) / math.log(10) if i < 10 else 1.0
        assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * gamma)
        assert opt.param_groups[1]["lr"] == pytest.approx(0.001 + 0.009 * gamma)
        _values(opt, sched, 1)
    opt = _optimizer(lr=0.1)
    params = {"total_num_steps": 20, "warmup_num_steps": 4, "warmup_type": "linear"}
    sched = fn.optim.DeepSpeedLR(opt, "WarmupCosineLR", params)
    for i in range(22):
        if i < 4:
            ratio = i / 4
        else:
            ratio = 1e-4 + (1 - 1e-4) * (1 + math.cos(math.pi * (i - 3) / 16)) / 2
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * max(ratio, 0.0))
        _values(opt, sched, 1)


def test_resumes_at_deepspeed_s_last_batch_iteration():
    case = next(c for c in REFERENCE if c["type"] == "OneCycle")
    opt = _optimizer()
    params = dict(case["params"], last_batch_iteration=5)
    sched = fn.optim.scheduler_from_deepspeed(opt, {"type": "OneCycle", "params": params})
    ours = _values(opt, sched, 4)
    assert [lr for lr, _ in ours] == pytest.approx(case["lr"][6:10], rel=1e-12)
    for (_, ours_betas), theirs_betas in zip(ours, case["betas"][6:10], strict=True):
        assert ours_betas == pytest.approx(tuple(theirs_betas))


def test_whole_config_scales_the_optimizer_lr_of_the_config():
    opt = _optimizer(lr=0.0123)  # e.g. an lr imported from a checkpoint
    config = {
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}},
    }
    sched = fn.optim.scheduler_from_deepspeed(opt, config)
    assert sched.base_lrs == [0.1]


def test_torch_scheduler_types_and_errors():
    sched = fn.optim.scheduler_from_deepspeed(
        _optimizer(), {"type": "StepLR", "params": {"step_size": 2}}
    )
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ValueError, match="unknown scheduler type"):
        fn.optim.scheduler_from_deepspeed(_optimizer(), {"type": "Warmup"})
    with pytest.raises(ValueError, match="unknown params"):
        fn.optim.scheduler_from_deepspeed(
            _optimizer(), {"type": "WarmupLR", "params": {"warmup_steps": 3}}
        )
    with pytest.raises(ValueError, match="required"):
        fn.optim.scheduler_from_deepspeed(_optimizer(), {"type": "WarmupDecayLR"})
    with pytest.raises(ValueError, match="auto"):
        fn.optim.scheduler_from_deepspeed(
            _optimizer(), {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}
        )
    with pytest.raises(ValueError, match="no scheduler block"):
        fn.optim.scheduler_from_deepspeed(_optimizer(), {"optimizer": {}})
