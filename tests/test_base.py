"""The functional core: identity, chain, apply_updates, hyperparameters, staged."""

from __future__ import annotations

import pytest
import torch

import fn


def test_identity():
    tx = fn.identity()
    u = {"a": torch.ones(2), "b": None}
    out, state = tx.update(u, tx.init(u), step=3, anything="ignored")
    assert out is u and state == fn.EmptyState()


def test_chain_state_structure_and_order():
    params = {"w": torch.ones(2)}
    tx = fn.chain(fn.scale_by_adam(), fn.add_decayed_weights(0.1), fn.scale_by_learning_rate(0.5))
    state = tx.init(params)
    assert isinstance(state, tuple) and len(state) == 3
    assert isinstance(state[0], fn.ScaleByAdamState)
    assert state[1] == fn.EmptyState()
    assert isinstance(state[2], fn.ScaleByLearningRateState)
    grads = {"w": torch.tensor([2.0, -3.0])}
    updates, new_state = tx.update(grads, state, params, step=1)
    # adam's first direction is sign(g); then + 0.1 p; then * -0.5.
    torch.testing.assert_close(updates["w"], -0.5 * (torch.sign(grads["w"]) + 0.1))
    assert int(new_state[0].count) == 1 and int(new_state[2].count) == 1


def test_chain_rejects_a_wrong_state():
    tx = fn.chain(fn.identity(), fn.identity())
    with pytest.raises(ValueError, match="2 transforms"):
        tx.update({"w": torch.ones(1)}, (fn.EmptyState(),))


def _recording(seen, name):
    """A stateless member without ``**extra`` that records the extras it gets (``step``)."""

    def update(updates, state, params=None, step=None):
        seen.append((name, step))
        return updates, state

    return fn.GradientTransformation(lambda params: fn.EmptyState(), update)


def test_chain_passes_extras_only_to_members_that_take_them():
    seen = []

    def bare_update(updates, state, params=None):
        seen.append(("bare", None))
        return fn.tree.tree_scale(updates, 2.0), state

    def everything(updates, state, params=None, **extra):
        seen.append(("kwargs", extra))
        return updates, state

    tx = fn.chain(
        fn.GradientTransformation(lambda params: fn.EmptyState(), bare_update),
        _recording(seen, "step"),
        fn.GradientTransformation(lambda params: fn.EmptyState(), everything),
        fn.scale_by_learning_rate(0.5),
    )
    params = {"w": torch.ones(2)}
    updates, state = tx.update({"w": torch.ones(2)}, tx.init(params), params, step=3, tag="x")
    assert seen == [("bare", None), ("step", 3), ("kwargs", {"step": 3, "tag": "x"})]
    assert torch.equal(updates["w"], torch.full((2,), -1.0))
    assert int(state[3].count) == 1


def test_chain_reads_member_signatures_once(monkeypatch):
    seen = []
    tx = fn.chain(_recording(seen, "a"), _recording(seen, "b"))
    state = tx.init(None)

    def no_more_reads(*args, **kwargs):
        raise AssertionError("the signature was read again")

    monkeypatch.setattr("inspect.signature", no_more_reads)
    for t in (1, 2):
        tx.update({"w": torch.ones(1)}, state, step=t)
    assert seen == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]


def test_chain_forwards_everything_to_a_member_without_a_readable_signature():
    class Update:
        __signature__ = "unreadable"

        def __call__(self, updates, state, params=None, **extra):
            return {"extra": extra}, state

    tx = fn.chain(fn.GradientTransformation(lambda params: fn.EmptyState(), Update()))
    updates, _ = tx.update({"w": torch.ones(1)}, tx.init(None), step=2)
    assert updates == {"extra": {"step": 2}}


def test_stateless_gets_whole_trees_and_ignores_extras():
    calls = []

    def f(updates, params):
        calls.append(params)
        return fn.tree.tree_scale(updates, -1.0)

    tx = fn.stateless(f)
    state = tx.init({"w": torch.ones(2)})
    assert state == fn.EmptyState()
    params = {"w": torch.ones(2)}
    updates, new_state = tx.update({"w": torch.tensor([1.0, 2.0])}, state, params, step=1)
    assert torch.equal(updates["w"], torch.tensor([-1.0, -2.0])) and new_state is state
    tx.update({"w": torch.ones(2)}, state)
    assert calls == [params, None]


def test_stateless_with_tree_map_maps_leaves_and_passes_none_through():
    seen = []

    def f(u, p):
        seen.append(p)
        return u if p is None else u + p

    tx = fn.stateless_with_tree_map(f)
    grads = {"w": torch.ones(2), "frozen": None}
    params = {"w": torch.full((2,), 3.0), "frozen": torch.ones(1)}
    updates, state = tx.update(grads, tx.init(params), params)
    assert torch.equal(updates["w"], torch.full((2,), 4.0)) and updates["frozen"] is None
    assert state == fn.EmptyState() and len(seen) == 1
    updates, _ = tx.update(grads, state)
    assert torch.equal(updates["w"], grads["w"]) and seen[-1] is None


def test_apply_updates_casts_back_and_skips_none():
    params = {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(2), "frozen": torch.ones(1)}
    updates = {"w": torch.full((3,), 0.5), "b": torch.full((2,), 0.25), "frozen": None}
    new = fn.apply_updates(params, updates)
    assert new["w"].dtype == torch.bfloat16 and torch.equal(new["w"].float(), torch.full((3,), 1.5))
    assert torch.equal(new["b"], torch.full((2,), 1.25))
    assert new["frozen"] is params["frozen"]
    assert torch.equal(params["w"].float(), torch.ones(3))  # inputs untouched


def test_set_and_get_hyperparams():
    tx = fn.chain(fn.adam(lr=1e-3), fn.scale_by_learning_rate(2.0))
    state = tx.init({"w": torch.ones(2)})
    assert float(fn.get_hyperparam(state, "lr")) == pytest.approx(1e-3)
    new = fn.set_hyperparams(state, lr=0.25)
    # every field named lr is set, and the old state is unchanged
    lrs = [s.lr for s in (new[0][2], new[1])]
    assert all(float(x) == 0.25 and x.dtype == torch.float32 and x.shape == () for x in lrs)
    assert float(state[0][2].lr) == pytest.approx(1e-3)
    for bad in (-0.1, float("nan"), float("inf"), "0.1"):  # refused as the constructors do
        with pytest.raises(ValueError, match="set_hyperparams: lr must be"):
            fn.set_hyperparams(state, lr=bad)
    with pytest.raises(KeyError, match="momentum"):
        fn.set_hyperparams(state, momentum=0.5)
    with pytest.raises(KeyError, match="betas"):
        fn.get_hyperparam(state, "betas")


def two_phase_optimizer():
    """Warmup: SGD(lr=0.1); compressed: twice that; compressed from the 3rd update on."""
    inner = fn.sgd(0.1)

    def compressed_update(grads, state, params=None, **extra):
        updates, state = inner.update(grads, state, params, **extra)
        return fn.tree.tree_scale(updates, 2.0), state

    return fn.CompressedOptimizer(
        init=inner.init,
        warmup_update=inner.update,
        compressed_update=compressed_update,
        is_compressed=lambda t: t >= 3,
    )


@pytest.mark.parametrize("pass_step", [False, True])
def test_staged_picks_the_phase(pass_step):
    tx = fn.staged(two_phase_optimizer())
    grads = {"w": torch.ones(2)}
    state = tx.init(grads)
    assert isinstance(state, fn.StagedState) and int(state.count) == 0
    for t in range(1, 6):
        extra = {"step": t} if pass_step else {}
        updates, state = tx.update(grads, state, None, **extra)
        expected = -0.2 if t >= 3 else -0.1
        torch.testing.assert_close(updates["w"], torch.full((2,), expected))
        assert int(state.count) == t


def test_staged_explicit_step_wins_over_the_counter():
    tx = fn.staged(two_phase_optimizer())
    grads = {"w": torch.ones(1)}
    updates, _ = tx.update(grads, tx.init(grads), step=7)
    torch.testing.assert_close(updates["w"], torch.full((1,), -0.2))


@pytest.mark.parametrize("step", [0, -1, 1.0, True, "3"])
def test_compressed_update_rejects_bad_steps(step):
    opt = two_phase_optimizer()
    grads = {"w": torch.ones(1)}
    with pytest.raises(ValueError, match="step"):
        opt.update(grads, opt.init(grads), step=step)


def test_compressed_update_rejects_tensor_steps():
    opt = two_phase_optimizer()
    grads = {"w": torch.ones(1)}
    with pytest.raises(TypeError, match="Python int"):
        opt.update(grads, opt.init(grads), step=torch.tensor(3))
