"""Participation on 3 gloo ranks, in one launch.

- The outer step of every rule and compressor with one sitter, all but one and none (NaN
  pseudo-gradients and ``takes_part=False``): the bits of ``Simulated`` (which
  test_participation.py compares with the loop over workers).
- ``DiLoCo`` around AdamW with a NaN loss on one worker: that worker sits out, the others'
  mean is applied, the sitter continues from the anchor with a fresh AdamW state, and the next
  outer steps train normally: every rank's parameters after every inner step are the loop over
  workers' (``_reference.streaming_run``) bit for bit, with fragments, a delay and ``mix`` too;
  every rank warns the same text. Every worker at once: the step is skipped. A worker that keeps
  sitting out: every rank raises the same error at ``max_sit_outs``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fn.diloco
from fn.collectives import ProcessGroup, Simulated, replicate, simulate
from fn.tree import tree_leaves
from tests._distributed import run_distributed
from tests.diloco import _reference
from tests.diloco import _streaming_cases as cases
from tests.diloco._cases import KINDS, drifts, outer_rule

W = 3
SHAPE = (3, 7)
NAN = float("nan")
# who takes part at each outer step: all, one sitter, all but one, none, all
MASKS = [[True] * W, [True, False, True], [False, True, False], [False] * W, [True] * W]
# name -> (DiLoCo's keywords, inner steps, {(worker, inner step): NaN loss})
RUNS = {
    "nan": ({"sync_every": 4}, 12, {(1, 2): True}),
    "nan streaming": (
        {"sync_every": 4, "fragments": 2, "delay": 1, "mix": 0.5},
        12,
        {(2, 4): True},
    ),
    "every worker": ({"sync_every": 2}, 6, {(0, 1): True, (1, 1): True, (2, 0): True}),
}
ALWAYS = ({"sync_every": 2, "max_sit_outs": 3}, 8)  # worker 1's loss NaN at every step


def _offered(mask: list[bool], step: int) -> tuple[list[int], list[bool]]:
    """Which workers' pseudo-gradients hold a NaN at outer step ``step`` and whether each
    worker offers its own: a sitter is one or the other, in turn."""
    nan = [r for r in range(W) if not mask[r] and (r + step) % 2]
    return nan, [mask[r] or r in nan for r in range(W)]


def _outer_steps(outer, comm, rank):
    """The outer steps of ``MASKS`` on one rank (``rank`` None: every rank under
    ``simulate``): the anchor and the state's leaves after each."""
    moves = drifts(SHAPE, W, steps=len(MASKS), seed=0)
    anchor = {"w": torch.linspace(-1.0, 1.0, 21).view(SHAPE)}
    if rank is None:
        anchor = replicate(anchor, comm)
        state = simulate(outer.init, comm)(anchor)
        step = simulate(
            lambda a, p, s, t: fn.diloco.outer_step(outer, a, p, s, comm=comm, takes_part=t),
            comm,
        )
    else:
        state = outer.init(anchor)

        def step(a, p, s, t):
            return fn.diloco.outer_step(outer, a, p, s, comm=comm, takes_part=t)

    out = []
    for s, (mask, move) in enumerate(zip(MASKS, moves, strict=True)):
        nan, offered = _offered(mask, s)
        params = anchor["w"] + (move if rank is None else move[rank])
        if rank is None:
            params[nan, 0, 1] = NAN
        elif rank in nan:
            params[0, 1] = NAN
        taking = torch.tensor(offered if rank is None else offered[rank])
        result = step(anchor, {"w": params}, state, taking)
        anchor, state = result.anchor, result.state
        out.append((anchor["w"], tree_leaves(state), result.participants.tolist()))
    return out


def _inner_step(models, inners, poison):
    def step(r: int, t: int) -> None:
        g = torch.Generator().manual_seed(1000 * r + t)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        loss = torch.nn.functional.mse_loss(models[r](x), y)
        if (r, t) in poison or (r, None) in poison:
            loss = loss * NAN
        loss.backward()
        inners[r].step()
        inners[r].zero_grad()

    return step


def _adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2)


def _wrapper_run(rank, kwargs, steps, poison):
    """This rank's parameters after every inner step, its warnings, counts and error."""
    m = cases.model()
    inner = _adamw(m)
    d = cases.diloco(m, inner, **kwargs)
    models, inners = {rank: m}, {rank: inner}
    step = _inner_step(models, inners, poison)
    after, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(steps):
            try:
                step(rank, t)
            except RuntimeError as err:
                error = str(err)
                break
            after.append(cases.params(m))
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    counts = (d.sat_out, d.skipped_steps, d.outer_steps)
    return after, messages, counts, error, cases.params(m)


def _gloo(rank, world_size):
    comm = ProcessGroup(timeout=60)
    results = {kind: _outer_steps(outer_rule(kind, comm), comm, rank) for kind in KINDS}
    for name, (kwargs, steps, poison) in RUNS.items():
        results[name] = _wrapper_run(rank, kwargs, steps, poison)
    results["always"] = _wrapper_run(rank, *ALWAYS, {(1, None): True})
    return results


@pytest.fixture(scope="module")
def gloo_ranks():
    return run_distributed(_gloo, W, timeout=200)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", KINDS)
def test_gloo_ranks_take_the_outer_steps_of_simulated(gloo_ranks, kind):
    comm = Simulated(W)
    expected = _outer_steps(outer_rule(kind, comm), comm, None)
    for rank, result in enumerate(gloo_ranks):
        for s, ((anchor, leaves, mask), (e_anchor, e_leaves, e_mask)) in enumerate(
            zip(result[kind], expected, strict=True)
        ):
            assert mask == e_mask[rank] == MASKS[s], (kind, s)
            assert torch.equal(anchor, e_anchor[rank]), (kind, rank, s)
            assert all(torch.equal(a, b[rank]) for a, b in zip(leaves, e_leaves, strict=True))


def _reference_run(kwargs, steps, poison):
    models = [cases.model() for _ in range(W)]
    inners = [_adamw(m) for m in models]

    def state_finite(r: int, p: int) -> bool:
        del p
        return all(
            bool(torch.isfinite(v).all())
            for state in inners[r].state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )

    fragments = {1: [[0, 1, 2, 3]], 2: [[0], [1, 2, 3]]}[kwargs.get("fragments", 1)]
    return _reference.streaming_run(
        [list(m.parameters()) for m in models],
        _inner_step(models, inners, poison),
        steps=steps,
        sync_every=kwargs["sync_every"],
        fragments=fragments,
        delay=kwargs.get("delay", 0),
        mix=kwargs.get("mix", 0.0),
        outer=_reference.nesterov_outer(0.7, 0.9),
        takes_part=state_finite,
        reset=lambda r: inners[r].state.clear(),
    )


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(RUNS))
def test_a_worker_with_a_nan_sits_out_and_the_next_steps_train(gloo_ranks, name):
    kwargs, steps, poison = RUNS[name]
    expected = _reference_run(kwargs, steps, poison)
    for rank, result in enumerate(gloo_ranks):
        after, messages, _, error, _ = result[name]
        assert error is None, error
        for t in range(steps):  # (NaN where the reference has NaN: the poisoned steps)
            assert all(
                bool(((a == b) | (a.isnan() & b.isnan())).all())
                for a, b in zip(after[t], expected[t][rank], strict=True)
            ), (name, rank, t)
        assert messages == gloo_ranks[0][name][1] and len(messages) == 1, messages
    assert all(bool(p.isfinite().all()) for p in gloo_ranks[0][name][0][-1])  # no NaN left
    messages, (sat_out, skipped, _) = gloo_ranks[0][name][1], gloo_ranks[0][name][2]
    if name == "every worker":
        assert sat_out == [1, 1, 1] and skipped == 1
        assert "every worker sat out the outer step started after inner step 2" in messages[0]
        assert "the step was skipped" in messages[0]
        return
    sitter = 1 if name == "nan" else 2
    assert sat_out == [int(w == sitter) for w in range(W)] and skipped == 0
    step = "fragment 0 started after inner step 5" if name == "nan streaming" else "inner step 4"
    assert f"worker(s) {sitter} sat out the outer step" in messages[0], messages
    assert step in messages[0] and "mean of the other 2 worker(s) was applied" in messages[0]
    assert "its inner optimizer's state was reset" in messages[0]
    # after the outer step, the workers hold the same parameters again (mix 0)
    if name == "nan":
        for t in (3, 7, 11):
            assert all(
                torch.equal(a, b)
                for r in range(1, W)
                for a, b in zip(gloo_ranks[0][name][0][t], gloo_ranks[r][name][0][t], strict=True)
            )


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_worker_that_keeps_sitting_out_raises_on_every_rank(gloo_ranks):
    results = [result["always"] for result in gloo_ranks]
    errors = {error for _, _, _, error, _ in results}
    assert len(errors) == 1, errors  # the same message on every rank
    (error,) = errors
    assert "worker(s) 1 sat out 3 outer steps in a row (max_sit_outs=3)" in error, error
    for after, messages, (sat_out, skipped, outer_steps), _, final in results:
        assert len(after) == 5 and len(messages) == 3  # raised by the 6th inner step's step()
        assert sat_out == [0, 3, 0] and skipped == 0 and outer_steps == 3
        # raised once the step was applied: every worker at the new anchor
        assert all(torch.equal(a, b) for a, b in zip(final, results[0][4], strict=True))
