"""fn.NonFiniteError: every layer that refuses non-finite values raises it (a ValueError)."""

import pytest
import torch

import fn
from fn import kernels
from fn.collectives import Simulated, compressed_allreduce, init_error_feedback, replicate, simulate

NAN = float("nan")


def test_is_a_value_error():
    assert issubclass(fn.NonFiniteError, ValueError)
    assert "NonFiniteError" in fn.__all__


def test_kernel_refuses_a_non_finite_input():
    with pytest.raises(fn.NonFiniteError, match="non-finite"):
        kernels.sign_compress(torch.tensor([1.0, NAN, -2.0]))


def test_simulated_allreduce_raises_on_every_rank_and_keeps_the_errors():
    comm = Simulated(2)
    worker, server = replicate(tuple(init_error_feedback(4, comm=comm)), comm)
    worker, server = worker + 0.5, server + 0.25
    before = worker.clone(), server.clone()
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, NAN, 3.0, 4.0]])
    car = simulate(lambda x, ew, es: compressed_allreduce(x, ew, es, comm=comm), comm)
    with pytest.raises(fn.NonFiniteError, match="non-finite"):
        car(x, worker, server)
    assert torch.equal(worker, before[0]) and torch.equal(server, before[1])


def test_optimizer_raises_before_updating():
    tx = fn.onebit_adam(freeze_step=2, comm=fn.collectives.Local())
    state = tx.init({"w": torch.zeros(3)})
    with pytest.raises(fn.NonFiniteError, match="state is unchanged"):
        tx.update({"w": torch.tensor([1.0, float("inf"), 0.0])}, state, step=1)
    assert int(state.count) == 0 and torch.equal(state.exp_avg["w"], torch.zeros(3))


def test_adapter_raises_under_the_raise_policy():
    w = torch.nn.Parameter(torch.ones(2))
    opt = fn.optim.OnebitAdam([w], lr=0.1, freeze_step=2, comm=fn.collectives.Local())
    w.grad = torch.tensor([NAN, 1.0])
    with pytest.raises(fn.NonFiniteError):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(2)) and opt.last_step_skipped
