"""examples/fsdp_loco.py and examples/fsdp_onebit.py under torchrun (2 ranks, a tiny model): they
train, and a run resumed from its checkpoint ends where the uninterrupted run ends."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--layers", "1", "--d-model", "16", "--heads", "2", "--context", "8", "--vocab", "16"]
MODEL += ["--batch", "2", "--log-every", "1"]
TINY = MODEL + ["--group-size", "16"]


def torchrun(*args: str, example: str = "fsdp_loco.py", tiny: Sequence[str] = TINY) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [os.path.join(ROOT, "examples", example), *tiny, *args],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def held_out(stdout: str) -> str:
    return re.search(r"held-out loss (\S+) after 4 steps", stdout).group(1)


@pytest.mark.timeout(900)
def test_example_trains_and_resumes_exactly(tmp_path):
    straight = torchrun("--max-steps", "4")
    assert "step 4: train loss" in straight
    checkpoint = str(tmp_path / "ckpt")
    torchrun("--max-steps", "2", "--checkpoint", checkpoint)
    resumed = torchrun("--max-steps", "4", "--checkpoint", checkpoint, "--resume")
    assert "step 1:" not in resumed and "step 3: train loss" in resumed
    assert held_out(resumed) == held_out(straight)
    last = re.compile(r"step 4: train loss \S+")
    assert last.search(resumed).group(0) == last.search(straight).group(0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_onebit_example_resumes_after_the_freeze_exactly(tmp_path, optimizer):
    def onebit(*args: str) -> str:
        flags = ("--freeze-step", "2", "--optimizer", optimizer)
        return torchrun(*flags, *args, example="fsdp_onebit.py", tiny=MODEL)

    straight = onebit("--max-steps", "4")
    checkpoint = str(tmp_path / "ckpt")
    onebit("--max-steps", "2", "--checkpoint", checkpoint)  # the next update is the freeze
    resumed = onebit("--max-steps", "4", "--checkpoint", checkpoint, "--resume")
    assert "step 1:" not in resumed and "step 3: train loss" in resumed
    assert held_out(resumed) == held_out(straight)
    digest = re.compile(r"final params sha256 (\w+) \(the same on every rank\)")
    assert digest.search(resumed).group(1) == digest.search(straight).group(1)
