"""Gradients that one rank alone cannot use raise on every rank: a sparse gradient on rank 0
only makes ``step()`` raise the same ``ValueError`` on both ranks (naming the param on rank 0),
nothing changes on either, no rank waits for a collective timeout, and the next steps (with
dense gradients) continue as if the failed step never happened."""

from __future__ import annotations

import warnings

import pytest
import torch

import fn
import fn.optim
from tests._distributed import run_distributed
from tests.optim._problem import backward, flat_params, make_model, train

pytestmark = pytest.mark.distributed

OPTIMIZERS = {
    "adam": lambda ps: fn.optim.FunctionalOptimizer(ps, fn.adam(1e-2)),
    "onebit_adam_warmup": lambda ps: fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=100),
    "onebit_adam": lambda ps: fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=2),
    "onebit_lamb": lambda ps: fn.optim.OnebitLamb(ps, lr=1e-2, freeze_step=2),
    "zero_one_adam": lambda ps: fn.optim.ZeroOneAdam(ps, lr=1e-2, var_freeze_step=2),
}
FAILED_AT = 3  # past the freeze of the compressed optimizers


def _worker(rank: int, world_size: int) -> dict:
    del world_size
    warnings.simplefilter("ignore", RuntimeWarning)  # the frozen-variance report
    out = {}
    for name, make in OPTIMIZERS.items():
        model, reference = make_model(), make_model()
        opt, reference_opt = make(model.parameters()), make(reference.parameters())
        train(model, opt, rank, range(FAILED_AT))
        train(reference, reference_opt, rank, range(FAILED_AT))
        before = (flat_params(model), opt.state_dict()["state"][0]["step"])
        opt.zero_grad()
        backward(model, rank, FAILED_AT)
        if rank == 0:
            model[0].weight.grad = model[0].weight.grad.to_sparse()
        try:
            opt.step()
            error = None
        except ValueError as err:
            error = str(err)
        after = (flat_params(model), opt.state_dict()["state"][0]["step"])
        train(model, opt, rank, range(FAILED_AT, FAILED_AT + 3))
        train(reference, reference_opt, rank, range(FAILED_AT, FAILED_AT + 3))
        out[name] = {
            "error": error,
            "unchanged": torch.equal(before[0], after[0]) and before[1] == after[1],
            "continues": torch.equal(flat_params(model), flat_params(reference)),
        }
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=120)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_sparse_gradient_on_one_rank_raises_on_every_rank(results, name):
    for rank, out in enumerate(results):
        got = out[name]
        assert got["error"] is not None, rank
        assert "1 of 2 ranks hold a gradient that fn.optim cannot take" in got["error"]
        assert "no update was made on any rank" in got["error"]
        if rank == 0:
            assert "param group 0: param 0 of shape (7, 5) has a torch.sparse_coo" in got["error"]
        assert got["unchanged"] and got["continues"], rank
