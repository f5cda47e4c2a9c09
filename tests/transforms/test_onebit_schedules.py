"""The host-side schedules, against sequences written out by hand."""

from __future__ import annotations

import torch

from fn.transforms._onebit_schedules import FreezeSchedule, ZeroOneAdamSchedule
from tests.transforms._onebit_reference import ZeroOneAdamReference


def test_freeze_schedule():
    s = FreezeSchedule(4)
    assert [t for t in range(1, 9) if s.is_compressed(t)] == [4, 5, 6, 7, 8]
    assert [t for t in range(1, 9) if s.is_last_warmup_step(t)] == [3]
    assert s.first_compressed_step() == 4
    # freeze_step <= 1: compressed from the first update
    assert FreezeSchedule(1).is_compressed(1) and FreezeSchedule(0).is_compressed(1)
    assert FreezeSchedule(0).first_compressed_step() == 1


SMALL = ZeroOneAdamSchedule(
    var_freeze_step=12, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4
)
# c = t + 1. Variance refreshes at c % var_interval == 0: interval 1 for c = 2, 3; 2 for c = 4, 6;
# 4 for c = 8, 12; then frozen after t = 12.
VARIANCE_STEPS = [1, 2, 3, 5, 7, 11]
ONEBIT_STEPS = [4, 6, 8, 9, 10, 12]
# Frozen from t = 13; local_interval 1 for the first 3 frozen updates (t = 13..15), 2 for the next
# 3 (t = 16..18), then 4 (clipped): syncs where c % interval == 0.
SYNC_STEPS = [13, 14, 15, 17, 19, 23, 27, 31]


def test_zero_one_adam_small_schedule():
    ts = range(1, 32)
    assert [t for t in ts if SMALL.is_variance_step(t)] == VARIANCE_STEPS
    assert [t for t in ts if not SMALL.frozen(t) and SMALL.is_compressed(t)] == ONEBIT_STEPS
    assert [t for t in ts if SMALL.frozen(t)] == list(range(13, 32))
    assert [t for t in ts if SMALL.is_sync_step(t)] == SYNC_STEPS
    assert [t for t in ts if SMALL.resets_errors(t)] == [12]
    assert [t for t in ts if not SMALL.is_compressed(t)] == VARIANCE_STEPS


def test_zero_one_adam_counters():
    assert SMALL.counters(1) == (1, 0, 1, 0, False)
    assert SMALL.counters(3) == (2, 0, 1, 0, False)  # after refreshes at t = 1, 2
    assert SMALL.counters(4) == (2, 1, 1, 0, False)
    assert SMALL.counters(13) == (8, 0, 1, 0, True)  # refreshes at 7 and 11 doubled it to 8
    assert SMALL.counters(16) == (8, 0, 2, 0, True)
    assert SMALL.counters(18) == (8, 0, 2, 2, True)
    assert SMALL.counters(40) == (8, 0, 4, 0, True)


def test_zero_one_adam_defaults():
    s = ZeroOneAdamSchedule(100000, 16, 32678, 16)
    ts = range(1, 120)
    # 16 refreshes every step (c = 2..17), 16 every 2nd (c = 18..48), 16 every 4th (c = 52..112),
    # then every 8th (c = 120).
    want = list(range(1, 17)) + list(range(17, 48, 2)) + list(range(51, 112, 4)) + [119]
    assert [t for t in ts if s.is_variance_step(t)] == want
    assert not any(s.frozen(t) for t in ts)
    assert s.frozen(100001) and not s.frozen(100000)
    assert s.is_sync_step(100001)  # local_interval 1 for the first 32678 frozen updates


def test_zero_one_adam_zero_freeze_step():
    s = ZeroOneAdamSchedule(0, 2, 2, 16)
    assert not s.frozen(1) and s.is_variance_step(1) and s.resets_errors(1)
    # local_interval: 1 at t = 2, 3; 2 at t = 4, 5; 4 at 6, 7; 8 at 8, 9; then 16 (clipped)
    assert [t for t in range(1, 17) if s.is_sync_step(t)] == [2, 3, 5, 7, 15]


def test_schedule_matches_reference_counters():
    """The reference keeps DeepSpeed's per-leaf counters and flags step by step."""
    params = {"x": torch.zeros(3)}
    ref = ZeroOneAdamReference(params, 1, 1e-2, (0.9, 0.999), 1e-8, 0.0, *SMALL)
    for t in range(1, 32):
        ref.step(t, [{"x": torch.ones(3)}], [params])
    log = ref.log
    assert [t for t, kind in enumerate(log, start=1) if kind == "var"] == VARIANCE_STEPS
    assert [t for t, kind in enumerate(log, start=1) if kind == "onebit"] == ONEBIT_STEPS
    assert [t for t, kind in enumerate(log, start=1) if kind == "sync"] == SYNC_STEPS
