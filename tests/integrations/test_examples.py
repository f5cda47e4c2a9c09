"""The Trainer and Accelerate example scripts under ``torchrun`` (2 gloo ranks, a tiny GPT-2),
each run from a copy of the file alone in an empty folder: docs/examples.md's command trains,
and a run resumed from a checkpoint of the stack's own, saved in warmup or at the freeze, ends
with the same params, bit for bit, as the uninterrupted run (the scripts also check that every
rank ends with the same params)."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in the 'integrations' extra")
pytest.importorskip("accelerate", reason="accelerate is in the 'integrations' extra")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="in the 'integrations' extra")
from tests._examples import (  # noqa: E402
    documented,
    download,
    option,
    run_downloaded,
    with_option,
)

RESUME = {"hf_trainer.py": "--resume-from-checkpoint", "accelerate_loop.py": "--resume"}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", list(RESUME))
def test_resumed_run_is_bit_identical(script, tmp_path):
    command = documented(script)  # e.g. --max-steps 6 --freeze-step 4 --save-steps 2
    steps, save = int(option(command, "--max-steps")), int(option(command, "--save-steps"))
    assert int(option(command, "--freeze-step")) < steps and save < steps
    folder = download(script, tmp_path / "download")
    out = run_downloaded(command, folder, timeout=420)
    assert "the same on every rank" in out
    full = folder / option(command, "--output-dir")
    final = safetensors_torch.load_file(full / "final" / "model.safetensors")
    assert len(final) > 10
    for step in range(save, steps, save):
        checkpoint, resumed = f"checkpoint-{step}", tmp_path / f"resumed-{step}"
        shutil.copytree(full / checkpoint, resumed / checkpoint)
        flag = RESUME[script]
        extra = [flag] if flag == "--resume" else [flag, str(resumed / checkpoint)]
        run_downloaded(with_option(command, "--output-dir", str(resumed)) + extra, folder, 420)
        got = safetensors_torch.load_file(resumed / "final" / "model.safetensors")
        assert got.keys() == final.keys()
        for name in final:
            assert torch.equal(got[name], final[name]), (step, name)
        # the checkpoint rank 0 saved alone holds every rank's error feedback (None in warmup)
        optimizer_file = "optimizer.pt" if script == "hf_trainer.py" else "optimizer.bin"
        saved = torch.load(full / checkpoint / optimizer_file, weights_only=True)
        record = saved["state"][0]
        assert record["rank"] == 0 and len(record["error_feedback_by_rank"]) == 2
