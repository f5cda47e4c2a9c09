"""fn.tree: None leaves, multi-tree maps, reductions."""

from __future__ import annotations

import math

import pytest
import torch

from fn import tree


def make():
    return {"a": torch.tensor([3.0, 4.0]), "b": None, "c": [torch.ones(2, 2), torch.zeros(0)]}


def test_flatten_keeps_none_leaves():
    leaves, spec = tree.tree_flatten(make())
    assert len(leaves) == 4 and leaves[1] is None
    assert tree.tree_unflatten(leaves, spec)["b"] is None
    assert len(tree.tree_leaves(make())) == 3
    assert len(tree.tree_leaves(make(), keep_none=True)) == 4


def test_tree_map_takes_the_first_trees_structure():
    calls = []

    def f(x, y):
        calls.append(1)
        return x + y

    out = tree.tree_map(f, make(), make())
    assert out["b"] is None and len(calls) == 3
    assert torch.equal(out["a"], torch.tensor([6.0, 8.0]))
    # the other tree may hold anything (None included) where the first has None
    other = {"a": torch.ones(2), "b": torch.ones(7), "c": [None, None]}
    out = tree.tree_map(lambda x, y: x if y is None else x * y, make(), other)
    assert torch.equal(out["c"][0], torch.ones(2, 2)) and out["b"] is None
    with pytest.raises(ValueError):
        tree.tree_map(torch.add, make(), {"a": torch.ones(2)})


def test_like_and_cast():
    z = tree.tree_zeros_like(make(), dtype=torch.float64)
    assert z["a"].dtype == torch.float64 and z["b"] is None and z["c"][1].shape == (0,)
    f = tree.tree_full_like(make(), 2.5)
    assert torch.equal(f["c"][0], torch.full((2, 2), 2.5))
    mixed = {"x": torch.ones(2), "i": torch.ones(2, dtype=torch.int64)}
    cast = tree.tree_cast(mixed, torch.bfloat16)
    assert cast["x"].dtype == torch.bfloat16 and cast["i"].dtype == torch.int64
    assert tree.tree_cast(mixed, None) is mixed


def test_arithmetic():
    a, b = make(), tree.tree_full_like(make(), 1.0)
    assert torch.equal(tree.tree_add(a, b)["a"], torch.tensor([4.0, 5.0]))
    assert torch.equal(tree.tree_sub(a, b)["a"], torch.tensor([2.0, 3.0]))
    assert torch.equal(tree.tree_scale(a, 0.5)["a"], torch.tensor([1.5, 2.0]))
    assert tree.tree_add(a, b)["b"] is None


def test_norms_and_counts():
    t = make()
    # 3^2 + 4^2 + 4 * 1^2 = 29
    assert float(tree.tree_sum_of_squares(t)) == pytest.approx(29.0)
    assert float(tree.tree_l2_norm(t)) == pytest.approx(math.sqrt(29.0))
    assert float(tree.tree_vdot(t, tree.tree_full_like(t, 2.0))) == pytest.approx(2 * (7 + 4))
    assert tree.tree_numel(t) == 6
    half = {"h": torch.tensor([3.0, 4.0], dtype=torch.float16)}
    norm = tree.tree_l2_norm(half)
    assert norm.dtype == torch.float32 and float(norm) == 5.0
    assert float(tree.tree_l2_norm({"x": None})) == 0.0
    # complex leaves count their imaginary parts (x.float() dropped them: 0.0 here)
    assert float(tree.tree_l2_norm({"z": torch.tensor([3j, 4.0 + 0j])})) == 5.0
    a, b = {"z": torch.tensor([1 + 2j])}, {"z": torch.tensor([3 + 4j])}
    assert float(tree.tree_vdot(a, b)) == 11.0  # Re(conj(1 + 2j) (3 + 4j))


def test_all_finite():
    assert bool(tree.tree_all_finite(make()))
    bad = make()
    bad["c"][0] = torch.tensor([1.0, float("nan")])
    assert not bool(tree.tree_all_finite(bad))
    assert not bool(tree.tree_all_finite({"x": torch.tensor([float("inf")])}))
    assert bool(tree.tree_all_finite({}))


def test_live_leaves_skips_none_updates_and_rebuilds_with_the_state():
    grads = {"a": torch.ones(2), "b": None, "c": [torch.ones(2, 2), torch.zeros(0)]}
    state = tree.tree_zeros_like(make())
    state["b"] = torch.full((3,), 7.0)  # kept: "b" has no update
    checked = []
    walk = tree.live_leaves(grads, state, None, check=lambda *args: checked.append(args))
    assert walk.live == [0, 2, 3] and walk.leaves[2] == [None] * 4
    assert [i for i, _, _ in checked] == walk.live
    assert all(u is grads["a"] and like is state["a"] for i, u, like in checked if i == 0)
    assert walk.at_live(1)[0] is state["a"]
    new = walk.rebuild([g + 1 for g in walk.at_live(0)], fill=1)
    assert new["b"] is state["b"] and torch.equal(new["a"], torch.full((2,), 2.0))
    assert walk.rebuild([None, None, None])["b"] is None


def test_live_leaves_takes_the_given_structure_and_raises_from_check():
    state = {"w": torch.zeros(2), "frozen": None}
    grads = {"w": torch.ones(2), "frozen": {"x": torch.ones(1)}}  # a subtree where state is None
    walk = tree.live_leaves(grads, state, structure=state)
    assert walk.live == [0, 1] and walk.leaves[1][1] is None

    def check(i, g, s):
        if s is None:
            raise ValueError(f"leaf {i} has no state")

    with pytest.raises(ValueError, match="leaf 1 has no state"):
        tree.live_leaves(grads, state, structure=state, check=check)
