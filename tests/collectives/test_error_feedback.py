"""Error feedback is recognized by type: ErrorFeedback values and ErrorFeedbackField fields."""

from typing import NamedTuple

import torch

import fn
from fn.collectives import ErrorFeedback, ErrorFeedbackField, Local, error_feedback_leaves


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
