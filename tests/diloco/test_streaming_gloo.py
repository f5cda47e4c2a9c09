"""Streaming DiLoCo on 2 gloo ranks, in one launch: every case of ``_streaming_cases`` against
the loop over the workers (bit for bit, after every inner step), a checkpoint taken while an
exchange is in flight (resumed bit for bit from ``torch.save`` and through DCP, the buffers and
the participation as taken when the exchange started; refused under another world size), a
fragment's
non-finite pseudo-gradient (its worker sits out that fragment's step), and an exchange that
fails on one rank's thread (both ranks raise from ``step()`` within the timeout)."""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch

import fn.collectives
import fn.diloco
import fn.diloco.fragment
import fn.fsdp
from tests._distributed import run_distributed
from tests.diloco import _streaming_cases as cases

W = 2
RESUMED = "P2 tau1 mix"  # fragment 0's exchange starts after step 5 and is applied after step 6


def _skip(rank):
    """Rank 1's fragment 1 turns NaN after inner step 4, just before its outer step: rank 1
    sits it out and continues from the anchor."""
    m = cases.model()
    inner = cases.inner_optimizer(m)

    steps = [0]

    def poison(optimizer, args, kwargs):  # registered first: runs before DiLoCo's hook
        steps[0] += 1
        if rank == 1 and steps[0] == 4:
            with torch.no_grad():
                m[2].bias[0] = float("nan")

    inner.register_step_post_hook(poison)
    d = fn.diloco.DiLoCo(m, inner, sync_every=4, fragments=2)
    after = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            cases.inner_step(m, inner, rank, step)
            after.append(cases.params(m))
    anchor = [a.clone() for a in d.state_dict()["anchor"]]
    return after, anchor, (d.outer_steps, d.skipped_steps), [str(w.message) for w in caught]


def _fails(rank):
    """Rank 1's exchange raises on its thread; rank 0's waits for it until the timeout."""
    m = cases.model()
    inner = cases.inner_optimizer(m)
    fn.diloco.DiLoCo(m, inner, sync_every=4, fragments=2, delay=1, timeout=3)
    if rank == 1:

        def fails(*args, **kwargs):
            raise ZeroDivisionError("injected")

        fn.diloco.fragment.outer_update = fails
    cases.inner_step(m, inner, rank, 0)
    started = time.monotonic()
    try:
        cases.inner_step(m, inner, rank, 1)
    except RuntimeError as err:
        return str(err), type(err.__cause__).__name__, time.monotonic() - started
    return "no error", "", 0.0


def _through_dcp(rank, kwargs, steps, path):
    """Saved through ``fn.fsdp.TrainingCheckpoint`` (DCP) after step 5, mid-flight, and resumed
    in a fresh run: its parameters at the end."""
    part = cases.train(rank, kwargs, 0, 5)
    fn.fsdp.TrainingCheckpoint(*part[:2], extra={"diloco": part[2]}, key=f"w{rank}").save(path)
    m, inner, d = cases.train(rank, kwargs, 0, 0)
    fn.fsdp.TrainingCheckpoint(m, inner, extra={"diloco": d}, key=f"w{rank}").load(path)
    for step in range(5, steps):
        cases.inner_step(m, inner, rank, step)
    return cases.params(m)


def _in_the_window(rank, path):
    """A model with buffers (BatchNorm), H = 6 and a delay of 2: the exchange starts after
    inner step 4 (rank 1 finite: it takes part) and is applied after step 6; rank 1's gradient
    of step 5 holds a NaN, and the last layer, frozen until then, trains from step 5 on (it
    joins at the next exchange, not this one). The model's state after step 6 and the
    sit-outs: uninterrupted, resumed from a ``torch.save`` round trip of the state after step 5
    (in flight), and resumed from DCP (the layer unfrozen before either load)."""

    def build(unfrozen=False):
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(), torch.nn.Linear(6, 2)
        )
        m[3].requires_grad_(False)
        inner = torch.optim.AdamW(m.parameters(), lr=1e-2)
        d = fn.diloco.DiLoCo(m, inner, sync_every=6, delay=2)
        m[3].requires_grad_(unfrozen)
        return m, inner, d

    def train(m, inner, d, start, stop):
        for step in range(start, stop):
            m[3].requires_grad_(step >= 4)
            g = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
            torch.nn.functional.mse_loss(m(x), y).backward()
            if rank == 1 and step == 4:
                m[0].weight.grad[0, 0] = float("nan")
            inner.step()
            inner.zero_grad()
        return {k: v.clone() for k, v in m.state_dict().items()}, list(d.sat_out)

    m, inner, d = build()
    train(m, inner, d, 0, 5)
    saved = copy.deepcopy((m.state_dict(), inner.state_dict(), d.state_dict()))
    fn.fsdp.TrainingCheckpoint(m, inner, extra={"diloco": d}, key=f"w{rank}").save(path)
    full = train(m, inner, d, 5, 6)
    m, inner, d = build(unfrozen=True)
    m.load_state_dict(saved[0])
    inner.load_state_dict(saved[1])
    d.load_state_dict(saved[2])
    resumed = train(m, inner, d, 5, 6)
    m, inner, d = build(unfrozen=True)
    fn.fsdp.TrainingCheckpoint(m, inner, extra={"diloco": d}, key=f"w{rank}").load(path)
    return full, resumed, train(m, inner, d, 5, 6), saved[2]


def _streaming(rank, world_size, path):
    results = {
        name: cases.run(rank, kwargs, steps) for name, (kwargs, steps) in cases.CASES.items()
    }
    kwargs, steps = cases.CASES[RESUMED]
    full = cases.params(cases.train(rank, kwargs, 0, steps)[0])
    saved = copy.deepcopy(tuple(x.state_dict() for x in cases.train(rank, kwargs, 0, 5)))
    resumed = cases.params(cases.train(rank, kwargs, 5, steps, state=saved)[0])
    results["resume"] = (full, resumed, saved[2], _through_dcp(rank, kwargs, steps, path))
    results["window"] = _in_the_window(rank, f"{path}-window")
    results["skip"] = _skip(rank)
    # one worker per rank (a subgroup each): every rank creates every exchange group
    groups = [torch.distributed.new_group([r]) for r in range(world_size)]
    results["subgroup"] = cases.run(rank, kwargs, steps, group=groups[rank])
    results["fails"] = _fails(rank)  # last: rank 0's exchange group is unusable after it
    return results


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("streaming") / "mid-flight")
    return run_distributed(_streaming, W, path, timeout=200)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_streaming_matches_the_loop_over_workers_bit_for_bit(gloo_ranks):
    for name, (kwargs, steps) in cases.CASES.items():
        expected = cases.reference(W, kwargs, steps)
        for rank, result in enumerate(gloo_ranks):
            for t in range(steps):
                got, want = result[name][t], expected[t][rank]
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (name, t)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_checkpoint_with_an_exchange_in_flight(gloo_ranks):
    for result in gloo_ranks:
        full, resumed, saved, through_dcp = result["resume"]
        assert saved["in_flight"] == {"fragment": 0, "started_at": 5, "trainable": [0, 1, 2, 3]}
        assert all(torch.equal(a, b) for a, b in zip(resumed, full, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(through_dcp, full, strict=True))
    deltas = [
        result["resume"][2]["per_rank"][f"rank{r}"]["in_flight_delta"]
        for r, result in enumerate(gloo_ranks)
    ]
    assert not torch.equal(*deltas)  # each rank's own
    m = cases.model()
    kwargs = cases.CASES[RESUMED][0]
    d = fn.diloco.DiLoCo(m, cases.inner_optimizer(m), **kwargs)
    with pytest.raises(ValueError, match="taken on 2 workers while fragment 0's exchange was in"):
        d.load_state_dict(gloo_ranks[0]["resume"][2])


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_resumed_exchange_sends_what_it_took_when_it_started(gloo_ranks):
    """The buffers, the decision to take part and the parameters that join are the ones of the
    inner step the exchange started after, not those of the step the checkpoint was taken
    after."""
    for rank, result in enumerate(gloo_ranks):
        full, resumed, through_dcp, saved = result["window"]
        assert full[1] == [0, 0]  # rank 1's NaN came after the exchange started
        own = saved["per_rank"][f"rank{rank}"]
        assert bool(own["in_flight_takes_part"]) and len(own["in_flight_buffers"]) == 3
        assert saved["in_flight"]["trainable"] == [0, 1, 2, 3]  # not the last layer's 4, 5
        for got in (resumed, through_dcp):
            assert got[1] == full[1]
            assert full[0].keys() == got[0].keys()
            for k in full[0]:  # rank 1's last layer, local, trained on its NaN: NaN alike
                torch.testing.assert_close(got[0][k], full[0][k], rtol=0, atol=0, equal_nan=True)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_worker_on_a_subgroup_runs_alone(gloo_ranks):
    kwargs, steps = cases.CASES[RESUMED]
    for rank, result in enumerate(gloo_ranks):
        alone = cases.run(rank, kwargs, steps, group=fn.collectives.Local())
        for t in range(steps):
            assert all(
                torch.equal(a, b) for a, b in zip(result["subgroup"][t], alone[t], strict=True)
            )


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_worker_with_a_non_finite_fragment_sits_out(gloo_ranks):
    (after0, anchor, counts, caught), (after1, anchor1, counts1, caught1) = (
        result["skip"] for result in gloo_ranks
    )
    assert counts == counts1 == (3, 0)  # fragment 0 after steps 2 and 6, fragment 1 after 4
    assert all(torch.equal(a, b) for a, b in zip(anchor, anchor1, strict=True))
    for after in (after0, after1):
        assert all(torch.equal(a, b) for a, b in zip(after[3][1:], anchor[1:], strict=True))
        assert all(bool(p.isfinite().all()) for p in after[5])
    for messages in (caught, caught1):
        assert messages == caught and len(messages) == 1, messages
        assert "worker(s) 1 sat out the outer step of fragment 1 started after" in messages[0]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_an_exchange_that_fails_on_one_rank_raises_from_step_on_every_rank(gloo_ranks):
    (message0, cause0, waited0), (message1, cause1, _) = (r["fails"] for r in gloo_ranks)
    assert "fragment 0 (started after inner step 1) failed" in message0, message0
    assert cause0 == "CollectiveTimeoutError" and waited0 < 10, (cause0, waited0)
    assert "ZeroDivisionError: injected" in message1 and cause1 == "ZeroDivisionError"
