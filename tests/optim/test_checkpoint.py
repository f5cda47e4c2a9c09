"""Adapter checkpoints under Local: bit-exact resume in both phases, bf16 masters, bad input.
(Error feedback with two ranks and world-size changes: test_distributed.py.)"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import fn
import fn.optim
from fn.base import SecondMomentField
from fn.tree import PyTree
from tests.optim._problem import flat_params, interrupted_run, make_model, save_and_load, train

N = 12
OPTIMIZERS = {
    "onebit_adam": lambda ps: fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=4, weight_decay=0.01),
    "zero_one_adam": lambda ps: fn.optim.ZeroOneAdam(
        ps,
        lr=1e-2,
        var_freeze_step=5,
        var_update_scaler=2,
        local_step_scaler=2,
        local_step_clipper=4,
    ),
    "onebit_lamb": lambda ps: fn.optim.OnebitLamb(ps, lr=1e-2, freeze_step=4, weight_decay=0.01),
    "adam": lambda ps: fn.optim.FunctionalOptimizer(ps, fn.adam(1e-2)),
}


@pytest.mark.parametrize("k", [2, 8], ids=["warmup", "compressed"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_is_bit_identical(name, k):
    out = interrupted_run(OPTIMIZERS[name], 0, k, N)
    assert out["same_params"] and out["same_state"]
    assert out["checkpoint"]["state"][0]["step"] == k


@pytest.mark.parametrize("k", [2, 8], ids=["warmup", "compressed"])
@pytest.mark.parametrize("name", ["onebit_adam", "onebit_lamb"])
def test_a_checkpoint_without_a_field_this_optimizer_leaves_unused_resumes(name, k):
    """A checkpoint saved before the state had its ``auto`` field (``None`` unless
    ``freeze_step="auto"``) loads, and the run continues bit for bit; an automatic optimizer
    refuses it."""
    make = OPTIMIZERS[name]
    model = make_model()
    train(model, make(model.parameters()), 0, range(N))
    model_k = make_model()
    opt_k = make(model_k.parameters())
    train(model_k, opt_k, 0, range(k))
    older = save_and_load({"model": model_k.state_dict(), "optim": opt_k.state_dict()})
    assert older["optim"]["state"][0]["functional"].pop(".auto") is None
    resumed = make_model(seed=3)
    resumed.load_state_dict(older["model"])
    opt = make(resumed.parameters())
    opt.load_state_dict(older["optim"])
    train(resumed, opt, 0, range(k, N))
    assert torch.equal(flat_params(resumed), flat_params(model))
    automatic = type(opt)(make_model().parameters(), freeze_step="auto")
    with pytest.raises(ValueError):
        automatic.load_state_dict(older["optim"])


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["model-first", "optim-first"])
def test_bf16_resume_restores_the_fp32_master(optimizer_first):
    out = interrupted_run(
        OPTIMIZERS["onebit_adam"], 0, 6, N, torch.bfloat16, optimizer_first=optimizer_first
    )
    assert out["same_params"] and out["same_state"]
    assert out["checkpoint"]["state"][0]["master"].dtype == torch.float32


def test_a_checkpoint_is_not_aliased_to_the_live_optimizer():
    model = make_model(dtype=torch.bfloat16)
    opt = OPTIMIZERS["onebit_adam"](model.parameters())
    train(model, opt, 0, range(3))
    saved = opt.state_dict()
    functional = saved["state"][0]["functional"]
    copy = {k: v.clone() for k, v in functional.items() if v is not None}
    master = saved["state"][0]["master"].clone()
    train(model, opt, 0, range(3, 6))
    for k, v in copy.items():
        assert torch.equal(functional[k], v), k
    assert torch.equal(saved["state"][0]["master"], master)


def test_lr_and_hyperparameters_come_back_from_the_checkpoint():
    model = make_model()
    opt = OPTIMIZERS["onebit_adam"](model.parameters())
    opt.param_groups[0]["lr"] = 0.25
    ckpt = save_and_load(opt.state_dict())
    fresh = OPTIMIZERS["onebit_adam"](make_model().parameters())
    fresh.load_state_dict(ckpt)
    assert fresh.param_groups[0]["lr"] == 0.25 and fresh.param_groups[0]["freeze_step"] == 4


def test_a_checkpoint_of_another_model_or_optimizer_is_a_value_error():
    model = make_model()
    opt = OPTIMIZERS["onebit_adam"](model.parameters())
    train(model, opt, 0, range(2))
    ckpt = save_and_load(opt.state_dict())

    wider = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    other = OPTIMIZERS["onebit_adam"](wider.parameters())
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"param 0 has shape \(7, 5\) in the checkpoint"):
        other.load_state_dict(ckpt)
    assert other.state_dict()["state"][0]["step"] == before["state"][0]["step"] == 0

    lamb = OPTIMIZERS["onebit_lamb"](make_model().parameters())
    with pytest.raises(ValueError, match="another structure"):
        lamb.load_state_dict(ckpt)

    split = OPTIMIZERS["onebit_adam"]([{"params": [p]} for p in make_model().parameters()])
    with pytest.raises(ValueError, match="param groups"):
        split.load_state_dict(ckpt)


class _SquaresState(NamedTuple):
    count: torch.Tensor
    squares: SecondMomentField  # declared: never negative
    offsets: PyTree  # any sign


def _squares_transform() -> fn.GradientTransformation:
    """A transform whose state declares one second-moment field and one signed field."""

    def init(params):
        zeros = torch.zeros_like(params)
        return _SquaresState(torch.zeros([], dtype=torch.int64), zeros, zeros.clone())

    def update(grads, state, params=None, **extra):
        new = _SquaresState(state.count + 1, state.squares + grads**2, state.offsets - grads)
        return -0.1 * grads, new

    return fn.GradientTransformation(init, update)


@pytest.mark.parametrize("field", ["squares", "offsets"])
def test_a_negative_value_is_rejected_only_in_a_declared_second_moment(field):
    model = make_model()
    opt = fn.optim.FunctionalOptimizer(model.parameters(), _squares_transform())
    train(model, opt, 0, range(2))
    saved = opt.state_dict()
    saved["state"][0]["functional"][f".{field}"] = -torch.ones(
        sum(p.numel() for p in model.parameters())
    )
    before = opt._groups[0].state
    if field == "squares":
        with pytest.raises(ValueError, match=r"state entry '\.squares' .* negative values"):
            opt.load_state_dict(saved)
        assert opt._groups[0].state is before
    else:
        opt.load_state_dict(saved)
        assert torch.equal(
            opt._groups[0].state.offsets, saved["state"][0]["functional"][".offsets"]
        )


@pytest.mark.parametrize("count", [torch.tensor(-5), torch.tensor(-1)])
def test_a_count_that_is_no_update_count_is_refused(count):
    """A negative count made Adam's bias correction negative (NaN params at the next step), and
    the 1-bit family's schedule raise a bare StopIteration."""
    model = make_model()
    opt = fn.optim.FunctionalOptimizer(model.parameters(), _squares_transform())
    train(model, opt, 0, range(2))
    saved = opt.state_dict()
    saved["state"][0]["functional"][".count"] = count
    before = opt.state_dict()
    with pytest.raises(ValueError, match=r"state entry '\.count' .* not an update count"):
        opt.load_state_dict(saved)
    assert opt.state_dict()["state"][0]["functional"][".count"] == 2
    assert before["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
