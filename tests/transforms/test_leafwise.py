"""The per-leaf driver of the compressed optimizers (fn.transforms._leafwise)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from fn.collectives import Local
from fn.transforms._leafwise import (
    compressed_mean,
    leaf_type,
    map_leaves,
    moving_average,
    onebit_settings,
)


class State(NamedTuple):
    count: torch.Tensor
    exp_avg: dict
    exp_avg_sq: dict


class Leaf(NamedTuple):
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def make_state():
    zeros = {"w": torch.zeros(2, 3), "b": torch.zeros(4)}
    return State(torch.zeros((), dtype=torch.int64), zeros, {k: v + 1 for k, v in zeros.items()})


def rule(g, leaf, scale):
    factor = 1.0 if scale is None else scale
    return -g, Leaf(leaf.exp_avg + g * factor, leaf.exp_avg_sq + 1)


def test_rule_runs_per_leaf_and_fields_are_rebuilt():
    state = make_state()
    grads = {"w": torch.ones(2, 3, dtype=torch.float16), "b": torch.full((4,), 2.0)}
    updates, new = map_leaves("opt", rule, grads, state, Leaf, {"w": 3.0, "b": None})
    assert updates["w"].dtype == torch.float32  # gradients reach the rule as fp32
    assert torch.equal(updates["b"], torch.full((4,), -2.0))
    assert torch.equal(new.exp_avg["w"], torch.full((2, 3), 3.0))
    assert torch.equal(new.exp_avg_sq["b"], torch.full((4,), 2.0))
    assert new.count is state.count  # fields outside the leaf type are left alone


def test_none_gradient_leaves_pass_through_untouched():
    state = make_state()
    calls = []

    def counting_rule(g, leaf):
        calls.append(g.shape)
        return g, leaf

    updates, new = map_leaves("opt", counting_rule, {"w": None, "b": torch.ones(4)}, state, Leaf)
    assert updates["w"] is None and calls == [torch.Size([4])]
    assert new.exp_avg["w"] is state.exp_avg["w"] and new.exp_avg_sq["w"] is state.exp_avg_sq["w"]


def test_a_wrong_gradient_shape_names_the_leaf():
    grads = {"w": torch.ones(3, 2), "b": torch.ones(4)}
    with pytest.raises(ValueError, match=r"opt: gradient leaf \['w'\] of shape \(3, 2\)"):
        map_leaves("opt", rule, grads, make_state(), Leaf, None)


def test_moving_average_rounds_as_written():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    for beta in (0.9, 0.999, 0.3):
        assert torch.equal(moving_average(x, beta, y), beta * x + (1 - beta) * y)
        assert torch.equal(moving_average(x, beta, y, square=True), beta * x + (1 - beta) * y * y)


def test_compressed_mean_with_one_worker_is_the_input_checked():
    x, ew, es = torch.ones(3), torch.zeros(0), torch.zeros(0)
    one = onebit_settings("test", 1e-3, (0.9, 0.999), 1e-8, 0.0, Local(), True)
    assert compressed_mean(x, ew, es, one)[0] is x
    with pytest.raises(ValueError, match="the momentum contains non-finite"):
        compressed_mean(torch.tensor([float("nan")]), ew, es, one, "the momentum")
    nan = torch.tensor([float("nan")])
    assert compressed_mean(nan, ew, es, one)[0] is nan  # no check asked for


def test_leaf_type_holds_the_per_leaf_fields_in_the_state_order():
    class Full(NamedTuple):
        count: torch.Tensor
        lr: torch.Tensor
        exp_avg: dict
        shared_error: torch.Tensor
        exp_avg_sq: dict

    derived = leaf_type(Full, shared=("shared_error",))
    assert derived._fields == Leaf._fields
    assert leaf_type(State)._fields == ("exp_avg", "exp_avg_sq")
    with pytest.raises(TypeError, match="no fields"):
        leaf_type(Full, shared=("worker_error",))
