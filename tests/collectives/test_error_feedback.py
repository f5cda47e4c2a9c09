"""Error feedback is recognized by type: ErrorFeedback values and ErrorFeedbackField fields;
what of it is laid out by position, by the ParamShapedErrorFeedbackField fields it leaves out."""

from typing import NamedTuple

import torch

import fn
from fn.collectives import (
    ErrorFeedback,
    ErrorFeedbackField,
    Local,
    error_feedback_leaves,
    positional_leaves,
)


class _Renamed(NamedTuple):
    count: torch.Tensor
    residual: ErrorFeedbackField  # a name the adapter has never heard of
    history: dict


def test_annotated_field_marks_every_leaf_under_it():
    state = _Renamed(torch.zeros(()), {"a": torch.ones(2), "b": (torch.ones(1), None)}, {"h": 1.0})
    # torch's pytree counts None as a leaf: it is marked like its neighbours
    assert error_feedback_leaves(state) == [False, True, True, True, False]


def test_error_feedback_values_are_marked_wherever_they_sit():
    pair = fn.collectives.init_error_feedback(10, comm=Local())
    assert isinstance(pair, ErrorFeedback)
    state = ({"x": pair, "y": torch.zeros(3)}, [torch.zeros(1)])
    assert error_feedback_leaves(state) == [True, True, False, False]


def test_optimizer_states_mark_their_buffers_and_nothing_else():
    params = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    comm = Local()
    for opt in (
        fn.onebit_adam(freeze_step=3, comm=comm),
        fn.zero_one_adam(comm=comm),
        fn.onebit_lamb(freeze_step=3, comm=comm),
    ):
        state = opt.init(params)  # 1-bit Adam, 1-bit LAMB: None until the freeze
        leaves = fn.tree.tree_leaves(state, keep_none=True)
        marks = error_feedback_leaves(state)
        errors = fn.tree.tree_leaves((state.worker_error, state.server_error), keep_none=True)
        assert len(marks) == len(leaves)
        assert [leaf for leaf, m in zip(leaves, marks, strict=True) if m] == errors


def test_positional_leaves_leave_out_only_error_feedback_laid_out_as_the_params():
    comm = fn.collectives.Simulated(4)
    params = {"w": torch.zeros(40), "b": torch.zeros(3)}
    gather = fn.collectives.topk_allreduce(2, 8, comm=comm, exchange="gather").init(params)
    owner = fn.collectives.topk_allreduce(2, 8, comm=comm, exchange="owner").init(params)
    onebit = fn.collectives.onebit_allreduce(comm=comm).init(params)
    loco = fn.collectives.loco_allreduce(4, 8, comm=comm).init(params)
    assert positional_leaves(gather) == [False, False]
    assert error_feedback_leaves(gather) == [True, True]
    assert positional_leaves(owner) == [False, False, True]  # the server error: owned chunks
    assert positional_leaves(onebit) == error_feedback_leaves(onebit) == [True] * 4
    assert positional_leaves(loco) == error_feedback_leaves(loco)
    assert any(positional_leaves(loco))
    pair = fn.collectives.init_error_feedback(10, comm=comm)  # padded to W: by position
    assert positional_leaves((pair, torch.zeros(2))) == [True, True, False]
    assert positional_leaves(_Renamed(torch.zeros(()), torch.ones(2), {})) == [False, True]
