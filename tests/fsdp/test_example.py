"""examples/fsdp_loco.py and examples/fsdp_onebit.py under torchrun (2 ranks), each run from a
copy of the file alone in an empty folder: docs/examples.md's command trains, and a run resumed
from its checkpoint ends where the uninterrupted run ends."""

from __future__ import annotations

import re

import pytest

from tests._examples import documented, download, run_downloaded, with_option


def held_out(stdout: str) -> str:
    return re.search(r"held-out loss (\S+) after 4 steps", stdout).group(1)


def _runs(script: str, folder, *flags: str):
    """The page's command for ``script`` (4 updates, a log line each) with ``flags``, and a
    runner of it with ``--max-steps`` replaced and more arguments."""
    command = documented(script) + list(flags)
    assert with_option(command, "--max-steps", "4") == command
    download(script, folder)

    def run(steps: int, *args: str) -> str:
        return run_downloaded(with_option(command, "--max-steps", str(steps)) + list(args), folder)

    return run


@pytest.mark.timeout(900)
def test_example_trains_and_resumes_exactly(tmp_path):
    run = _runs("fsdp_loco.py", tmp_path / "download")
    straight = run(4)
    assert "step 4: train loss" in straight
    checkpoint = str(tmp_path / "ckpt")
    run(2, "--checkpoint", checkpoint)
    resumed = run(4, "--checkpoint", checkpoint, "--resume")
    assert "step 1:" not in resumed and "step 3: train loss" in resumed
    assert held_out(resumed) == held_out(straight)
    last = re.compile(r"step 4: train loss \S+")
    assert last.search(resumed).group(0) == last.search(straight).group(0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_onebit_example_resumes_after_the_freeze_exactly(tmp_path, optimizer):
    flags = ("--optimizer", "lamb") if optimizer == "lamb" else ()  # adam: the default
    onebit = _runs("fsdp_onebit.py", tmp_path / "download", *flags)
    assert "--freeze-step 2" in " ".join(documented("fsdp_onebit.py"))  # 2 is the freeze
    straight = onebit(4)
    checkpoint = str(tmp_path / "ckpt")
    onebit(2, "--checkpoint", checkpoint)  # the next update is the freeze
    resumed = onebit(4, "--checkpoint", checkpoint, "--resume")
    assert "step 1:" not in resumed and "step 3: train loss" in resumed
    assert held_out(resumed) == held_out(straight)
    digest = re.compile(r"final params sha256 (\w+) \(the same on every rank\)")
    assert digest.search(resumed).group(1) == digest.search(straight).group(1)
