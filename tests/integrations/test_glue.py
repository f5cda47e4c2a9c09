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
