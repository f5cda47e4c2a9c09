"""examples/hsdp_onebit.py under ``torchrun`` on 4 gloo ranks, 2 nodes x 2, run from a copy of
the file alone in an empty folder: docs/examples.md's command trains, a run resumed from
checkpoints saved in the warmup (the next update is the freeze) and at the freeze (after the
first compressed update) ends with the same params, bit for bit, as the uninterrupted run, and
every rank ends with the same params (the script checks it); the last checkpoint resumes on 4
nodes x 1 rank, resharded."""

from __future__ import annotations

import re

import pytest

from tests._examples import documented, download, option, run_downloaded, with_option

DIGEST = re.compile(r"final params sha256 (\w+) \(the same on every rank\)")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resumed_in_warmup_and_at_the_freeze_is_bit_identical(tmp_path):
    command = documented("hsdp_onebit.py")  # 4 ranks, 2 per node, 5 updates, freeze at 3
    assert option(command, "--nproc-per-node") == "4" and option(command, "--freeze-step") == "3"
    steps = int(option(command, "--max-steps"))
    folder = download("hsdp_onebit.py", tmp_path / "download")

    def hsdp_onebit(max_steps: int, *args: str) -> str:
        return run_downloaded(
            with_option(command, "--max-steps", str(max_steps)) + list(args), folder, 240
        )

    straight = hsdp_onebit(steps)
    assert "hsdp 2x2: held-out loss" in straight and f"after {steps} steps" in straight
    # one checkpoint directory, resumed and saved again: steps 0-2, 2-3 (the freeze), 3-5
    checkpoint = str(tmp_path / "ckpt")
    hsdp_onebit(2, "--checkpoint", checkpoint)
    at_freeze = hsdp_onebit(3, "--checkpoint", checkpoint, "--resume")
    assert "step 2:" not in at_freeze and "step 3: train loss" in at_freeze
    resumed = hsdp_onebit(steps, "--checkpoint", checkpoint, "--resume")
    assert "step 3:" not in resumed and f"step {steps}: train loss" in resumed
    assert DIGEST.search(resumed).group(1) == DIGEST.search(straight).group(1)
    held_out = re.compile(r"held-out loss \S+ after \d+ steps")
    assert held_out.search(resumed).group(0) == held_out.search(straight).group(0)
    # on one rank per node (4 x 1): resharded, it trains on, every rank the same (the script)
    other = hsdp_onebit(steps + 2, "--checkpoint", checkpoint, "--resume", "--ranks-per-node", "1")
    assert f"step {steps}:" not in other and "hsdp 4x1: held-out loss" in other, other[-2000:]
    assert f"after {steps + 2} steps" in other and DIGEST.search(other)
