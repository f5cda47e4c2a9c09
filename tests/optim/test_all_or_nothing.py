"""All-or-nothing steps and checkpoint loads of the adapter: a step or load that fails (or is
skipped) in any param group leaves every group's params, state, transform and step count
bitwise as they were; frozen params made trainable are a clear error."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local
from fn.optim import FunctionalOptimizer
from tests.optim._problem import backward, flat_params, make_model, train


def _two_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    return [{"params": model[0].parameters()}, {"params": model[2].parameters()}]


def _snapshot(opt: FunctionalOptimizer, model: torch.nn.Module) -> dict[str, Any]:
    """Everything a step or load may change, copied."""
    return {
        "params": flat_params(model),
        "state": copy.deepcopy(opt.state_dict()),
        "steps": [g.step for g in opt._groups],
        "transforms": [g.transform for g in opt._groups],
        "skipped": opt.skipped_steps,
    }


def _assert_unchanged(before: dict[str, Any], opt: FunctionalOptimizer, model) -> None:
    after = _snapshot(opt, model)
    assert torch.equal(before["params"], after["params"])
    assert before["steps"] == after["steps"]
    assert all(a is b for a, b in zip(before["transforms"], after["transforms"], strict=True))
    assert before["skipped"] == after["skipped"]
    for index, record in before["state"]["state"].items():
        now = after["state"]["state"][index]
        assert record["step"] == now["step"]
        assert record["functional"].keys() == now["functional"].keys()
        for key, value in record["functional"].items():
            other = now["functional"][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            assert same, (index, key)


def _onebit_adam(model: torch.nn.Module, **kwargs: Any) -> FunctionalOptimizer:
    return fn.optim.OnebitAdam(_two_groups(model), lr=1e-2, freeze_step=3, comm=Local(), **kwargs)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("eps", -1.0, "param group 1 sets eps=-1.0: onebit_adam: eps must be >= 0"),
        ("betas", (0.9,), "param group 1 sets betas=\\(0.9,\\)"),
        ("lr", float("nan"), "param group 1: lr must be a finite Python number >= 0"),
        ("lr", "0.1", "param group 1: lr must be a finite Python number >= 0"),
        ("lr", -0.1, "param group 1: lr must be a finite Python number >= 0"),
    ],
)
def test_an_invalid_hyperparameter_in_a_later_group_changes_nothing(key, value, match):
    model = make_model()
    opt = _onebit_adam(model)
    train(model, opt, 0, range(4))  # into the compressed phase
    opt.zero_grad()
    backward(model, 0, 4)
    before = _snapshot(opt, model)
    saved = opt.param_groups[1][key]
    opt.param_groups[0]["lr"] = 5e-3  # a valid change in group 0 reaches no state either
    opt.param_groups[1][key] = value
    with pytest.raises(ValueError, match=match):
        opt.step()
    opt.param_groups[0]["lr"], opt.param_groups[1][key] = 1e-2, saved
    _assert_unchanged(before, opt, model)  # the state's lr leaf too


def test_a_hyperparameter_that_changes_the_state_structure_is_a_clear_error():
    model = make_model()
    opt = FunctionalOptimizer(_two_groups(model), fn.sgd, defaults=dict(lr=0.1, momentum=0.0))
    train(model, opt, 0, range(2))
    backward(model, 0, 2)
    before = _snapshot(opt, model)
    opt.param_groups[1]["momentum"] = 0.9
    with pytest.raises(ValueError, match="param group 1 sets momentum=0.9.*another structure"):
        opt.step()
    _assert_unchanged(before, opt, model)
    opt.param_groups[1]["momentum"] = 0.0
    opt.step()
    assert [g.step for g in opt._groups] == [3, 3]


class _Boom(RuntimeError):
    pass


def _failing_sgd(lr: float, fail: bool) -> fn.GradientTransformation:
    """``fn.sgd(lr)`` whose update raises when ``fail``."""
    inner = fn.sgd(lr, momentum=0.9)

    def update_fn(updates, state, params=None, **extra):
        if fail:
            raise _Boom("the update of this group fails")
        return inner.update(updates, state, params, **extra)

    return fn.GradientTransformation(inner.init, update_fn)


def test_a_failing_update_in_a_later_group_leaves_every_group_unchanged():
    model = make_model()
    opt = FunctionalOptimizer(
        _two_groups(model), _failing_sgd, defaults=dict(lr=0.1, fail=False), comm=Local()
    )
    train(model, opt, 0, range(3))
    opt.zero_grad()
    backward(model, 0, 3)
    before = _snapshot(opt, model)
    opt.param_groups[1]["fail"] = True
    with pytest.raises(_Boom):
        opt.step()
    _assert_unchanged(before, opt, model)
    opt.param_groups[1]["fail"] = False
    opt.step()
    assert [g.step for g in opt._groups] == [4, 4]
    assert not torch.equal(flat_params(model), before["params"])


# ---------------------------------------------------------------- checkpoints


def _corrupt(state_dict: dict[str, Any], how: str) -> dict[str, Any]:
    """A copy of ``state_dict`` with group 1 (of 2) broken as ``how`` says."""
    bad = copy.deepcopy(state_dict)
    record = bad["state"][1]
    functional = record["functional"]
    if how == "nan":
        functional[".exp_avg"][0] = float("nan")
    elif how == "inf_error":  # one rank: never compressed, so the checkpoint holds none
        numel = functional[".exp_avg_sq"].numel()
        functional[".worker_error"] = torch.zeros(fn.collectives.padded_numel(numel, 1))
        functional[".server_error"] = torch.zeros(fn.collectives.padded_numel(numel, 1))
        functional[".worker_error"][-1] = float("inf")
    elif how == "negative_variance":
        functional[".exp_avg_sq"][3] = -1e-3
    elif how == "state_shape":
        functional[".exp_avg"] = torch.zeros(5)
    elif how == "param_shapes":
        record["shapes"][0] = [1, 2]
    elif how == "missing_field":
        del functional[".exp_avg_sq"]
    elif how == "no_record":
        del bad["state"][1]
    elif how == "bad_lr":
        bad["param_groups"][1]["lr"] = "fast"
    elif how == "bad_hyperparameter":
        bad["param_groups"][1]["freeze_step"] = 1
    elif how == "no_params":
        del bad["param_groups"][1]["params"]
    elif how == "no_state":
        del bad["state"]
    else:
        raise AssertionError(how)
    return bad


BAD_CHECKPOINTS = {
    "nan": "param group 1: state entry '.exp_avg' in the checkpoint has 1 non-finite",
    "inf_error": "param group 1: state entry '.worker_error' in the checkpoint has 1 non-finite",
    "negative_variance": "param group 1: state entry '.exp_avg_sq' .* negative values",
    "state_shape": "param group 1: state entry '.exp_avg' has shape \\(5,\\)",
    "param_shapes": "param group 1, param 0 has shape \\(1, 2\\) in the checkpoint",
    "missing_field": "param group 1: .*another structure \\(missing \\['.exp_avg_sq'\\]",
    "no_record": "no state for param group 1",
    "bad_lr": "param group 1: lr in the checkpoint must be a finite Python number",
    "bad_hyperparameter": "param group 1: the checkpoint's hyperparameters are invalid",
    "no_params": "the checkpoint's param group 1 must be a dict with a 'params' list",
    "no_state": "the optimizer state_dict lacks \\['state'\\]",
}


@pytest.mark.parametrize("how", list(BAD_CHECKPOINTS))
def test_a_checkpoint_with_one_bad_group_loads_nothing(how):
    source = make_model(seed=1)
    saved = _onebit_adam(source)
    train(source, saved, 0, range(5))  # compressed: error feedback is non-zero
    checkpoint = saved.state_dict()
    model = make_model()
    opt = _onebit_adam(model)
    train(model, opt, 0, range(2))
    before = _snapshot(opt, model)
    with pytest.raises(ValueError, match=BAD_CHECKPOINTS[how]):
        opt.load_state_dict(_corrupt(checkpoint, how))
    _assert_unchanged(before, opt, model)
    opt.load_state_dict(checkpoint)  # the intact checkpoint still loads
    assert [g.step for g in opt._groups] == [5, 5]


def test_a_checkpoint_of_another_optimizer_is_a_clear_error():
    source = make_model()
    adam = FunctionalOptimizer(_two_groups(source), fn.adam, defaults=dict(lr=1e-2))
    train(source, adam, 0, range(2))
    model = make_model()
    opt = _onebit_adam(model)
    train(model, opt, 0, range(2))
    before = _snapshot(opt, model)
    with pytest.raises(ValueError, match="param group 0: .*saved by another optimizer"):
        opt.load_state_dict(adam.state_dict())
    _assert_unchanged(before, opt, model)


def test_a_nonfinite_master_copy_is_rejected():
    source = make_model(dtype=torch.bfloat16)
    saved = _onebit_adam(source)
    train(source, saved, 0, range(2))
    checkpoint = saved.state_dict()
    checkpoint["state"][1]["master"][0] = float("nan")
    model = make_model(dtype=torch.bfloat16)
    opt = _onebit_adam(model)
    before = _snapshot(opt, model)
    with pytest.raises(ValueError, match="param group 1: the checkpoint's master copy"):
        opt.load_state_dict(checkpoint)
    _assert_unchanged(before, opt, model)


# ---------------------------------------------------------------- frozen params


def test_params_frozen_at_construction_stay_untouched_and_unfreezing_them_is_an_error():
    model = make_model()
    frozen = model[2].weight
    frozen.requires_grad_(False)
    start = frozen.detach().clone()
    opt = _onebit_adam(model)
    for t in range(4):  # into the compressed phase, which moves every element it holds
        opt.zero_grad()
        backward(model, 0, t)
        opt.step()
    assert torch.equal(frozen.detach(), start)
    frozen.requires_grad_(True)  # unfrozen: it would never be trained, so say so
    opt.zero_grad()
    backward(model, 0, 4)
    before = _snapshot(opt, model)
    with pytest.raises(RuntimeError, match="param group 1 had requires_grad=False"):
        opt.step()
    _assert_unchanged(before, opt, model)
    opt.add_param_group({"params": [frozen]})  # the documented way to train it
    opt.step()
    assert [g.step for g in opt._groups] == [5, 5, 1]
    assert not torch.equal(frozen.detach(), start)
