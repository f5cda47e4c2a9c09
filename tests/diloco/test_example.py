"""examples/diloco.py under torchrun (2 ranks), run from a copy of the file alone in an empty
folder: docs/examples.md's command trains, the workers end with the same params, and a run
resumed from its checkpoint ends where the uninterrupted run ends."""

from __future__ import annotations

import re

import pytest

from tests._examples import documented, download, option, run_downloaded, with_option

_DIGEST = re.compile(r"final params sha256 (\w+) \(the same on every rank\)")
_HELD_OUT = re.compile(r"held-out loss (\S+) after (\d+) steps")


@pytest.mark.timeout(600)
def test_example_trains_and_resumes_exactly(tmp_path):
    command = documented("diloco.py")
    steps = int(option(command, "--max-steps"))
    folder = download("diloco.py", tmp_path / "download")
    straight = run_downloaded(command, folder)
    losses = [float(m) for m in re.findall(r"step \d+: train loss (\S+)", straight)]
    assert len(losses) == steps // 5 and losses[-1] < losses[0], straight
    assert f"outer steps {steps // 10}," in straight
    checkpoint = str(tmp_path / "ckpt")
    half = with_option(command, "--max-steps", str(steps // 2))
    run_downloaded([*half, "--checkpoint", checkpoint], folder)
    resumed = run_downloaded([*command, "--checkpoint", checkpoint, "--resume"], folder)
    assert "step 5:" not in resumed and f"step {steps}: train loss" in resumed
    assert _DIGEST.search(resumed).group(1) == _DIGEST.search(straight).group(1)
    assert _HELD_OUT.search(resumed).groups() == _HELD_OUT.search(straight).groups()
