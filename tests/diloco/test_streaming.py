"""Streaming DiLoCo on one process: the schedule and the partition on their own, the settings
``DiLoCo`` refuses, one worker against the loop-over-workers reference, a checkpoint taken while
an exchange is in flight, and an exchange that fails on its thread. Two ranks: test_gloo.py."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import fn.diloco
import fn.diloco.fragment
from fn.diloco.streaming import StreamPlan, StreamSchedule, balanced_fragments, fragment_indices
from tests.diloco import _streaming_cases as cases


def _events(schedule: StreamSchedule, steps: int) -> dict[int, StreamPlan]:
    return {t: schedule.plan(t) for t in range(1, steps + 1) if schedule.plan(t) != (None, None)}


def test_schedule_every_fragment_once_per_sync_every_started_delay_steps_before():
    assert _events(StreamSchedule(4, 1, 0), 8) == {4: (0, 0), 8: (0, 0)}  # DiLoCo
    assert _events(StreamSchedule(4, 2, 0), 8) == {2: (0, 0), 4: (1, 1), 6: (0, 0), 8: (1, 1)}
    assert _events(StreamSchedule(8, 4, 1), 9) == {
        1: (0, None), 2: (None, 0), 3: (1, None), 4: (None, 1),
        5: (2, None), 6: (None, 2), 7: (3, None), 8: (None, 3), 9: (0, None),
    }  # fmt: skip
    events = _events(StreamSchedule(12, 2, 5), 24)
    assert events == {1: (0, None), 6: (None, 0), 7: (1, None), 12: (None, 1),
                      13: (0, None), 18: (None, 0), 19: (1, None), 24: (None, 1)}  # fmt: skip


def test_schedule_refusals():
    with pytest.raises(ValueError, match=r"sync_every \(6\) must be a multiple"):
        StreamSchedule(6, 4, 0).checked()
    with pytest.raises(ValueError, match=r"delay \(2\) must be below sync_every / fragments \(2\)"):
        StreamSchedule(8, 4, 2).checked()
    with pytest.raises(ValueError, match="delay must be an int >= 0"):
        StreamSchedule(8, 4, -1).checked()


def test_balanced_fragments():
    assert balanced_fragments([5], 1) == [[0]]
    assert balanced_fragments([1, 1, 1, 1, 1, 1], 3) == [[0, 1], [2, 3], [4, 5]]
    assert balanced_fragments([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert balanced_fragments([1, 1, 1, 100], 2) == [[0, 1, 2], [3]]
    assert balanced_fragments([100, 1, 1, 1], 4) == [[0], [1], [2], [3]]  # one tensor at least
    assert balanced_fragments([4, 4, 4, 4], 3) == [[0], [1, 2], [3]]  # ties: the shorter prefix
    with pytest.raises(ValueError, match="fragments=3, but the model has 2"):
        balanced_fragments([1, 1], 3)


def test_fragment_lists_and_their_refusals():
    m = cases.model()
    params = list(m.parameters())
    assert fragment_indices(params, cases.strided(m)) == [[0, 2], [1, 3]]
    assert fragment_indices(params, 2) == [[0], [1, 2, 3]]
    stranger = torch.nn.Parameter(torch.zeros(5))
    refusals = {
        "not one of the model's trainable": [[m[0].weight, stranger], params[1:]],
        "in fragments 0 and 1": [params[:2], params[1:]],
        r"leave out parameter\(s\) \[3\]": [params[:2], params[2:3]],
        "fragment 1 must be a non-empty list": [params, []],
        "an int or a list of lists": "abc",
    }
    for message, fragments in refusals.items():
        with pytest.raises(ValueError, match=message):
            fragment_indices(params, fragments)


def test_diloco_refusals():
    m = cases.model()
    inner = cases.inner_optimizer(m)
    with pytest.raises(ValueError, match="must be a multiple of the number of fragments"):
        fn.diloco.DiLoCo(m, inner, sync_every=5, fragments=2)
    with pytest.raises(ValueError, match="delay"):
        fn.diloco.DiLoCo(m, inner, sync_every=4, fragments=2, delay=2)
    with pytest.raises(ValueError, match="in fragments 0 and 1"):
        fn.diloco.DiLoCo(m, inner, sync_every=4, fragments=[list(m.parameters())] * 2)
    with pytest.raises(ValueError, match="mix must be in"):
        fn.diloco.DiLoCo(m, inner, sync_every=4, fragments=2, mix=1.0)
    saved = fn.diloco.DiLoCo(m, inner, sync_every=4, fragments=2).state_dict()
    with pytest.raises(ValueError, match="settings"):  # another partition
        fn.diloco.DiLoCo(m, inner, sync_every=4, fragments=cases.strided(m)).load_state_dict(saved)


@pytest.mark.parametrize("name", list(cases.CASES))
def test_one_worker_matches_the_reference_bit_for_bit(name):
    kwargs, steps = cases.CASES[name]
    got = cases.run(0, kwargs, steps)
    expected = cases.reference(1, kwargs, steps)
    for t in range(steps):
        assert all(torch.equal(a, b) for a, b in zip(got[t], expected[t][0], strict=True)), t


def test_a_slow_exchange_gives_the_same_bits(monkeypatch):
    """The exchange's thread outlasts the inner steps it overlaps: the step that applies it
    waits, and the parameters are the reference's."""
    exchange = fn.diloco.fragment.outer_update

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return exchange(*args, **kwargs)

    monkeypatch.setattr(fn.diloco.fragment, "outer_update", slow)
    kwargs, steps = cases.CASES["P4 tau1 mix"]
    got, expected = cases.run(0, kwargs, steps), cases.reference(1, kwargs, steps)
    for t in range(steps):
        assert all(torch.equal(a, b) for a, b in zip(got[t], expected[t][0], strict=True)), t


def test_checkpoint_in_flight_resumes_bit_for_bit():
    kwargs, steps = cases.CASES["P2 tau1 mix"]  # fragment 0 starts after step 5, applies after 6
    full = cases.params(cases.train(0, kwargs, 0, steps)[0])
    part = cases.train(0, kwargs, 0, 5)
    saved = copy.deepcopy(tuple(x.state_dict() for x in part))
    assert saved[2]["in_flight"] == {"fragment": 0, "started_at": 5, "trainable": [0, 1, 2, 3]}
    assert saved[2]["per_rank"]["rank0"]["in_flight_delta"].shape == (12,)  # fragment 0: 3 x 4
    resumed = cases.params(cases.train(0, kwargs, 5, steps, state=saved)[0])
    assert all(torch.equal(a, b) for a, b in zip(resumed, full, strict=True))


def test_an_exception_on_the_exchange_thread_surfaces_from_step(monkeypatch):
    def fails(*args, **kwargs):
        raise ZeroDivisionError("injected")

    monkeypatch.setattr(fn.diloco.fragment, "outer_update", fails)
    m = cases.model()
    inner = cases.inner_optimizer(m)
    d = fn.diloco.DiLoCo(m, inner, sync_every=4, fragments=2, delay=1)
    cases.inner_step(m, inner, 0, 0)  # fragment 0's exchange starts, and fails on its thread
    with pytest.raises(RuntimeError, match="fragment 0 .* failed on its background thread") as err:
        cases.inner_step(m, inner, 0, 1)
    assert isinstance(err.value.__cause__, ZeroDivisionError)
    assert d.outer_steps == 0 and d.state_dict()["in_flight"]["fragment"] is None
