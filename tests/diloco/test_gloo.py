"""The outer step on gloo ranks: the same bits as under ``Simulated`` for the rules and the
compressors that fn.diloco adds (``cast_allreduce``, ``topk_allreduce``), a non-finite
pseudo-gradient skipped on every rank, and ranks whose sizes or settings differ refused
together. The other compressors (int8, LoCo, 1-bit) give the bits of ``Simulated`` on gloo in
tests/collectives; leaving them out here spares each process the import their kernels' first
call costs (about 20 s on a loaded machine)."""

from __future__ import annotations

import pytest
import torch

import fn.diloco
from fn.collectives import (
    ProcessGroup,
    Simulated,
    cast_allreduce,
    replicate,
    simulate,
    topk_allreduce,
)
from fn.tree import tree_leaves
from tests._distributed import run_distributed
from tests.diloco._cases import drifts, outer_rule

W = 2
KINDS = ("fp32", "bf16", "topk", "sparseloco")
SHAPE = (4, 5)
ANCHOR = torch.linspace(-1.0, 1.0, 20).view(SHAPE)


def _steps(outer, comm, rank, moves):
    """Outer steps on one rank (``rank`` None: every rank under ``simulate``); the anchor and
    the state's leaves after the last."""
    anchor = {"w": ANCHOR.clone()}
    if rank is None:
        anchor = replicate(anchor, comm)
        state = simulate(outer.init, comm)(anchor)
        step = simulate(lambda a, p, s: fn.diloco.outer_step(outer, a, p, s, comm=comm), comm)
    else:
        state = outer.init(anchor)

        def step(a, p, s):
            return fn.diloco.outer_step(outer, a, p, s, comm=comm)

    applied = []
    for move in moves:
        result = step(anchor, {"w": anchor["w"] + (move if rank is None else move[rank])}, state)
        anchor, state = result.anchor, result.state
        applied.append(bool(result.applied.all()))
    return anchor["w"], tree_leaves(state), applied


def _refused(update) -> str:
    try:
        update()
    except ValueError as err:
        return str(err)
    return "not refused"


def _gloo(rank, world_size):
    comm = ProcessGroup(timeout=60)
    moves = drifts(SHAPE, world_size, steps=3, seed=0)
    results = {kind: _steps(outer_rule(kind, comm), comm, rank, moves) for kind in KINDS}
    bad = [m.clone() for m in moves]
    bad[1][world_size - 1, 0, 0] = float("inf")
    results["skip"] = _steps(outer_rule("topk", comm), comm, rank, bad)
    x, same = {"w": torch.ones(10 + rank % 2)}, {"w": torch.ones(8)}
    sizes = topk_allreduce(2, 8, comm=comm)
    settings = topk_allreduce(2 + rank % 2, 8, comm=comm)
    cast = cast_allreduce(torch.bfloat16, comm=comm)
    results["refused"] = [
        _refused(lambda: sizes.update(x, sizes.init(x))),
        _refused(lambda: settings.update(same, settings.init(same))),
        _refused(lambda: cast.update(x, cast.init(x))),
    ]
    return results


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_gloo_ranks_match_simulated_bit_for_bit_and_refuse_together():
    ranks = run_distributed(_gloo, W, timeout=200)
    comm = Simulated(W)
    moves = drifts(SHAPE, W, steps=3, seed=0)
    for kind in KINDS:
        anchor, leaves, applied = _steps(outer_rule(kind, comm), comm, None, moves)
        assert applied == [True] * 3
        for r, result in enumerate(ranks):
            got_anchor, got_leaves, got_applied = result[kind]
            assert got_applied == applied
            assert torch.equal(got_anchor, anchor[r]), (kind, r)
            assert len(got_leaves) == len(leaves)
            for got, expected in zip(got_leaves, leaves, strict=True):
                assert torch.equal(got, expected[r]), (kind, r)
    skipped = [result["skip"] for result in ranks]
    assert all(applied == [True, False, True] for _, _, applied in skipped)
    assert all(torch.equal(anchor, skipped[0][0]) for anchor, _, _ in skipped)
    for result in ranks:
        sizes, settings, cast = result["refused"]
        assert "different sizes" in sizes and "rank 0: 10 elements, rank 1: 11" in sizes, sizes
        assert "different sets of tensors" in settings, settings
        assert "different sizes" in cast, cast
