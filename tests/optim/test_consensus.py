"""Cross-rank checks of the adapter on 2 gloo processes (one launch): a group built differently
(optimizer, schedule, lr, transform settings) is a ValueError on every rank naming the field and
the ranks, and so are different initial params at the first step; check_consistency and
check_every find ranks that drifted apart, and 0/1 Adam's local steps are not mistaken for
drift."""

from __future__ import annotations

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local, ProcessGroup
from tests._distributed import run_distributed
from tests.collectives.test_sizes import error_message
from tests.optim._problem import backward, make_model

pytestmark = pytest.mark.distributed


def _build_cases(rank):
    model = make_model()
    ps = list(model.parameters())
    other = fn.optim.ZeroOneAdam if rank else fn.optim.OnebitAdam
    return {
        "class": lambda: other(ps, lr=1e-2),
        "freeze_step": lambda: fn.optim.OnebitAdam(ps, freeze_step=4 if rank == 0 else 30),
        "lr": lambda: fn.optim.OnebitLamb(ps, lr=1e-2 * (1 + rank)),
        "fixed transform": lambda: fn.optim.FunctionalOptimizer(
            ps, fn.onebit_adam(1e-3, freeze_step=5 + rank, comm=ProcessGroup())
        ),
        "initial params": lambda: _first_step(make_model(seed=rank)),
        "add_param_group": lambda: _add_group(rank),
        "same": lambda: fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=4),
    }


def _first_step(model):
    opt = fn.optim.OnebitAdam(model.parameters())  # builds: values are not compared yet
    backward(model, 0, 0)
    opt.step()


def _add_group(rank):
    model = make_model()
    opt = fn.optim.OnebitAdam([model[0].weight], lr=1e-2)
    opt.add_param_group({"params": [model[2].weight], "lr": 1e-3 if rank == 0 else 2e-3})


def _train(opt, model, rank, steps, drift_at=None):
    for t in range(steps):
        opt.zero_grad()
        backward(model, rank, t)
        if t == drift_at and rank == 1:
            with torch.no_grad():
                model[0].weight[0, 0] += 1e-3
        opt.step()


def _worker(rank, world_size):
    out = {name: error_message(run) for name, run in _build_cases(rank).items()}
    # On demand: in sync after training, then rank 1 changes a param alone.
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    _train(opt, model, rank, 5)
    out["in sync"] = error_message(opt.check_consistency)
    opt.param_groups[0]["lr"] = 1e-2 if rank == 0 else 3e-2
    out["lr drift"] = error_message(opt.check_consistency)
    opt.param_groups[0]["lr"] = 1e-2
    if rank == 1:
        with torch.no_grad():
            model[2].bias.add_(1e-6)
    out["param drift"] = error_message(opt.check_consistency)
    # Every 2 steps, from step(): rank 1 drifts at update 3 (0-based), found at update 4.
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, check_every=2)
    out["periodic"] = error_message(lambda: _train(opt, model, rank, 8, drift_at=3))
    # 0/1 Adam with local steps and syncs, checked after every step: no false alarm.
    model = make_model()
    opt = fn.optim.ZeroOneAdam(
        model.parameters(),
        lr=1e-2,
        var_freeze_step=3,
        var_update_scaler=1,
        local_step_scaler=1,
        local_step_clipper=4,
        check_every=1,
    )
    out["zero_one"] = error_message(lambda: _train(opt, model, rank, 16))
    out["zero_one step"] = opt.state_dict()["state"][0]["step"]
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=200)


@pytest.mark.timeout(240)
def test_groups_built_differently_raise_on_every_rank(results):
    for out in results:
        assert "optimizer: fn.optim._onebit.OnebitAdam on ranks [0]" in out["class"]
        assert "fn.optim._onebit.ZeroOneAdam on ranks [1]" in out["class"]
        assert "freeze_step: 4 on ranks [0]; 30 on ranks [1]" in out["freeze_step"]
        assert "lr: 0.01 on ranks [0]; 0.02 on ranks [1]" in out["lr"]
        assert "freeze_step: 5 on ranks [0]; 6 on ranks [1]" in out["fixed transform"]
        assert "param group 0 params differ: ranks [0] hold rank 0's" in out["initial params"]
        assert "seed the model's initialization" in out["initial params"]
        assert "param group 1 differently: lr: 0.001 on ranks [0]" in out["add_param_group"]
        assert out["same"] is None


@pytest.mark.timeout(240)
def test_drift_is_found_on_every_rank(results):
    for out in results:
        assert out["in sync"] is None
        assert "param group 0 hyperparameters differ: ranks [0] vs [1]" in out["lr drift"]
        assert (
            "param group 0 params differ: ranks [0] hold rank 0's, ranks [1]"
            in (out["param drift"])
        )
        assert "params differ" in out["periodic"]
        assert out["zero_one"] is None and out["zero_one step"] == 16


def test_one_rank_checks_nothing():
    model = make_model()
    opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.sgd(0.1), Local(), check_every=1)
    opt.check_consistency()
    with pytest.raises(ValueError, match="check_every must be an int >= 0"):
        fn.optim.FunctionalOptimizer(model.parameters(), fn.sgd(0.1), Local(), check_every=-1)
    for cls in (fn.optim.OnebitAdam, fn.optim.ZeroOneAdam, fn.optim.OnebitLamb):
        assert cls(model.parameters(), comm=Local(), check_every=3).check_every == 3
        with pytest.raises(ValueError, match="check_every must be an int >= 0"):
            cls(model.parameters(), comm=Local(), check_every=-1)
