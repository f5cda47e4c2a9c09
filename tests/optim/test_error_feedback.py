"""A checkpoint of another world size resets exactly the error feedback, found by type: a field
annotated ``ErrorFeedbackField`` or a value of type ``ErrorFeedback``, whatever their names."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch

import fn
import fn.optim
from fn.collectives import ErrorFeedback, ErrorFeedbackField, Local
from tests.optim._problem import make_model, save_and_load, train


class ResidualState(NamedTuple):
    count: torch.Tensor  # [] int64
    momentum: torch.Tensor  # [n] fp32
    leftover: ErrorFeedbackField  # [n] fp32: error feedback under an unusual name
    carried: Any  # ErrorFeedback(worker [n], server [n]) fp32
    worker_error: torch.Tensor  # [n] fp32: NOT error feedback, despite the name


def residual_sgd() -> fn.GradientTransformation:
    """Momentum SGD whose state also accumulates fake error-feedback buffers."""

    def init_fn(params: torch.Tensor) -> ResidualState:
        zeros = torch.zeros_like(params)
        return ResidualState(
            torch.zeros((), dtype=torch.int64), zeros, zeros, ErrorFeedback(zeros, zeros), zeros
        )

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        momentum = 0.9 * state.momentum + updates
        carried = ErrorFeedback(state.carried.worker + updates, state.carried.server - updates)
        new = ResidualState(
            state.count + 1,
            momentum,
            state.leftover + 2 * updates,
            carried,
            state.worker_error + 3 * updates,
        )
        return -0.01 * momentum, new

    return fn.GradientTransformation(init_fn, update_fn)


ERROR_KEYS = {".leftover", ".carried.worker", ".carried.server"}


def _trained_checkpoint() -> dict[str, Any]:
    model = make_model()
    opt = fn.optim.FunctionalOptimizer(model.parameters(), residual_sgd(), comm=Local())
    train(model, opt, 0, range(3))
    return save_and_load(opt.state_dict())


def test_the_fake_error_feedback_is_found_by_type():
    state = residual_sgd().init(torch.zeros(4))
    flags = fn.collectives.error_feedback_leaves(state)
    assert flags == [False, False, True, True, True, False]


@pytest.mark.parametrize("saved_world", [1, 2], ids=["same-world", "other-world"])
def test_loading_resets_exactly_the_error_feedback_of_another_world_size(saved_world):
    ckpt = _trained_checkpoint()
    record = ckpt["state"][0]
    record["world_size"] = saved_world
    saved = record["functional"]
    assert ERROR_KEYS < set(saved) and all(saved[k].abs().sum() > 0 for k in ERROR_KEYS)

    opt = fn.optim.FunctionalOptimizer(make_model(seed=3).parameters(), residual_sgd(), Local())
    if saved_world == 1:
        opt.load_state_dict(ckpt)
    else:
        with pytest.warns(UserWarning, match=r"world_size \[2\].*reset"):
            opt.load_state_dict(ckpt)
    loaded = opt.state_dict()["state"][0]
    assert loaded["step"] == 3
    for key, value in saved.items():
        if key in ERROR_KEYS and saved_world != 1:
            assert not loaded["functional"][key].any(), key
        else:
            assert torch.equal(loaded["functional"][key], value), key
