"""None gradients (unused params) pass through every optimizer; their state stays unchanged."""

from __future__ import annotations

import pytest
import torch

import fn

OPTIMIZERS = {
    "adam": lambda: fn.adam(lr=0.1, weight_decay=0.1),
    "adamw": lambda: fn.adamw(lr=0.1),
    "sgd": lambda: fn.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "sgd-dampening": lambda: fn.sgd(0.1, momentum=0.9, dampening=0.5),
    "lamb": lambda: fn.lamb(lr=0.1, weight_decay=0.1),
    "masked": lambda: fn.masked(fn.adam(lr=0.1), {"used": True, "unused": True}),
    "schedule": lambda: fn.sgd(lambda c: 0.1 / (c + 1).float()),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_none_grads_pass_through(name):
    tx = OPTIMIZERS[name]()
    params = {"used": torch.randn(3, 2), "unused": torch.randn(4)}
    state = tx.init(params)
    for step in range(3):
        # "unused" has a gradient only at the first step.
        grads = {"used": torch.randn(3, 2), "unused": torch.randn(4) if step == 0 else None}
        before = fn.tree.tree_leaves(state)
        updates, state = tx.update(grads, state, params)
        assert updates["unused"] is None or step == 0
        new = fn.apply_updates(params, updates)
        if step > 0:
            assert torch.equal(new["unused"], params["unused"])
            # every state leaf shaped like "unused" is unchanged
            for old, cur in zip(before, fn.tree.tree_leaves(state), strict=True):
                if cur.shape == (4,):
                    assert torch.equal(old, cur)
        assert bool(fn.tree.tree_all_finite(new))
        assert not torch.equal(new["used"], params["used"])
        params = new
