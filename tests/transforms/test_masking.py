"""masked() and set_to_zero()."""

from __future__ import annotations

import pytest
import torch

import fn


def make_params():
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=gen),
        "b": torch.randn(4, generator=gen),
        "v": torch.randn(2, 2, generator=gen),
    }


def make_grads(seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) for k, v in make_params().items()}


MASK = {"w": True, "b": False, "v": True}


@pytest.mark.parametrize("as_callable", [False, True])
def test_masked_applies_inner_to_selected_leaves_only(as_callable):
    mask = (lambda p: {k: x.ndim > 1 for k, x in p.items()}) if as_callable else MASK
    tx = fn.masked(fn.adam(lr=0.1), mask)
    params = make_params()
    state = tx.init(params)
    assert isinstance(state, fn.MaskedState)
    adam_state = state.inner_state[1]
    assert adam_state.mu["b"] is None and adam_state.nu["b"] is None
    assert adam_state.mu["w"].shape == (3, 4)

    # The same Adam on the selected sub-tree alone.
    sub = {k: params[k] for k in ("w", "v")}
    ref_tx = fn.adam(lr=0.1)
    ref_state = ref_tx.init(sub)
    for step in range(3):
        grads = make_grads(step)
        updates, state = tx.update(grads, state, params)
        ref_updates, ref_state = ref_tx.update({k: grads[k] for k in sub}, ref_state, sub)
        assert torch.equal(updates["b"], grads["b"])  # passed through untouched
        for k in sub:
            torch.testing.assert_close(updates[k], ref_updates[k], rtol=0, atol=0)
    assert state.inner_state[1].mu["b"] is None
    assert int(state.inner_state[1].count) == 3


def test_frozen_params_stay_untouched():
    frozen = {"w": False, "b": True, "v": False}
    trainable = {k: not f for k, f in frozen.items()}
    tx = fn.chain(fn.masked(fn.adamw(lr=0.1), trainable), fn.masked(fn.set_to_zero(), frozen))
    params = make_params()
    state = tx.init(params)
    new = params
    for step in range(3):
        updates, state = tx.update(make_grads(step), state, new)
        new = fn.apply_updates(new, updates)
    assert torch.equal(new["b"], params["b"])
    assert not torch.allclose(new["w"], params["w"])
    assert state[0].inner_state[0].mu["b"] is None


def test_masked_update_without_params_uses_updates_for_the_mask():
    tx = fn.masked(fn.scale_by_adam(), lambda t: {k: x.ndim > 1 for k, x in t.items()})
    state = tx.init(make_params())
    grads = make_grads(0)
    updates, _ = tx.update(grads, state)
    assert torch.equal(updates["b"], grads["b"])
    assert not torch.equal(updates["w"], grads["w"])


def test_mask_must_be_bools():
    tx = fn.masked(fn.identity(), {"w": 1, "b": True, "v": True})
    with pytest.raises(TypeError, match="bool"):
        tx.init(make_params())


def test_set_to_zero():
    tx = fn.set_to_zero()
    updates, state = tx.update({"a": torch.ones(2), "b": None}, tx.init(None))
    assert torch.equal(updates["a"], torch.zeros(2)) and updates["b"] is None
    assert state == fn.EmptyState()
