"""``fn.optim.scheduler_from_deepspeed``: DeepSpeed 0.18.9's LR schedules as torch schedulers,
against DeepSpeed's own scheduler classes (``deepspeed_data/schedulers.pt``, made by
``deepspeed_data/generate.py``) and against the formulas; and the resume of an optimizer with
its scheduler in the order docs/migrating-from-deepspeed.md gives, run from the guide's lines,
and the guide's constant schedule for a config without a scheduler block."""

from __future__ import annotations

import ast
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fn

DATA = Path(__file__).resolve().parent / "deepspeed_data"
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-deepspeed.md"
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


CONFIG = {
    "optimizer": {"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 3}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": 20, "warmup_num_steps": 4, "warmup_max_lr": 0.01},
    },
}
SCHEDULERS = {
    "WarmupDecayLR": lambda opt: fn.optim.scheduler_from_deepspeed(opt, CONFIG),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step)),
}
RESUMED_AT = 5  # updates before the checkpoint: in the compressed phase


class _GuideProgram:
    """The guide's training program (its block that resumes: ``sched.load_state_dict(``), as
    the source of its statements: building ``opt`` and ``sched``, the resume under
    ``if os.path.exists(path):`` and the save from ``state = ...`` to ``torch.save(...)``."""

    def __init__(self) -> None:
        blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.DOTALL)
        (self.source,) = [block for block in blocks if "sched.load_state_dict(" in block]
        body = ast.parse(self.source).body
        at = {self._assigned(node): i for i, node in enumerate(body) if self._assigned(node)}
        resume = next(
            i for i, n in enumerate(body) if isinstance(n, ast.If) and "exists" in self._src(n.test)
        )
        self.order = [at["opt"], at["sched"], resume]  # statement indices, in the guide's order
        self.opt, self.sched = self._src(body[at["opt"]]), self._src(body[at["sched"]])
        self.resume = [self._src(node) for node in body[resume].body]
        saved = next(i for i, n in enumerate(body) if "torch.save(" in self._src(n))
        self.save = "\n".join(self._src(node) for node in body[at["state"] : saved + 1])

    def _src(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.source, node)

    @staticmethod
    def _assigned(node: ast.stmt) -> str | None:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            return node.targets[0].id
        return None


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(model, opt, sched, updates: range) -> None:
    for t in updates:
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_the_guide_s_resume_order_continues_bit_for_bit(kind, tmp_path):
    guide = _GuideProgram()
    assert guide.order == sorted(guide.order)  # opt, then sched, then the loads
    assert "fn.optim.scheduler_from_deepspeed(opt, config)" in guide.sched
    sched_line = guide.sched if kind == "WarmupDecayLR" else "sched = make_scheduler(opt)"
    loads = [i for i, line in enumerate(guide.resume) if ".load_state_dict(" in line]
    assert [guide.resume[i].split(".")[0] for i in loads] == ["model", "opt", "sched"]
    after_opt = loads[1] + 1  # the other order: the scheduler built after the optimizer's load
    orders = {
        "guide": [guide.opt, sched_line, *guide.resume],
        "scheduler built after the load": [
            guide.opt, *guide.resume[:after_opt], sched_line, *guide.resume[after_opt:]
        ],
    }  # fmt: skip
    path = str(tmp_path / "checkpoint.rank0.pt")
    names = {"torch": torch, "fn": fn, "config": CONFIG, "path": path, "device": "cpu"}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the config's scheduler block, a frozen variance
            model = _model(0)
            opt = fn.optim.from_deepspeed(model.parameters(), CONFIG)
            sched = SCHEDULERS[kind](opt)
            _train(model, opt, sched, range(1, RESUMED_AT + 1))
            exec(guide.save, {**names, "model": model, "opt": opt, "sched": sched, "start": 0})
            _train(model, opt, sched, range(RESUMED_AT + 1, 11))  # uninterrupted
            resumed = {}
            for order, lines in orders.items():
                scope = {**names, "make_scheduler": SCHEDULERS[kind]}
                scope["model"] = _model(1)  # other weights: the checkpoint brings them back
                exec("\n".join(lines), scope)
                _train(scope["model"], scope["opt"], scope["sched"], range(RESUMED_AT + 1, 11))
                resumed[order] = all(
                    torch.equal(a, b)
                    for a, b in zip(model.parameters(), scope["model"].parameters(), strict=True)
                )
    finally:
        dist.destroy_process_group()
    assert resumed == {"guide": True, "scheduler built after the load": False}


def test_the_guide_s_schedule_without_a_scheduler_block_is_constant():
    """The guide builds a constant schedule for a config without a scheduler block (for which
    ``scheduler_from_deepspeed`` raises), so its loop and checkpoints are the same."""
    guide = _GuideProgram()
    opt = _optimizer(lr=0.01)
    scope = {"torch": torch, "fn": fn, "opt": opt, "config": {"optimizer": CONFIG["optimizer"]}}
    exec(guide.sched, scope)
    for _ in range(3):
        opt.step()
        scope["sched"].step()
    assert opt.param_groups[0]["lr"] == 0.01
    assert scope["sched"].state_dict()["last_epoch"] == 3
