"""Bandwidth savings that would never start are said: the switch to compressed updates is
logged once, and a compressed phase that a run's length never reaches is a warning (the
adapter, Trainer, Accelerate, and from_deepspeed without params)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local


@pytest.mark.parametrize(
    ("build", "first"),
    [
        (lambda: fn.onebit_adam(1e-2, freeze_step=3, comm=Local()), 3),
        (lambda: fn.onebit_lamb(1e-2, freeze_step=4, comm=Local()), 4),
        (lambda: fn.zero_one_adam(1e-2, var_freeze_step=4, comm=Local()), 5),
    ],
    ids=["onebit_adam", "onebit_lamb", "zero_one_adam"],
)
def test_the_first_compressed_update_is_logged_once(caplog, build, first):
    opt = build()
    params = {"w": torch.ones(4)}
    state = opt.init(params)
    caplog.set_level(logging.INFO, logger="fn.transforms")
    for t in range(1, 9):
        _, state = opt.update({"w": torch.tensor([1.0, -2.0, 0.5, 3.0])}, state, params, step=t)
    logged = [r.getMessage() for r in caplog.records if "compressed updates" in r.getMessage()]
    assert len(logged) == 1
    assert logged[0].endswith(f"compressed updates start at update {first}")
    assert opt.first_compressed_update(8) == first


def test_a_resumed_state_logs_nothing_more(caplog):
    opt = fn.onebit_adam(1e-2, freeze_step=3, comm=Local())
    params = {"w": torch.ones(4)}
    state = opt.init(params)
    for t in range(1, 5):
        _, state = opt.update({"w": torch.ones(4)}, state, params, step=t)
    caplog.set_level(logging.INFO, logger="fn.transforms")
    fn.onebit_adam(1e-2, freeze_step=3, comm=Local()).update(
        {"w": torch.ones(4)}, state, params, step=5
    )
    assert caplog.records == []


def test_first_compressed_update_stops_at_the_limit():
    opt = fn.onebit_adam(1e-3, comm=Local())  # DeepSpeed's freeze_step 100000
    assert opt.first_compressed_update(1000) is None
    assert opt.first_compressed_update(100000) == 100000


def _adapter(**kwargs):
    return fn.optim.OnebitAdam(torch.nn.Linear(3, 2).parameters(), comm=Local(), **kwargs)


def test_the_adapter_warns_when_a_run_never_compresses():
    with pytest.warns(UserWarning, match=r"param groups \[0\] make no compressed update within "):
        assert _adapter().warn_if_never_compressed(500, "max_steps")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _adapter(freeze_step=100).warn_if_never_compressed(500)
        model = torch.nn.Linear(3, 2)
        dense = fn.optim.FunctionalOptimizer(model.parameters(), fn.adam(1e-3), comm=Local())
        assert not dense.warn_if_never_compressed(500)
        zero_one = fn.optim.ZeroOneAdam(model.parameters(), comm=Local())  # defaults compress
        assert not zero_one.warn_if_never_compressed(500)


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}


def _trainer_warnings(tmp_path, freeze_step):
    transformers = pytest.importorskip("transformers", reason="in the 'integrations' extra")
    from fn.integrations.transformers import attach

    data = [{"x": torch.randn(3), "labels": torch.randn(1)} for _ in range(8)]
    model = _Regression()
    args = transformers.TrainingArguments(
        tmp_path, max_steps=4, per_device_train_batch_size=2, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=freeze_step, comm=Local())
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, optimizers=(opt, None)
    )
    attach(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return [str(w.message) for w in caught if "compressed update" in str(w.message)]


def test_trainer_warns_when_max_steps_ends_before_the_compressed_phase(tmp_path):
    (message,) = _trainer_warnings(tmp_path, freeze_step=100)
    assert "within the Trainer's max_steps (4 updates)" in message
    assert _trainer_warnings(tmp_path, freeze_step=2) == []


def test_accelerate_attach_warns_for_its_max_steps():
    accelerate = pytest.importorskip("accelerate", reason="in the 'integrations' extra")
    from fn.integrations.accelerate import attach

    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    opt = fn.optim.OnebitAdam(model.parameters(), freeze_step=1000, comm=Local())
    model, opt = accelerator.prepare(model, opt)
    with pytest.warns(UserWarning, match=r"within max_steps \(200 updates\)"):
        attach(accelerator, model, opt, max_steps=200).remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attach(accelerator, model, opt, max_steps=2000).remove()
        attach(accelerator, model, opt).remove()


def test_from_deepspeed_without_params_warns_of_its_defaults():
    params = torch.nn.Linear(3, 2).parameters()
    with pytest.warns(UserWarning, match="no 'params', so DeepSpeed's defaults are used"):
        fn.optim.from_deepspeed(params, {"type": "OneBitAdam"}, comm=Local())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = {"type": "OneBitAdam", "params": {"freeze_step": 10}}
        fn.optim.from_deepspeed(torch.nn.Linear(3, 2).parameters(), config, comm=Local())
