"""On 2 real gloo processes (one launch): finite gradients whose average over the ranks
overflows. ``nonfinite="skip"`` skips the step on every rank, ``"raise"`` raises on every rank;
either way every param group (the earlier, finite ones too) stays bitwise as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fn
import fn.optim
from tests._distributed import run_distributed
from tests.optim._problem import backward, flat_params, make_model

WORLD = 2
HUGE = 3e38  # finite in fp32; the sum of two is not

OPTIMIZERS = {
    "adam": lambda groups, policy: fn.optim.FunctionalOptimizer(
        groups, fn.adam, defaults=dict(lr=1e-2), nonfinite=policy
    ),
    "onebit_adam_warmup": lambda groups, policy: fn.optim.OnebitAdam(
        groups, lr=1e-2, freeze_step=10, nonfinite=policy
    ),
}


def _state(opt: fn.optim.FunctionalOptimizer) -> list[Any]:
    return [(g.step, fn.optim._checkpoint.state_to_dict(g.state)) for g in opt._groups]


def _same(a: list[Any], b: list[Any]) -> bool:
    for (step_a, state_a), (step_b, state_b) in zip(a, b, strict=True):
        if step_a != step_b or state_a.keys() != state_b.keys():
            return False
        for k, x in state_a.items():
            y = state_b[k]
            if (x is None) != (y is None) or x is not None and not torch.equal(x, y):
                return False
    return True


def _overflow_in_the_last_group(rank: int, name: str, policy: str) -> dict[str, Any]:
    model = make_model()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    opt = OPTIMIZERS[name](groups, policy)
    for t in range(3):
        opt.zero_grad()
        backward(model, rank, t)
        opt.step()
    opt.zero_grad()
    backward(model, rank, 3)
    model[2].weight.grad.fill_(HUGE)  # finite on every rank; the sum overflows
    params, state = flat_params(model), _state(opt)
    error = None
    try:
        opt.step()
    except ValueError as err:
        error = str(err)
    unchanged = torch.equal(flat_params(model), params) and _same(state, _state(opt))
    skipped = (opt.last_step_skipped, opt.skipped_steps)
    opt.zero_grad()
    backward(model, rank, 4)
    opt.step()  # a normal step still works, and the groups' step counts agree
    return {
        "error": error,
        "unchanged": unchanged,
        "skipped": skipped,
        "steps": [g.step for g in opt._groups],
        "final": flat_params(model),
    }


def _worker(rank: int, world_size: int) -> dict[Any, Any]:
    del world_size
    return {
        (name, policy): _overflow_in_the_last_group(rank, name, policy)
        for name in OPTIMIZERS
        for policy in ("skip", "raise")
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout=150)


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_skip_skips_an_overflowing_average_on_every_rank(results, name):
    for r in results:
        run = r[name, "skip"]
        assert run["error"] is None
        assert run["unchanged"] and run["skipped"] == (True, 1)
        assert run["steps"] == [4, 4]
    assert torch.equal(results[0][name, "skip"]["final"], results[1][name, "skip"]["final"])


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_raise_raises_on_every_rank_and_changes_nothing(results, name):
    for r in results:
        run = r[name, "raise"]
        assert "param group 1" in run["error"] and "non-finite" in run["error"]
        assert "nonfinite='skip'" in run["error"]
        assert run["unchanged"] and run["skipped"] == (True, 0)
        assert run["steps"] == [4, 4]
