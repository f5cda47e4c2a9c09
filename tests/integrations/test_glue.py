"""fn.integrations without launching: lazy imports, wrong optimizers, and the accelerate hook."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local


def test_import_fn_imports_no_stack():
    code = (
        "import sys, fn, fn.optim; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', 'fn.integrations') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unwrap_finds_fn_optimizers_inside_wrappers_and_rejects_others():
    from fn.integrations._common import unwrap_optimizer

    model = torch.nn.Linear(2, 2)
    opt = fn.optim.OnebitAdam(model.parameters(), freeze_step=2, comm=Local())

    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    assert unwrap_optimizer(Wrapper(Wrapper(opt))) is opt
    with pytest.raises(TypeError, match="needs an fn.optim optimizer.*got SGD"):
        unwrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_accelerate_attach_gathers_before_save_state(tmp_path):
    accelerate = pytest.importorskip(
        "accelerate", reason="accelerate is in the 'integrations' extra"
    )
    from fn.integrations.accelerate import attach

    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    opt = fn.optim.OnebitAdam(model.parameters(), freeze_step=2, comm=Local())
    model, opt = accelerator.prepare(model, opt)
    calls = []
    fn_opt = opt.optimizer
    fn_opt.gather_error_feedback = lambda: calls.append("gathered")
    attach(accelerator, model, opt)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    accelerator.save_state(tmp_path / "state")
    assert calls == ["gathered"]
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    accelerator.load_state(tmp_path / "state")  # safetensors into fn-managed params
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), b)


def test_trainer_attach_rejects_a_torch_optimizer(tmp_path):
    transformers = pytest.importorskip("transformers", reason="in the 'integrations' extra")
    from fn.integrations.transformers import attach

    model = torch.nn.Linear(2, 2)
    args = transformers.TrainingArguments(tmp_path, use_cpu=True, report_to=[])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = transformers.Trainer(model=model, args=args, optimizers=(optimizer, None))
    with pytest.raises(TypeError, match="needs an fn.optim optimizer"):
        attach(trainer)


@pytest.mark.parametrize("strategy", ["steps", "epoch", "best", "callback"])
def test_trainer_attach_gathers_before_every_checkpoint(tmp_path, strategy):
    transformers = pytest.importorskip("transformers", reason="in the 'integrations' extra")
    from fn.integrations.transformers import attach

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def forward(self, x, labels):
            return {"loss": (self.net(x) - labels).pow(2).mean()}

    events = []

    class Saves(transformers.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            events.append(("saved", state.global_step))

    class RequestsSaves(transformers.TrainerCallback):  # added after attach(), e.g. preemption
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = control.should_save or state.global_step == 3

        def on_log(self, args, state, control, **kwargs):
            control.should_save = control.should_save or state.global_step == 5

        def on_evaluate(self, args, state, control, **kwargs):
            control.should_save = control.should_save or state.global_step == 6

    torch.manual_seed(0)
    model = Model()
    data = [{"x": torch.randn(4), "labels": torch.zeros(1)} for _ in range(8)]
    args = transformers.TrainingArguments(
        tmp_path, per_device_train_batch_size=2, num_train_epochs=2,
        save_strategy="no" if strategy == "callback" else strategy, save_steps=3,
        eval_strategy="steps" if strategy in ("best", "callback") else "no", eval_steps=2,
        metric_for_best_model="loss" if strategy == "best" else None, use_cpu=True,
        report_to=[], disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm=Local())
    opt.gather_error_feedback = lambda: events.append(("gathered", None))
    trainer = transformers.Trainer(
        model, args, train_dataset=data, eval_dataset=data[:2], optimizers=(opt, None)
    )
    attach(trainer)
    trainer.add_callback(Saves())
    if strategy == "callback":
        trainer.add_callback(RequestsSaves())
    trainer.train()
    saves = [i for i, event in enumerate(events) if event[0] == "saved"]
    assert saves, events
    if strategy == "callback":  # requested in on_step_end, on_log, on_evaluate
        assert [events[i][1] for i in saves] == [3, 5, 6], events
    for i in saves:  # the event just before every save is a gather
        assert events[i - 1][0] == "gathered", events


def test_trainer_attach_without_an_optimizer_says_to_pass_one(tmp_path):
    transformers = pytest.importorskip("transformers", reason="in the 'integrations' extra")
    from fn.integrations.transformers import attach

    model = torch.nn.Linear(2, 2)
    args = transformers.TrainingArguments(tmp_path, use_cpu=True, report_to=[])
    trainer = transformers.Trainer(
        model=model,
        args=args,
        optimizer_cls_and_kwargs=(fn.optim.OnebitAdam, {"lr": 1e-3, "comm": Local()}),
    )
    with pytest.raises(TypeError, match=r"optimizers=\(optimizer, scheduler\)"):
        attach(trainer)


def _save_on_each_node_worker(rank: int, world_size: int, root: str) -> dict:
    """Two ranks, each its node's first (two nodes of one rank): ``save_state`` with
    ``save_on_each_node`` and without; ``attach`` before ``prepare`` refused."""
    del world_size
    import os

    import accelerate

    from fn.integrations.accelerate import attach

    os.environ["LOCAL_RANK"] = "0"
    out = {}
    for each in (True, False):
        config = accelerate.utils.ProjectConfiguration(save_on_each_node=each)
        accelerator = accelerate.Accelerator(cpu=True, project_config=config)
        model = torch.nn.Linear(3, 2)
        opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
        try:  # before prepare: refused (DDP would average densely all run)
            attach(accelerator, model, opt)
            out[each, "unprepared"] = None
        except TypeError as error:
            out[each, "unprepared"] = str(error)
        model, opt = accelerator.prepare(model, opt)
        attach(accelerator, model, opt)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        path = os.path.join(root, f"{each}-{rank}")
        try:
            accelerator.save_state(path)
            out[each] = "saved"
        except NotImplementedError as error:
            out[each] = str(error)
        out[each, "files"] = sorted(os.listdir(path)) if os.path.isdir(path) else []
    return out


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_accelerate_refuses_save_on_each_node_across_nodes_and_attach_before_prepare(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is in the 'integrations' extra")
    from tests._distributed import run_distributed

    outs = run_distributed(_save_on_each_node_worker, 2, str(tmp_path), timeout=180)
    for rank, out in enumerate(outs):
        for each in (True, False):
            assert "call accelerator.prepare(model, optimizer, ...) first" in (
                out[each, "unprepared"] or ""
            ), out
        assert "save_on_each_node=True on 2 nodes is not built" in out[True], out
        assert not any(name.startswith("optimizer") for name in out[True, "files"]), out
        assert out[False] == "saved", out
        assert ("optimizer.bin" in out[False, "files"]) == (rank == 0), out  # rank 0's alone
