"""Checkpoints of the 1-bit family across its phases: a state with packed momentum and error
feedback (after the freeze) loads exactly into an optimizer still in warmup, and a warmup state
into one past the freeze; a state in a form no update takes (a flat buffer's in a per-param
optimizer too) is refused, with nothing loaded."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fn
from fn.collectives import Local
from tests._distributed import run_distributed
from tests.optim._problem import flat_params, make_model, save_and_load, states_equal, train

ADAPTERS = {
    "onebit_adam": lambda ps: fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=3),
    "onebit_adam_per_param": lambda ps: fn.optim.OnebitAdam(
        ps, lr=1e-2, freeze_step=3, flatten=False, error_dtype=torch.bfloat16
    ),
    "onebit_lamb": lambda ps: fn.optim.OnebitLamb(ps, lr=1e-2, freeze_step=3),
    "zero_one_adam": lambda ps: fn.optim.ZeroOneAdam(
        ps, lr=1e-2, var_freeze_step=3, var_update_scaler=1
    ),
}
STEPS = 8


def _resumed(make, rank, saved_at, loaded_at, checkpoint):
    """A fresh run trained ``loaded_at`` steps, then given ``checkpoint`` (saved after
    ``saved_at``) and trained on to ``STEPS``: its final params."""
    model = make_model(seed=1)
    opt = make(model.parameters())
    train(model, opt, rank, range(loaded_at))
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(save_and_load(checkpoint["optim"]))
    train(model, opt, rank, range(saved_at, STEPS))
    return flat_params(model)


def _worker(rank: int, world_size: int) -> dict:
    del world_size
    warnings.simplefilter("ignore", RuntimeWarning)  # the frozen-variance report
    out = {}
    for name, make in ADAPTERS.items():
        model = make_model()
        opt = make(model.parameters())
        checkpoints = {}
        for t in range(STEPS):
            train(model, opt, rank, range(t, t + 1))
            checkpoints[t + 1] = {
                "model": copy.deepcopy(model.state_dict()),
                "optim": opt.state_dict(),
            }
        full = flat_params(model)
        functional = checkpoints[5]["optim"]["state"][0]["functional"]
        out[name] = {
            "packed": any(k.endswith(".packed") for k in functional),
            "warmup_lazy": any(
                v is None for k, v in checkpoints[1]["optim"]["state"][0]["functional"].items()
            ),
            # compressed (packed momentum, errors) into an optimizer in warmup
            "into_warmup": torch.equal(_resumed(make, rank, 5, 1, checkpoints[5]), full),
            # warmup (fp32 momentum, no errors) into an optimizer past the freeze
            "into_compressed": torch.equal(_resumed(make, rank, 1, 5, checkpoints[1]), full),
            # the step of the freeze itself, both ways
            "at_freeze": torch.equal(_resumed(make, rank, 3, 4, checkpoints[3]), full),
        }
        bad = save_and_load(checkpoints[5]["optim"])
        record = bad["state"][0]["functional"]
        key = next((k for k in record if k.endswith(".packed")), None)
        if key is not None:
            record[key] = record[key][:, :1].contiguous()  # too few signs for the params
        else:
            record[".exp_avg"] = record[".exp_avg"][:-1]
        fresh = make(make_model(seed=1).parameters())
        before = fresh.state_dict()
        try:
            fresh.load_state_dict(bad)
            out[name]["bad"] = None
        except ValueError as err:
            out[name]["bad"] = str(err)
        after = fresh.state_dict()
        out[name]["intact"] = after["state"][0]["step"] == before["state"][0]["step"] == 0
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ADAPTERS)
def test_checkpoints_load_exactly_across_the_freeze(results, name):
    for out in results:
        got = out[name]
        # 0/1 Adam keeps an fp32 momentum and its error feedback from init on; the others hold
        # no error feedback in warmup and packed signs once compressed
        assert got["warmup_lazy"] == got["packed"] == (name != "zero_one_adam")
        assert got["into_warmup"] and got["into_compressed"] and got["at_freeze"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ADAPTERS)
def test_a_state_in_no_form_of_the_optimizer_is_refused_and_nothing_loads(results, name):
    for out in results:
        assert out[name]["bad"] is not None and "param group 0" in out[name]["bad"]
        assert "exp_avg" in out[name]["bad"]
        assert out[name]["intact"]


@pytest.mark.parametrize("saved_at", [2, 5])  # warmup, compressed
def test_a_flat_buffers_state_is_refused_by_a_per_param_optimizer(saved_at):
    model = make_model()
    flat = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, comm=Local())
    train(model, flat, 0, range(saved_at))
    other = make_model(seed=1)
    per_param = fn.optim.OnebitAdam(
        other.parameters(), lr=1e-2, freeze_step=3, comm=Local(), flatten=False
    )
    before = per_param.state_dict()
    with pytest.raises(ValueError, match=r"another structure .*built with flatten=True"):
        per_param.load_state_dict(save_and_load(flat.state_dict()))
    assert states_equal(before, per_param.state_dict())
    train(other, per_param, 0, range(2))  # it trains on
    assert per_param.state_dict()["state"][0]["step"] == 2
