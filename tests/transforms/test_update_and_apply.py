"""``fn.update_and_apply``: the params updated in place, bit for bit ``tx.update`` then
``fn.apply_updates``; ``fn.adam``/``fn.adamw`` run their fused kernel on the params (``fn.adamw``:
bit for bit ``torch.optim.AdamW(fused=True)``, and the two calls wherever a step moves a param by
less than half of it)."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import fn
from fn.transforms import _adam_steps as adam_steps
from fn.transforms import adam_transform as adam_module

SIZES = [1000, 7, 300, 1, 129]
LR = 2**-7  # AdamW's: exact in fp32, as the state stores it, so torch.optim.AdamW sees it too


def _params(sizes, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return {f"p{i}": (torch.randn(n, generator=gen) * 0.5).to(dtype) for i, n in enumerate(sizes)}


def _grads(params, gen):
    return {k: (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype) for k, p in params.items()}


def _same(a, b):
    la = [x for x in pytree.tree_leaves(a) if isinstance(x, torch.Tensor)]
    lb = [x for x in pytree.tree_leaves(b) if isinstance(x, torch.Tensor)]
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))


def _run(tx, params, mode, steps=4, drop=None, adamw=None):
    """The pure loop and ``update_and_apply`` side by side (``drop``: a leaf without gradient);
    asserts bit-identical states and params after every step, the params written in place.
    ``adamw``: ``(lr, weight_decay)`` of an ``fn.adamw`` whose fused kernel runs: its fast step
    is ``torch.optim.AdamW(fused=True)``'s, so the params equal those bit for bit, and the pure
    loop's wherever every step so far moved a param by less than half of it."""
    gen = torch.Generator().manual_seed(1)
    pure_params = {k: p.clone() for k, p in params.items()}
    tensors = dict(params)
    pure_state, state, spare = tx.init(params), tx.init(params), tx.init(params)
    if adamw is not None:
        reference = {k: p.clone().requires_grad_(True) for k, p in params.items()}
        opt = torch.optim.AdamW(reference.values(), lr=adamw[0], weight_decay=adamw[1], fused=True)
        small = {k: torch.ones_like(p, dtype=torch.bool) for k, p in params.items()}
    for t in range(1, steps + 1):
        grads = _grads(params, gen)
        if drop is not None:
            grads[drop] = None
        old_params = pure_params
        pure_updates, pure_state = tx.update(dict(grads), pure_state, pure_params)
        pure_params = fn.apply_updates(pure_params, pure_updates)
        donated = {k: None if g is None else g.clone() for k, g in grads.items()}
        if mode == "in place":
            params, state = fn.update_and_apply(tx, donated, state, params)
        else:
            params, new_state = fn.update_and_apply(tx, donated, state, params, donate=spare)
            spare, state = state, new_state
        assert all(params[k] is tensors[k] for k in params), "params not updated in place"
        assert _same(state, pure_state), f"states differ at step {t}"
        if adamw is None:
            assert _same(params, pure_params), f"params differ at step {t}"
            continue
        for k, p in reference.items():
            p.grad = None if grads[k] is None else grads[k].clone()
        opt.step()
        assert _same(params, {k: p.detach() for k, p in reference.items()}), f"step {t}"
        for k, p in params.items():
            step = (pure_params[k] - old_params[k]).abs()
            small[k] &= step < old_params[k].abs() / 2
            assert torch.equal(p[small[k]], pure_params[k][small[k]]), f"{k} at step {t}"


@pytest.mark.parametrize("mode", ["in place", "spare"])
@pytest.mark.parametrize("implementation", ["auto", "fused", "foreach", "chain"])
@pytest.mark.parametrize(
    "make, adamw",
    [
        (lambda **kw: fn.adam(1e-2, **kw), None),
        (lambda **kw: fn.adam(1e-2, weight_decay=0.1, **kw), None),
        (lambda **kw: fn.adamw(LR, **kw), (LR, 1e-2)),
        # steps of more than half a param
        (lambda **kw: fn.adamw(0.5, weight_decay=0.9, **kw), (0.5, 0.9)),
    ],
    ids=["adam", "adam-l2", "adamw", "adamw-large-steps"],
)
def test_adam_family_equals_update_then_apply(make, adamw, implementation, mode):
    fused = implementation in ("auto", "fused")  # else the fast step is update + apply_updates
    _run(make(implementation=implementation), _params(SIZES), mode, adamw=adamw if fused else None)


@pytest.mark.parametrize("mode", ["in place", "spare"])
@pytest.mark.parametrize("implementation", ["auto", "fused", "foreach", "chain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "make, adamw",
    [
        (lambda **kw: fn.adam(LR, **kw), None),
        (lambda **kw: fn.adam(LR, weight_decay=0.1, **kw), None),
        (lambda **kw: fn.adamw(LR, **kw), (LR, 1e-2)),
    ],
    ids=["adam", "adam-l2", "adamw"],
)
def test_fast_step_over_shapes_dtypes_and_a_leaf_without_gradient(
    make, adamw, dtype, implementation, mode
):
    # matrices, a 0-dim leaf and a leaf without gradient: the fast step against the pure rule
    gen = torch.Generator().manual_seed(0)
    shapes = [(33, 17), (), (5,), (4, 3, 2), (1000,)]
    params = {
        f"p{i}": (torch.randn(s, generator=gen) * 0.5).to(dtype) for i, s in enumerate(shapes)
    }
    fused = implementation in ("auto", "fused")
    _run(
        make(implementation=implementation), params, mode, drop="p3", adamw=adamw if fused else None
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("mode", ["in place", "spare"])
def test_fused_pieces_equal_update_then_apply(monkeypatch, dtype, mode):
    # pieces of 64 elements and calls of 256: leaves cut across pieces and calls
    monkeypatch.setattr(adam_steps, "_PIECE", 64)
    monkeypatch.setattr(adam_steps, "_WORKSPACE", 256)
    params = _params([1000, 7, 300, 64, 129], dtype)
    _run(fn.adam(1e-2, implementation="fused"), params, mode)
    _run(fn.adamw(LR, implementation="fused"), params, mode, adamw=(LR, 1e-2))


def test_fused_kernel_writes_the_params(monkeypatch):
    # adam and adamw never materialize the updates: apply_updates is not called
    def refuse(*args, **kwargs):
        raise AssertionError("apply_updates called")

    monkeypatch.setattr(adam_module, "apply_updates", refuse)
    for tx, adamw in (
        (fn.adam(1e-2), None),
        (fn.adam(1e-2, weight_decay=0.1), None),
        (fn.adamw(LR), (LR, 1e-2)),
    ):
        _run(tx, _params(SIZES), "in place", steps=2, adamw=adamw)
        _run(tx, _params(SIZES, torch.bfloat16), "spare", steps=2, adamw=adamw)
        with torch.no_grad():  # a model's params, outside autograd
            leaves = {k: p.requires_grad_(True) for k, p in _params(SIZES).items()}
            _run(tx, leaves, "in place", steps=2, adamw=adamw)


def test_a_leaf_without_gradient_keeps_its_param_and_moments():
    _run(fn.adam(1e-2), _params(SIZES), "in place", drop="p1")
    _run(fn.adamw(LR), _params(SIZES), "spare", drop="p2", adamw=(LR, 1e-2))


@pytest.mark.parametrize(
    "make",
    [lambda: fn.sgd(0.1, momentum=0.9), lambda: fn.lamb(1e-2), lambda: fn.chain(fn.adam(0.1))],
    ids=["sgd", "lamb", "chain"],
)
def test_other_transforms_update_then_apply(make):
    _run(make(), _params(SIZES), "in place")
    _run(make(), _params(SIZES), "spare")


def test_schedule_and_step_keyword():
    tx = fn.adam(lambda count: 1e-2 / (1.0 + count))
    _run(tx, _params(SIZES), "in place")


def test_rejects_a_pure_call():
    tx = fn.adam(1e-2)
    params = _params(SIZES)
    state = tx.init(params)
    grads = _grads(params, torch.Generator().manual_seed(0))
    for donate in (None, False):
        with pytest.raises(ValueError, match="donate must be True or a donated state"):
            fn.update_and_apply(tx, grads, state, params, donate=donate)


def test_rejects_missing_params_and_params_that_need_grad():
    tx = fn.adam(1e-2)
    params = _params(SIZES)
    state = tx.init(params)
    grads = _grads(params, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="params are required"):
        fn.update_and_apply(tx, grads, state, None)
    leaf = {k: p.clone().requires_grad_(True) for k, p in params.items()}
    with pytest.raises(ValueError, match="requires grad"):
        fn.update_and_apply(tx, grads, state, leaf)
    with torch.no_grad():
        fn.update_and_apply(tx, grads, state, leaf)


def test_rejects_params_sharing_memory_with_updates_or_state():
    tx = fn.adam(1e-2)
    params = _params(SIZES)
    state = tx.init(params)
    before = {k: p.clone() for k, p in params.items()}
    with pytest.raises(ValueError, match="share memory"):
        fn.update_and_apply(tx, dict(params), state, params)
    with pytest.raises(ValueError, match="share memory"):
        fn.update_and_apply(tx, _grads(params, torch.Generator()), state, state[1].mu)
    assert _same(params, before)


def test_a_donated_state_without_tensors_allocates_the_new_moments():
    tx = fn.adam(1e-2)
    params = _params(SIZES)
    pure_params = {k: p.clone() for k, p in params.items()}
    state = tx.init(params)
    grads = _grads(params, torch.Generator().manual_seed(0))
    updates, pure_state = tx.update(dict(grads), state, pure_params)
    pure_params = fn.apply_updates(pure_params, updates)
    params, new_state = fn.update_and_apply(tx, dict(grads), state, params, donate=(None,) * 3)
    assert _same(params, pure_params) and _same(new_state, pure_state)
    assert new_state[1].mu["p0"] is not state[1].mu["p0"]
