"""A ``torch.compile``'d training step that calls an ``fn.optim`` optimizer's ``step()``: the
step is an eager boundary (one graph break), so the step function never recompiles across the
phases, and the run equals the eager one bit for bit (``aot_eager``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fn
import fn.optim
from fn.collectives import Local
from tests._distributed import run_distributed
from tests.optim._problem import batch, flat_params, make_model

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the frozen-variance report

STEPS = 10
ZERO_ONE = dict(var_freeze_step=4, var_update_scaler=1, local_step_scaler=2, local_step_clipper=2)
OPTIMIZERS = {
    "onebit_adam": lambda ps, c: fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=4, comm=c),
    "onebit_lamb": lambda ps, c: fn.optim.OnebitLamb(ps, lr=1e-2, freeze_step=4, comm=c),
    "zero_one_adam": lambda ps, c: fn.optim.ZeroOneAdam(ps, lr=1e-2, comm=c, **ZERO_ONE),
    "adamw": lambda ps, c: fn.optim.FunctionalOptimizer(ps, fn.adamw(1e-2), comm=c),
}


def _train(name: str, comm, rank: int, compiled: bool) -> tuple[torch.Tensor, int]:
    """Final params and the number of frames dynamo compiled (0 when eager)."""
    model = make_model()
    opt = OPTIMIZERS[name](model.parameters(), comm)
    opt.check_every = 1  # a counter the step must not expose to dynamo's guards
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    def train_step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    counter = CompileCounterWithBackend("aot_eager")
    if compiled:
        torch._dynamo.reset()
        train_step = torch.compile(train_step, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(STEPS):
            train_step(*batch(rank, t))
            sched.step()
    torch._dynamo.reset()
    return flat_params(model), counter.frame_count


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_compiled_training_step_never_recompiles_and_equals_eager(name):
    eager, _ = _train(name, Local(), 0, compiled=False)
    got, frames = _train(name, Local(), 0, compiled=True)
    assert torch.equal(got, eager)
    assert frames > 0  # the forward and backward were compiled


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_compiled_training_step_on_two_ranks_equals_eager():
    results = run_distributed(_on_gloo_pairs, 2, timeout=200)
    for (eager, _), (compiled, frames) in results:
        assert torch.equal(eager, compiled) and frames > 0
    assert torch.equal(results[0][1][0], results[1][1][0])  # the ranks agree


def _on_gloo_pairs(rank: int, world_size: int) -> list:
    del world_size
    warnings.simplefilter("ignore", RuntimeWarning)
    comm = fn.collectives.ProcessGroup()
    return [_train("onebit_adam", comm, rank, compiled) for compiled in (False, True)]
