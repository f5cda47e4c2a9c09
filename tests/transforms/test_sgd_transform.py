"""trace() (momentum) against the rule written out."""

from __future__ import annotations

import pytest
import torch

import fn


@pytest.mark.parametrize("nesterov,dampening", [(False, 0.0), (True, 0.0), (False, 0.5)])
def test_trace_matches_formula(nesterov, dampening):
    mu = 0.8
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4, generator=gen) for _ in range(6)]
    tx = fn.trace(mu, nesterov, dampening=dampening)
    state = tx.init(torch.zeros(4))
    buf = None
    for g in grads:
        buf = g.clone() if buf is None else mu * buf + (1 - dampening) * g
        want = g + mu * buf if nesterov else buf
        updates, state = tx.update(g, state)
        torch.testing.assert_close(updates, want)
        torch.testing.assert_close(state.trace, buf)


def test_sgd_state_structure():
    params = {"w": torch.zeros(3)}
    state = fn.sgd(0.1).init(params)
    assert isinstance(state[0], fn.EmptyState) and isinstance(state[1], fn.ScaleByLearningRateState)
    state = fn.sgd(0.1, momentum=0.9).init(params)
    assert isinstance(state[1], fn.TraceState) and state[1].trace["w"].shape == (3,)


@pytest.mark.parametrize(
    "kwargs", [dict(nesterov=True), dict(momentum=0.9, nesterov=True, dampening=0.1)]
)
def test_nesterov_needs_momentum_and_no_dampening(kwargs):
    with pytest.raises(ValueError, match="Nesterov"):
        fn.sgd(0.1, **kwargs)


def test_negative_lr_is_an_error():
    with pytest.raises(ValueError, match="lr"):
        fn.sgd(-0.1)


@pytest.mark.parametrize("donate", [None, True])
def test_trace_rejects_an_update_without_state_and_a_wrong_shape(donate):
    tx = fn.trace(0.9)
    state = tx.init({"w": torch.zeros(2), "frozen": None})
    with pytest.raises(ValueError, match="trace: an update where the state has no momentum"):
        tx.update({"w": torch.ones(2), "frozen": torch.ones(1)}, state, donate=donate)
    with pytest.raises(ValueError, match="does not match"):
        tx.update({"w": torch.ones(3), "frozen": None}, state, donate=donate)
    assert torch.equal(state.trace["w"], torch.zeros(2))
