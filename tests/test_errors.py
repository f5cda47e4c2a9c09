"""fn.errors: NonFiniteError (every layer that refuses non-finite values raises it, a ValueError),
the argument checks, the finiteness test and the check that raises under vmap/compile."""

from __future__ import annotations

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn
from fn import kernels
from fn.collectives import Simulated, compressed_allreduce, init_error_feedback, replicate, simulate
from fn.errors import (
    all_finite,
    check_betas,
    check_finite,
    check_finite_nonnegative,
    check_fraction,
    check_int,
    check_lr,
    check_nonnegative,
    check_ordered,
    check_shapes,
    check_step,
    check_step_or_plan,
    finite_or_raise,
    real_value,
    require_params,
)

NAN, INF = float("nan"), float("inf")


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


FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(FLOATS, max_size=40))
def test_all_finite_is_the_elementwise_test(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert all_finite(x) == bool(torch.isfinite(x).all())


@pytest.mark.parametrize(
    "values,expected",
    [
        ([3e38, 3e38], True),  # the sum overflows; every element is finite
        ([-3e38, -3e38, 1.0], True),
        ([float("inf"), float("-inf")], False),  # the sum is NaN
        ([1.0, float("nan")], False),
        ([], True),
    ],
)
def test_all_finite_edge_cases(values, expected):
    assert all_finite(torch.tensor(values, dtype=torch.float32)) is expected


def test_eager_check_returns_the_input_itself():
    x = torch.randn(5)
    assert finite_or_raise(x, "bad") is x
    x[2] = float("nan")
    with pytest.raises(ValueError, match="bad"):
        finite_or_raise(x, "bad")


def test_vmap_checks_every_rank_and_returns_a_copy():
    x = torch.randn(4, 6)
    out = torch.func.vmap(lambda r: finite_or_raise(r, "bad") * 1)(x)
    assert torch.equal(out, x)
    x[3, 0] = float("inf")
    with pytest.raises(ValueError, match="bad"):
        torch.func.vmap(lambda r: finite_or_raise(r, "bad"))(x)


def test_check_betas_names_the_transform_and_the_beta():
    assert check_betas("opt", (0, 0.5)) == (0.0, 0.5)
    with pytest.raises(ValueError, match=r"opt: betas\[1\] must be in \[0, 1\), got 1.0"):
        check_betas("opt", (0.9, 1.0))
    with pytest.raises(ValueError, match=r"betas\[0\]"):
        check_betas("opt", (float("nan"), 0.5))


@pytest.mark.parametrize(
    "betas", [(0.9,), (0.9, 0.9, 0.9), (), None, 0.9, "ab", b"ab", ("a", 0.9), (0.9, None)]
)
def test_check_betas_wants_a_pair_of_real_numbers(betas):
    with pytest.raises(ValueError, match=r"opt: betas must be a pair \(b1, b2\) of real numbers"):
        check_betas("opt", betas)


def test_check_betas_takes_any_pair_of_real_numbers():
    pair = (0.5, 0.25)
    assert check_betas("opt", [0.5, 0.25]) == pair
    assert check_betas("opt", torch.tensor([0.5, 0.25])) == pair
    assert check_betas("opt", (torch.tensor(0.5), numpy.float32(0.25))) == pair
    assert check_betas("opt", (b for b in pair)) == pair
    with pytest.raises(ValueError, match="betas must be a pair"):
        check_betas("opt", (True, 0.5))  # a bool is no beta


def test_real_value_reads_real_numbers_only():
    assert real_value(3) == 3.0 and real_value(numpy.float32(0.5)) == 0.5
    assert real_value(torch.tensor([0.25])) == 0.25 and real_value(torch.tensor(2)) == 2.0
    for value in (True, "1", None, [1.0], 1j, torch.ones(2), torch.tensor(1j), torch.tensor(True)):
        assert real_value(value) is None, value


def test_lr_and_eps_must_be_finite_real_numbers_at_least_zero():
    check_finite_nonnegative("opt", eps=0.0, other=torch.tensor(1.0))
    check_lr("opt", 0.1)
    check_lr("opt", lambda count: 0.1)  # a schedule: read at update time
    with pytest.raises(ValueError, match="opt: eps must be finite"):
        check_finite_nonnegative("opt", eps=INF)
    with pytest.raises(ValueError, match="opt: eps must be >= 0, got nan"):
        check_finite_nonnegative("opt", eps=NAN)
    with pytest.raises(ValueError, match="opt: eps must be a real number >= 0, got '1'"):
        check_finite_nonnegative("opt", eps="1")
    for bad, message in [
        (INF, "lr must be finite"),
        (-1.0, "lr must be >= 0, got -1.0"),
        (None, "lr must be a real number >= 0 or a schedule"),
        ("0.1", "lr must be a real number >= 0 or a schedule"),
    ]:
        with pytest.raises(ValueError, match=f"opt: {message}"):
            check_lr("opt", bad)


def test_range_checks_reject_what_is_not_a_number_by_name():
    with pytest.raises(ValueError, match="opt: wd must be a real number >= 0, got None"):
        check_nonnegative("opt", wd=None)
    with pytest.raises(ValueError, match=r"opt: beta must be a real number in \[0, 1\), got 'x'"):
        check_fraction("opt", beta="x")
    with pytest.raises(ValueError, match="opt: high must be a real number, got None"):
        check_ordered("opt", low=1.0, high=None)
    check_ordered("opt", low=1.0, high=INF)


def test_range_checks_name_the_argument_and_reject_nan():
    check_nonnegative("opt", eps=0.0, lr=1.0)
    with pytest.raises(ValueError, match="opt: lr must be >= 0, got nan"):
        check_nonnegative("opt", eps=0.0, lr=float("nan"))
    check_fraction("opt", coeff_beta=0.0)
    with pytest.raises(ValueError, match=r"coeff_beta must be in \[0, 1\)"):
        check_fraction("opt", coeff_beta=1.0)
    check_ordered("opt", low=1.0, mid=1.0, high=2.0)
    with pytest.raises(ValueError, match=r"opt: mid \(3.0\) must be <= high \(2.0\)"):
        check_ordered("opt", low=1.0, mid=3.0, high=2.0)


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "1", None])
def test_check_int_wants_an_int_at_least_the_minimum(value):
    assert check_int("freeze_step", 1, 1) == 1
    with pytest.raises(ValueError, match=r"freeze_step must be an int >= 1, got .*: why"):
        check_int("freeze_step", value, 1, "why")


def test_check_step_counts_from_one_on_the_host():
    assert check_step(3) == 3
    for bad in (0, -2, 1.0, True, "3"):
        with pytest.raises(ValueError, match="step counts updates from 1"):
            check_step(bad)
    with pytest.raises(TypeError, match="Python int"):
        check_step(torch.tensor(1))


def test_check_step_or_plan_takes_exactly_one():
    assert check_step_or_plan(2, None) == 2
    assert check_step_or_plan(None, object()) is None
    for step, plan in ((None, None), (2, object())):
        with pytest.raises(TypeError, match="exactly one of step"):
            check_step_or_plan(step, plan)
    with pytest.raises(ValueError, match="step counts updates from 1"):
        check_step_or_plan(0, None)


def test_check_shapes_names_what_does_not_match():
    check_shapes("opt", torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"opt: gradient leaf \['w'\] of shape \(3, 2\)"):
        check_shapes("opt", torch.zeros(2, 3), torch.ones(3, 2), "gradient leaf ['w']")
    with pytest.raises(ValueError, match="does not match"):
        check_shapes("opt", torch.zeros(2, 3), torch.ones(3))


def test_require_params_and_check_finite_say_what():
    require_params({}, "weight_decay > 0")
    with pytest.raises(ValueError, match="weight_decay > 0 needs the params"):
        require_params(None, "weight_decay > 0")
    x = torch.ones(3)
    assert check_finite(x, "the gradient") is x
    with pytest.raises(ValueError, match="the gradient contains non-finite.*state is unchanged"):
        check_finite(torch.tensor([1.0, float("inf")]), "the gradient")
