"""scale_by_learning_rate, schedules, set_hyperparams, and add_decayed_weights."""

from __future__ import annotations

import pytest
import torch

import fn


def test_constant_lr_descends():
    tx = fn.scale_by_learning_rate(0.5)
    u = {"w": torch.tensor([1.0, -2.0])}
    state = tx.init(u)
    assert state.lr.dtype == torch.float32 and state.lr.shape == ()
    out, state = tx.update(u, state)
    torch.testing.assert_close(out["w"], torch.tensor([-0.5, 1.0]))
    assert int(state.count) == 1 and float(state.lr) == 0.5


def test_schedule_is_evaluated_at_the_count():
    def schedule(count):
        return torch.where(count < 2, 0.1 * (count + 1).float(), torch.tensor(1.0))

    tx = fn.scale_by_learning_rate(schedule)
    u = torch.ones(())
    state = tx.init(u)
    seen = []
    for _ in range(4):
        out, state = tx.update(u, state)
        seen.append(-float(out))
        assert float(state.lr) == pytest.approx(seen[-1])
    assert seen == pytest.approx([0.1, 0.2, 1.0, 1.0])


def test_float_schedule_values_are_accepted():
    tx = fn.scale_by_learning_rate(lambda count: 0.25)
    out, state = tx.update(torch.ones(2), tx.init(torch.ones(2)))
    assert torch.equal(out, torch.full((2,), -0.25)) and float(state.lr) == 0.25


def test_set_hyperparams_changes_lr_in_a_chain():
    tx = fn.adam(lr=1e-3)
    params = {"w": torch.ones(3)}
    grads = {"w": torch.tensor([1.0, -1.0, 2.0])}
    state = tx.init(params)
    state = fn.set_hyperparams(state, lr=0.5)
    assert float(fn.get_hyperparam(state, "lr")) == 0.5
    assert fn.get_hyperparam(state, "lr").dtype == torch.float32
    updates, _ = tx.update(grads, state, params)
    # First Adam step is sign(g) (up to eps), times -lr.
    torch.testing.assert_close(updates["w"], -0.5 * torch.sign(grads["w"]))


def test_decoupled_weight_decay():
    lr, wd = 0.1, 0.5
    tx = fn.scale_by_learning_rate(lr, decoupled_weight_decay=wd)
    p = {"w": torch.tensor([2.0, -4.0])}
    u = {"w": torch.tensor([1.0, 1.0])}
    out, _ = tx.update(u, tx.init(p), p)
    torch.testing.assert_close(out["w"], -lr * (u["w"] + wd * p["w"]))
    with pytest.raises(ValueError, match="params"):
        tx.update(u, tx.init(p))


def test_add_decayed_weights():
    tx = fn.add_decayed_weights(0.1)
    p = {"w": torch.tensor([2.0, -4.0]), "b": torch.ones(1)}
    u = {"w": torch.tensor([1.0, 1.0]), "b": None}
    out, state = tx.update(u, tx.init(p), p)
    torch.testing.assert_close(out["w"], torch.tensor([1.2, 0.6]))
    assert out["b"] is None and state == fn.EmptyState()
    with pytest.raises(ValueError, match="params"):
        tx.update(u, state)
    same, _ = fn.add_decayed_weights(0.0).update(u, state)  # no params needed when 0
    assert same is u
    with pytest.raises(ValueError, match="weight_decay"):
        fn.add_decayed_weights(-1.0)
