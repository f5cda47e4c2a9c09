"""Buffer donation (``update(..., donate=...)``, ``apply_updates(..., donate=True)``): bit for
bit the pure results, written into the donated tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

import fn
from fn.collectives import Local
from fn.transforms import _adam_steps as adam_steps
from tests._mirror import Mirror


def _params(sizes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {f"p{i}": (torch.randn(n, generator=gen) * 0.5).to(dtype) for i, n in enumerate(sizes)}


def _grads(params, gen):
    return {k: (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype) for k, p in params.items()}


def _leaves(tree):
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _same(a, b):
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))


def _run(tx, params, mode, steps=4, reuses_from=1, **kwargs):
    """Steps the pure and the donating loop side by side; asserts bit-identical updates, states
    and params after every step, and that the donated buffers took the results (from step
    ``reuses_from`` on)."""
    gen = torch.Generator().manual_seed(1)
    pure_params = {k: p.clone() for k, p in params.items()}
    pure_state, state = tx.init(params), tx.init(params)
    spare = tx.init(params)
    for t in range(1, steps + 1):
        grads = _grads(params, gen)
        pure_updates, pure_state = tx.update(dict(grads), pure_state, pure_params, **kwargs)
        pure_params = fn.apply_updates(pure_params, pure_updates)
        donated_grads = {k: g.clone() for k, g in grads.items()}
        before = {id(x) for x in _leaves((donated_grads, state if mode == "in place" else spare))}
        if mode == "in place":
            updates, new_state = tx.update(donated_grads, state, params, donate=True, **kwargs)
        else:
            updates, new_state = tx.update(donated_grads, state, params, donate=spare, **kwargs)
            spare = state
        state = new_state
        assert _same(updates, pure_updates), f"updates differ at step {t}"
        assert _same(state, pure_state), f"states differ at step {t}"
        big = [x for x in _leaves((updates, state)) if x.numel() > 1]
        reuses = t >= reuses_from and (t > 1 or mode == "in place")
        assert not reuses or any(id(x) in before for x in big)
        params = fn.apply_updates(params, updates, donate=True)
        assert _same(params, pure_params), f"params differ at step {t}"
    return state


SIZES = [1000, 7, 300, 1]


@pytest.mark.parametrize("mode", ["in place", "spare"])
@pytest.mark.parametrize("implementation", ["auto", "foreach", "chain"])
@pytest.mark.parametrize("make", [fn.adam, fn.adamw])
def test_adam_donated_is_bit_identical(make, implementation, mode):
    tx = make(lr=1e-2, implementation=implementation)
    _run(tx, _params(SIZES), mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fused_adam_in_pieces_is_bit_identical(monkeypatch, dtype):
    # pieces of 64 elements and calls of 256: leaves cut across pieces and calls
    monkeypatch.setattr(adam_steps, "_PIECE", 64)
    monkeypatch.setattr(adam_steps, "_WORKSPACE", 256)
    for make in (fn.adam, fn.adamw):
        _run(
            make(lr=1e-2, implementation="fused"), _params([1000, 7, 300, 64, 129], dtype), "spare"
        )
        _run(make(lr=1e-2, implementation="fused"), _params([257, 3], dtype), "in place")


def test_fused_adam_leaf_larger_than_a_piece():
    _run(fn.adam(lr=1e-3), _params([adam_steps._PIECE * 2 + 37]), "spare", steps=3)


def test_adam_in_place_keeps_the_state_tensors():
    params = _params(SIZES)
    tx = fn.adam(lr=1e-2, weight_decay=0.1)
    state = tx.init(params)
    mu, nu = state[1].mu["p0"], state[1].nu["p0"]
    grads = _grads(params, torch.Generator().manual_seed(0))
    g = grads["p0"]
    updates, state = tx.update(grads, state, params, donate=True)
    assert state[1].mu["p0"] is mu and state[1].nu["p0"] is nu and updates["p0"] is g


@pytest.mark.parametrize("mode", ["in place", "spare"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: fn.sgd(0.1, momentum=0.9),
        lambda: fn.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda: fn.sgd(0.1, momentum=0.9, dampening=0.3),
        lambda: fn.lamb(lr=1e-2, weight_decay=0.01),
        lambda: fn.chain(fn.stateless(lambda u, p: fn.tree.tree_scale(u, 0.5)), fn.adam(0.1)),
        lambda: fn.masked(fn.adam(0.1), {"p0": True, "p1": False, "p2": True, "p3": False}),
        lambda: fn.chain(fn.adam(0.1), fn.masked(fn.trace(0.5), lambda p: {k: True for k in p})),
    ],
    ids=["sgd", "nesterov-decay", "dampening", "lamb", "chain", "masked", "masked-in-chain"],
)
def test_donated_transforms_are_bit_identical(make, mode):
    _run(make(), _params(SIZES), mode)


def test_none_updates_keep_their_state():
    params = _params(SIZES)
    tx = fn.adam(lr=1e-2)
    state = tx.init(params)
    frozen = state[1].mu["p1"]
    grads = dict(_grads(params, torch.Generator().manual_seed(0)), p1=None)
    updates, state = tx.update(grads, state, params, donate=True)
    assert updates["p1"] is None and state[1].mu["p1"] is frozen


def test_staged_compressed_optimizer_takes_donate():
    """One worker's compressed updates are pure (nothing is exchanged, no error buffers exist):
    donation is accepted, and in place the frozen variance comes back as the same tensor."""
    tx = fn.staged(fn.onebit_adam(lr=1e-2, freeze_step=2, comm=Local()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the unsafe-variance warning
        _run(tx, _params([64, 5]), "in place", steps=4, reuses_from=2)


def test_chain_stops_donating_once_updates_hold_state():
    """A pure member returning its state as the update: the next members must not write it."""

    def init(params):
        return {"kept": fn.tree.tree_zeros_like(params)}

    def update(updates, state, params=None):
        kept = fn.tree.tree_map(torch.clone, updates)
        return kept, {"kept": kept}  # the update IS the state

    tx = fn.chain(fn.GradientTransformation(init, update), fn.scale_by_learning_rate(0.5))
    params = {"w": torch.ones(3)}
    updates, state = tx.update({"w": torch.ones(3)}, tx.init(params), params, donate=True)
    assert torch.equal(state[0]["kept"]["w"], torch.ones(3))
    assert torch.equal(updates["w"], torch.full((3,), -0.5))


def test_chain_rejects_a_donated_state_of_another_length():
    tx = fn.chain(fn.identity(), fn.scale_by_learning_rate(0.1))
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="donate must be a state of 2 entries"):
        tx.update(params, tx.init(params), params, donate=(fn.EmptyState(),))


def test_a_donated_leaf_that_does_not_fit_is_not_written():
    params = {"w": torch.ones(4)}
    tx = fn.adam(lr=0.1)
    state = tx.init(params)
    wrong = tx.init({"w": torch.ones(3)})  # other shapes: allocate instead
    pure, _ = tx.update({"w": torch.ones(4)}, state, params)
    updates, _ = tx.update({"w": torch.ones(4)}, state, params, donate=wrong)
    assert torch.equal(updates["w"], pure["w"])
    assert torch.equal(wrong[1].mu["w"], torch.zeros(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_updates_donated(dtype):
    params = {"w": torch.randn(5).to(dtype), "b": torch.ones(2, dtype=dtype), "f": torch.ones(1)}
    updates = {"w": torch.randn(5) * 1e-2, "b": torch.ones(2, dtype=dtype) * 0.25, "f": None}
    pure = fn.apply_updates(params, updates)
    w = params["w"]
    new = fn.apply_updates(params, updates, donate=True)
    assert new["w"] is w and new["w"].dtype == dtype
    assert all(torch.equal(pure[k], new[k]) for k in pure)


def test_pure_by_default():
    params = _params(SIZES)
    tx = fn.adam(lr=1e-2)
    state = tx.init(params)
    grads = _grads(params, torch.Generator().manual_seed(0))
    copies = [x.clone() for x in _leaves((state, grads, params))]
    tx.update(grads, state, params)
    assert all(
        torch.equal(a, b) for a, b in zip(copies, _leaves((state, grads, params)), strict=True)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: fn.adam(0.1, implementation="chain", weight_decay=0.1),
        lambda: fn.sgd(0.1, momentum=0.9, dampening=0.2),
        lambda: fn.lamb(0.1, weight_decay=0.1),
    ],
    ids=["adam", "sgd", "lamb"],
)
def test_donate_under_vmap_computes_the_pure_result(make):
    """Batched tensors cannot take results in place: donation falls back to the pure ops."""
    tx = make()
    params = {"w": torch.ones(3)}
    state = tx.init(params)
    grads = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))

    def step(g, donate):
        return tx.update({"w": g}, state, params, donate=donate)

    pure = torch.func.vmap(lambda g: step(g, None))(grads)
    donated = torch.func.vmap(lambda g: step(g, True))(grads)
    assert _same(pure, donated)


PURE_IF_NOT_DONATING = {
    "adam": lambda: fn.adam(0.1, weight_decay=0.1),
    "sgd": lambda: fn.sgd(0.1, momentum=0.9),
    "lamb": lambda: fn.lamb(0.1, weight_decay=0.1),
    "scale_by_learning_rate": lambda: fn.scale_by_learning_rate(0.1),
    "add_decayed_weights": lambda: fn.add_decayed_weights(0.1),
    "scale_by_trust_ratio": lambda: fn.scale_by_trust_ratio(),
    "masked": lambda: fn.masked(fn.scale_by_learning_rate(0.1), lambda p: {k: True for k in p}),
    "onebit_adam": lambda: fn.onebit_adam(0.1, freeze_step=2, comm=Local()),
    "onebit_allreduce": lambda: fn.collectives.onebit_allreduce(comm=Local()),
    "quantized_allreduce": lambda: fn.collectives.quantized_allreduce(comm=Mirror()),
    "loco_allreduce": lambda: fn.collectives.loco_allreduce(comm=Mirror()),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 1-bit Adam's unsafe-variance warning
@pytest.mark.parametrize("donate", [None, False])
@pytest.mark.parametrize("name", list(PURE_IF_NOT_DONATING))
def test_donate_false_is_pure_like_none(name, donate):
    """``donate=False`` (as ``apply_updates``' default) donates nothing."""
    tx = PURE_IF_NOT_DONATING[name]()
    params = _params([6, 3])
    gen = torch.Generator().manual_seed(0)
    state = tx.init(params)
    extra = {"step": 3} if isinstance(tx, fn.CompressedOptimizer) else {}
    if extra:
        for t in (1, 2):
            _, state = tx.update(_grads(params, gen), state, params, step=t)
    grads = _grads(params, gen)
    copies = [x.clone() for x in _leaves((state, grads, params))]
    tx.update(grads, state, params, donate=donate, **extra)
    assert all(
        torch.equal(a, b) for a, b in zip(copies, _leaves((state, grads, params)), strict=True)
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: fn.adamw(0.1),
        lambda: fn.trace(0.9),
        lambda: fn.masked(fn.adam(0.1), lambda p: {k: True for k in p}),
        lambda: fn.staged(fn.onebit_adam(0.1, freeze_step=2, comm=Local())),
        lambda: fn.collectives.onebit_allreduce(comm=Local()),
        lambda: fn.collectives.loco_allreduce(comm=Local()),
    ],
    ids=["adamw", "trace", "masked", "staged", "onebit_allreduce", "loco_allreduce"],
)
def test_a_donated_state_of_another_structure_is_a_clear_error(make):
    tx = make()
    params = _params([6, 3])
    state = tx.init(params)
    other = tx.init({"only": torch.ones(6)})
    grads = _grads(params, torch.Generator().manual_seed(0))
    copies = [x.clone() for x in _leaves((state, grads, other))]
    with pytest.raises(ValueError, match="donate must be .* a state of the same structure"):
        tx.update(grads, state, params, donate=other)
    assert all(
        torch.equal(a, b) for a, b in zip(copies, _leaves((state, grads, other)), strict=True)
    )


@pytest.mark.parametrize("mode", ["in place", "spare"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: fn.adam(1e-2, weight_decay=0.01),
        lambda: fn.adamw(1e-2, implementation="foreach"),
        lambda: fn.sgd(0.1, momentum=0.9, nesterov=True),
        lambda: fn.lamb(1e-2, weight_decay=0.01),
    ],
    ids=["adam", "adamw-foreach", "nesterov", "lamb"],
)
def test_donated_bf16_zero_size_and_zero_dim_leaves_are_bit_identical(make, mode):
    gen = torch.Generator().manual_seed(0)
    params = {
        "bf16": torch.randn(33, generator=gen).bfloat16(),
        "scalar": torch.tensor(0.5),
        "empty": torch.zeros(0),
        "matrix": torch.randn(4, 3, generator=gen),
    }
    _run(make(), params, mode, steps=3)
