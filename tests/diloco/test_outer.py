"""The outer rules and the outer step: DiLoCo's Nesterov SGD and SparseLoCo against the plain
loop over workers of _reference.py, bit for bit; torch.optim.SGD; the skip of a step that no
worker takes part in, on every rank with nothing changed."""

from __future__ import annotations

import functools

import pytest
import torch

import fn
import fn.diloco
from fn.collectives import Local, Simulated, error_feedback_leaves, replicate, simulate
from fn.tree import tree_leaves
from tests.diloco import _cases, _reference
from tests.diloco._cases import KINDS, outer_rule

W = 3


def _workers(anchor: torch.Tensor, steps: int, seed: int) -> list[torch.Tensor]:
    return _cases.drifts(tuple(anchor.shape), W, steps, seed)


def _run(outer, comm, anchor, moves):
    """Outer steps under ``Simulated``: before step ``s`` each rank's params are the current
    anchor plus its drift ``moves[s][r]``. Returns the anchors after each step (every rank's)
    and the last state."""
    anchors = replicate({"w": anchor}, comm)
    state = simulate(outer.init, comm)(anchors)
    step = simulate(lambda a, p, s: fn.diloco.outer_step(outer, a, p, s, comm=comm), comm)
    out = []
    for move in moves:
        result = step(anchors, {"w": anchors["w"] + move}, state)
        assert bool(result.applied.all())
        anchors, state = result.anchor, result.state
        out.append(anchors["w"])
    return out, state


def test_nesterov_is_diloco_with_the_plain_mean_bit_for_bit():
    comm = Simulated(W)
    anchor = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    drifts = _workers(anchor, steps=4, seed=1)
    outer = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=comm))
    got, _ = _run(outer, comm, anchor, drifts)
    # the reference sees the same params: the anchor it reaches plus the same drifts
    expected, current = [], anchor
    b = torch.zeros_like(anchor)
    for drift in drifts:
        params = [current + drift[r] for r in range(W)]
        mean = _reference.cast_mean([current - p for p in params], torch.float32)
        b = b * 0.9 + mean
        current = current + torch.add(mean, b, alpha=0.9) * torch.tensor(-0.7)
        expected.append(current)
    for s, (g, e) in enumerate(zip(got, expected, strict=True)):
        for r in range(W):
            assert torch.equal(g[r], e), (s, r)


def test_nesterov_steps_the_anchor_as_torch_optim_sgd_does():
    """torch.optim.SGD(nesterov=True) on the anchor with the mean pseudo-gradient as its
    gradient: the same up to its fused ``p - lr u`` (one rounding where fn adds ``-lr u``)."""
    anchor = torch.randn(50, generator=torch.Generator().manual_seed(2))
    workers = [[anchor + d for d in drift] for drift in _workers(anchor, steps=5, seed=3)]
    param = anchor.clone()
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    outer = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=Local()))
    ours, state = {"w": anchor.clone()}, outer.init({"w": anchor})
    for params in workers:
        mean = _reference.cast_mean([param - p for p in params], torch.float32)
        param.grad = mean
        sgd.step()
        updates, state = outer.update({"w": mean}, state, ours)
        ours = fn.apply_updates(ours, updates)
        torch.testing.assert_close(ours["w"], param, rtol=0, atol=4e-7)


def _sparseloco_reference(anchor, drifts, lr, beta, k, chunk_size):
    """The paper's rule as a loop over workers (_reference.py's top-k all-gathered): the anchor
    after every outer step, and each worker's accumulator after the last."""
    expected, current = [], anchor
    errors = [torch.zeros_like(anchor) for _ in range(W)]
    for drift in drifts:
        deltas = [current - (current + drift[r]) for r in range(W)]
        mean, errors = _reference.topk_allreduce(deltas, errors, k, chunk_size, beta)
        current = current + mean * torch.tensor(-lr)
        expected.append(current)
    return expected, errors


def test_sparseloco_is_the_papers_rule_bit_for_bit():
    comm = Simulated(W)
    anchor = torch.randn(37, generator=torch.Generator().manual_seed(4))
    drifts = _workers(anchor, steps=4, seed=5)
    outer = fn.diloco.sparseloco(lr=0.8, beta=0.9, k=3, chunk_size=16, comm=comm)
    got, state = _run(outer, comm, anchor, drifts)
    expected, errors = _sparseloco_reference(anchor, drifts, 0.8, 0.9, 3, 16)
    for s, (g, e) in enumerate(zip(got, expected, strict=True)):
        for r in range(W):
            assert torch.equal(g[r], e), (s, r)
    for r in range(W):  # the accumulator is the compressor's error feedback, per rank
        assert torch.equal(state[0].error["w"][r], errors[r])


def test_sparseloco_steps_twice_the_mean_by_default():
    """The default outer learning rate is 2 (the paper's 1 is ``lr=1.0``): the reference's
    steps at lr 2, bit for bit."""
    comm = Simulated(W)
    anchor = torch.randn(40, generator=torch.Generator().manual_seed(10))
    drifts = _workers(anchor, steps=3, seed=11)
    outer = fn.diloco.sparseloco(k=2, chunk_size=8, comm=comm, exchange="gather")
    got, _ = _run(outer, comm, anchor, drifts)
    expected, _ = _sparseloco_reference(anchor, drifts, 2.0, 0.95, 2, 8)
    for s, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert all(torch.equal(g[r], e) for r in range(W)), s


@pytest.mark.parametrize("server_k", [None, 12])
def test_sparseloco_with_the_owner_exchange_is_its_reference_bit_for_bit(server_k):
    """Owners reduce and compress again (a server error each, ``server_k`` values a chunk):
    the loop over workers and owners of _reference.py."""
    comm = Simulated(W)
    anchor = torch.randn(100, generator=torch.Generator().manual_seed(4))
    drifts = _workers(anchor, steps=3, seed=5)
    outer = fn.diloco.sparseloco(
        0.8, 0.9, k=3, chunk_size=16, comm=comm, exchange="owner", server_k=server_k
    )
    got, state = _run(outer, comm, anchor, drifts)
    current = anchor
    errors = [[torch.zeros_like(anchor)] for _ in range(W)]
    server = [torch.zeros(3 * 16) for _ in range(W)]  # 7 chunks: 3 per owner
    for s, drift in enumerate(drifts):
        deltas = [[current - (current + drift[r])] for r in range(W)]
        mean, errors, server = _reference.topk_owner_allreduce(
            deltas, errors, server, 3, 16, 0.9, server_k=server_k
        )
        current = current + mean[0] * torch.tensor(-0.8)
        assert all(torch.equal(got[s][r], current) for r in range(W)), s
    for r in range(W):
        assert torch.equal(state[0].error["w"][r], errors[r][0])
        assert torch.equal(state[0].server_error[r], server[r])


@pytest.mark.parametrize("kind", KINDS)
def test_no_worker_taking_part_skips_the_step_on_every_rank(kind):
    """Every worker's pseudo-gradient non-finite, or offered by none: nothing changes. (One
    sitter, all but one: test_participation.py.)"""
    comm = Simulated(W)
    outer = outer_rule(kind, comm)
    anchor = torch.randn(3, 7, generator=torch.Generator().manual_seed(6))
    drifts = _workers(anchor, steps=2, seed=7)
    _, state = _run(outer, comm, anchor, drifts)  # two steps: momentum and errors non-zero
    anchors = replicate({"w": anchor}, comm)
    params = {"w": anchors["w"] + drifts[0]}
    params["w"][1:, 0, 2] = float("nan")  # ranks 1 and 2; rank 0 does not take part
    takes_part = torch.tensor([False, True, True])

    def outer_step(a, p, s, t):
        return fn.diloco.outer_step(outer, a, p, s, comm=comm, takes_part=t)

    result = simulate(outer_step, comm)(anchors, params, state, takes_part)
    assert not bool(result.applied.any()) and not bool(result.participants.any())
    assert torch.equal(result.anchor["w"], anchors["w"])
    old, new = tree_leaves(state), tree_leaves(result.state)
    assert len(old) == len(new) and all(torch.equal(a, b) for a, b in zip(old, new, strict=True))
    assert any(bool(t.ne(0).any()) for t in old if t.is_floating_point())  # a state to keep
    if kind in ("loco4", "onebit", "topk", "sparseloco"):  # the error feedback among it
        assert any(error_feedback_leaves(state))


@pytest.mark.parametrize("kind", fn.diloco.COMPRESSIONS)
def test_after_every_outer_step_the_ranks_hold_the_same_anchor_and_momentum(kind):
    comm = Simulated(W)
    anchor = torch.randn(2, 9, generator=torch.Generator().manual_seed(8))
    got, state = _run(outer_rule(kind, comm), comm, anchor, _workers(anchor, steps=3, seed=9))
    for anchors in got:
        assert all(torch.equal(anchors[r], anchors[0]) for r in range(W))
    momentum = state[1][1].trace["w"]
    assert all(torch.equal(momentum[r], momentum[0]) for r in range(W))


class _Counting(Simulated):
    """``Simulated`` that counts the collectives it runs (one per call, as a round trip)."""

    calls = 0

    def _call(self, kind, x, *options):
        _Counting.calls += 1
        return super()._call(kind, x, *options)


# the sequential collectives of one outer step over two leaves; before the headers: fp32 and bf16
# 4 (the agreement, a size record, an all_to_all, an all_gather), int8, loco4 and onebit 1 + 4
# per leaf, topk and sparseloco 3 (the agreement, a size record, the all-gather)
ROUND_TRIPS = {
    2: {"fp32": 1, "bf16": 1, "int8": 2, "loco4": 2, "onebit": 2, "topk": 1, "owner": 2},
    4: {"fp32": 2, "bf16": 2, "int8": 2, "loco4": 2, "onebit": 2, "topk": 1, "owner": 2},
}


@pytest.mark.parametrize("world_size", sorted(ROUND_TRIPS))
def test_one_outer_step_makes_the_collectives_it_documents(world_size):
    """The agreement and the sizes ride in the messages' headers: one collective for the
    all-gather forms, two where owners reduce (1-bit among them)."""
    for kind, expected in ROUND_TRIPS[world_size].items():
        comm = _Counting(world_size)
        if kind == "owner":
            outer = fn.diloco.sparseloco(k=2, chunk_size=8, comm=comm, exchange="owner")
        else:
            outer = outer_rule(kind, comm)
        anchor = replicate({"w": torch.zeros(4, 5), "b": torch.zeros(3)}, comm)
        params = {name: a + 0.1 for name, a in anchor.items()}
        state = simulate(outer.init, comm)(anchor)
        _Counting.calls = 0
        step = simulate(functools.partial(fn.diloco.outer_step, outer, comm=comm), comm)
        assert bool(step(anchor, params, state).applied.all())
        assert _Counting.calls == expected, (kind, world_size, _Counting.calls)


def test_outer_step_keeps_the_params_dtype_and_skips_none_leaves():
    outer = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=Local()), lr=1.0, momentum=0.0)
    anchor = {"w": torch.ones(3, dtype=torch.bfloat16), "frozen": None}
    params = {"w": torch.tensor([1.5, 0.5, 1.0], dtype=torch.bfloat16), "frozen": None}
    result = fn.diloco.outer_step(outer, anchor, params, outer.init(anchor), comm=Local())
    assert result.anchor["frozen"] is None
    assert result.anchor["w"].dtype == torch.bfloat16
    assert result.anchor["w"].tolist() == [1.5, 0.5, 1.0]  # lr 1, no momentum: the mean
