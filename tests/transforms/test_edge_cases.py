"""Edge cases for every optimizer: None gradients (unused params) pass through and keep their
state; empty leaves; low-precision params; the non-finite policy."""

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


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("params", [{"used": torch.ones(3, 2), "unused": torch.ones(4)}, {}])
def test_a_step_without_any_gradient_keeps_the_moments(name, params):
    """Every gradient ``None`` (all params frozen for a step), or no leaf at all: the foreach
    ops take no empty list, so the eager path must not reach them; it answers as the per-leaf
    path does."""
    if name == "masked" and not params:
        pytest.skip("its mask names two leaves")
    tx = OPTIMIZERS[name]()
    state = tx.init(params)
    grads = dict.fromkeys(params)
    updates, new = tx.update(grads, state, params)
    assert updates == grads
    reference_updates, reference = fn.tree.per_leaf(tx.update, grads, state, params)
    assert reference_updates == grads
    for before, now, ref in zip(*map(fn.tree.tree_leaves, (state, new, reference)), strict=True):
        assert torch.equal(now, ref)
        if now.dim():  # the moments; the counters advance as the per-leaf path's do
            assert torch.equal(now, before)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_empty_leaves(name):
    tx = OPTIMIZERS[name]()
    params = {"used": torch.randn(3, 2), "unused": torch.zeros(0)}
    grads = {"used": torch.randn(3, 2), "unused": torch.zeros(0)}
    updates, state = tx.update(grads, tx.init(params), params)
    assert updates["unused"].shape == (0,)
    assert bool(fn.tree.tree_all_finite(updates)) and bool(fn.tree.tree_all_finite(state))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bf16_params(name):
    tx = OPTIMIZERS[name]()
    params = {"used": torch.randn(3, 2).bfloat16(), "unused": torch.randn(4).bfloat16()}
    grads = fn.tree.tree_map(torch.randn_like, params)
    updates, state = tx.update(grads, tx.init(params), params)
    new = fn.apply_updates(params, updates)
    assert all(u.dtype == torch.bfloat16 for u in fn.tree.tree_leaves(updates))
    assert all(p.dtype == torch.bfloat16 for p in fn.tree.tree_leaves(new))
    assert fn.get_hyperparam(state, "lr").dtype == torch.float32


def test_non_finite_gradients_propagate_and_leave_the_old_state_intact():
    # Documented policy: like torch.optim, a NaN gradient reaches the new state; the old state
    # is never modified, so a caller can drop the step (checking fn.tree.tree_all_finite).
    tx = fn.adam(lr=0.1)
    params = {"w": torch.ones(2)}
    state = tx.init(params)
    state_copy = fn.tree.tree_map(torch.clone, state)
    grads = {"w": torch.tensor([float("nan"), 1.0])}
    assert not bool(fn.tree.tree_all_finite(grads))
    updates, new_state = tx.update(grads, state, params)
    assert torch.isnan(updates["w"][0]) and torch.isnan(new_state[1].mu["w"][0])
    for old, kept in zip(fn.tree.tree_leaves(state), fn.tree.tree_leaves(state_copy), strict=True):
        assert torch.equal(old, kept)


@pytest.mark.parametrize(
    "make",
    [
        lambda: fn.adam(0.1),
        lambda: fn.adamw(0.1),
        lambda: fn.lamb(0.1),
        lambda: fn.onebit_adam(0.1, freeze_step=2, comm=fn.collectives.Local()),
        lambda: fn.zero_one_adam(0.1, comm=fn.collectives.Local()),
        lambda: fn.onebit_lamb(0.1, freeze_step=2, comm=fn.collectives.Local()),
    ],
)
def test_complex_params_are_refused_where_the_rule_reads_real_values(make):
    """Adam's ``g * g`` of a complex ``g`` is no ``|g|^2``: the trajectory differed from
    ``torch.optim.Adam``'s (which takes the real and imaginary parts as reals) with no error."""
    with pytest.raises(TypeError, match="complex params are not supported"):
        make().init({"w": torch.ones(2, dtype=torch.complex64), "b": torch.ones(1)})


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_gradients_of_another_dtype_are_taken_in_the_params_dtype(name, dtype):
    """A bf16 gradient on fp32 params: Adam and LAMB read it in their moments' dtype, as if cast
    first (they raised torch.lerp's "expected dtype float for 'end'"); every optimizer keeps its
    state in the params' dtype. (SGD's update, and an L2 decay added to the gradient, follow
    torch's type promotion.)"""
    params = {"used": torch.randn(3, 2), "unused": torch.randn(4)}
    grads = {"used": torch.randn(3, 2).to(dtype), "unused": None}
    cast = {"used": grads["used"].float(), "unused": None}
    tx = OPTIMIZERS[name]()
    updates, state = tx.update(grads, tx.init(params), params)
    want_updates, want_state = tx.update(cast, tx.init(params), params)
    for a, b in zip(*map(fn.tree.tree_leaves, (state, want_state)), strict=True):
        assert a.dtype == b.dtype
    if name in ("adamw", "lamb", "masked"):
        for got, want in ((updates, want_updates), (state, want_state)):
            for a, b in zip(*map(fn.tree.tree_leaves, (got, want)), strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
