"""``fn.kernels._tuning.Tuner`` (the per-process choice of a setting that changes no result) and
the error-feedback kernels' prefetch distances: the same bits at every distance."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import fn.kernels as K
from fn.kernels import _cpu, _reference
from fn.kernels._tuning import Tuner


def test_the_fastest_candidate_is_kept_after_its_trials():
    tuner = Tuner(("slow", "fast", "slower"), trials=2, min_elements=100)
    delay = {"slow": 0.02, "fast": 0.0, "slower": 0.04}
    seen = []

    def call(setting):
        seen.append(setting)
        time.sleep(delay[setting])

    tuner.run("k", 10, call)  # small: the default, not timed, nothing begun
    assert seen == ["slow"] and not tuner.pending() and tuner.chosen("k") is None
    for _ in range(6):
        tuner.run("k", 1000, call)
        assert tuner.pending() == (len(seen) < 7)
    assert sorted(seen[1:]) == sorted(["slow", "fast", "slower"] * 2)  # turns, in any order
    assert tuner.chosen("k") == "fast" and not tuner.pending()
    tuner.run("k", 1000, call)
    tuner.run("k", 10, call)
    assert seen[-2:] == ["fast", "fast"]
    assert tuner.chosen("other") is None  # keys are tuned apart


def test_threads_share_one_choice():
    tuner = Tuner((1, 2, 3), trials=3, min_elements=1)
    used = []

    def work():
        for _ in range(20):
            tuner.run("k", 10, used.append)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tuner.chosen("k") in (1, 2, 3) and not tuner.pending()
    assert len(used) == 80


def test_bad_settings():
    with pytest.raises(ValueError, match="candidate"):
        Tuner(())
    with pytest.raises(ValueError, match="trial"):
        Tuner((1,), trials=0)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@pytest.mark.parametrize("ahead", [0, 256, 1024, 4096])
def test_every_prefetch_distance_gives_the_same_bits(monkeypatch, ahead):
    """The distance only moves prefetches (also past the end of the inputs, which a prefetch
    may do): the x, momentum and sign-sum sources agree with the reference at each one."""
    if _cpu.library() is None:
        pytest.skip("no working C compiler: the CPU kernels fall back to the reference")
    monkeypatch.setattr(_cpu, "_PREFETCH", Tuner((ahead,), trials=1, min_elements=0))
    gen = torch.Generator().manual_seed(ahead)
    n = 5 * 1024 + 96  # full blocks, then a short one
    x, g, e = (torch.randn(n, generator=gen) for _ in range(3))
    for grad in (None, g):
        want_packed, want_scale = _reference.feedback_sign_compress(x, e, grad, 0.9)
        packed, scale = _cpu.feedback_sign_compress(x, e, grad, 0.9)
        assert torch.equal(packed, want_packed) and torch.equal(scale, want_scale)
        want, out = torch.empty(n), torch.empty(n)
        _reference.feedback_apply_error(x, e, scale, want, grad, 0.9)
        _cpu.feedback_apply_error(x, e, scale, out, grad, 0.9)
        assert torch.equal(_bits(out), _bits(want))
    signs = torch.randint(0, 256, (4, n // 8), dtype=torch.uint8, generator=gen)
    weights = torch.rand(4, generator=gen)
    want_packed, want_scale = _reference.sign_sum_compress(signs, weights, e)
    packed, scale = _cpu.sign_sum_compress(signs, weights, e)
    assert torch.equal(packed, want_packed) and torch.equal(scale, want_scale)
    want, out = torch.empty(n), e.clone()
    _reference.sign_sum_apply_error(signs, weights, e, scale, want)
    _cpu.sign_sum_apply_error(signs, weights, out, scale, out)
    assert torch.equal(_bits(out), _bits(want))
    ragged = x[: n - 3]  # a last byte of 5 signs
    assert torch.equal(_cpu.packbits(ragged), _reference.packbits(ragged))
    got = _cpu.sign_compress(x, e)
    assert all(torch.equal(a, b) for a, b in zip(got, _reference.sign_compress(x, e), strict=True))
    assert _cpu._PREFETCH.chosen(("feedback_signs", _cpu._FEEDBACK_X)) == ahead
    assert _cpu._PREFETCH.chosen(("packbits", None)) == ahead
    assert not K.tuning_pending()
