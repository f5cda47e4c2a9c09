"""The two example scripts under ``torchrun`` (2 gloo ranks, a tiny GPT-2): a run resumed from a
checkpoint of the stack's own, saved in warmup or at the freeze, ends with the same params, bit
for bit, as the uninterrupted run (the scripts also check that every rank ends with the same
params)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in the 'integrations' extra")
pytest.importorskip("accelerate", reason="accelerate is in the 'integrations' extra")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="in the 'integrations' extra")
from tests._distributed import ROOT, torchrun  # noqa: E402

STEPS, FREEZE, SAVE = 6, 4, 2  # checkpoints after updates 2 (warmup) and 4 (the freeze)
RESUME = {"hf_trainer.py": "--resume-from-checkpoint", "accelerate_loop.py": "--resume"}


def _torchrun(script: str, output_dir: Path, *extra: str) -> str:
    return torchrun(
        ROOT / "examples" / script, "--output-dir", str(output_dir),
        "--max-steps", str(STEPS), "--freeze-step", str(FREEZE), "--save-steps", str(SAVE),
        *extra, timeout=420,
    )  # fmt: skip


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script", list(RESUME))
def test_resumed_run_is_bit_identical(script, tmp_path):
    full = tmp_path / "full"
    out = _torchrun(script, full)
    assert "the same on every rank" in out
    final = safetensors_torch.load_file(full / "final" / "model.safetensors")
    assert len(final) > 10
    for step in range(SAVE, STEPS, SAVE):
        checkpoint, resumed = f"checkpoint-{step}", tmp_path / f"resumed-{step}"
        shutil.copytree(full / checkpoint, resumed / checkpoint)
        flag = RESUME[script]
        extra = (flag,) if flag == "--resume" else (flag, str(resumed / checkpoint))
        _torchrun(script, resumed, *extra)
        got = safetensors_torch.load_file(resumed / "final" / "model.safetensors")
        assert got.keys() == final.keys()
        for name in final:
            assert torch.equal(got[name], final[name]), (step, name)
        # the checkpoint rank 0 saved alone holds every rank's error feedback (None in warmup)
        optimizer_file = "optimizer.pt" if script == "hf_trainer.py" else "optimizer.bin"
        saved = torch.load(full / checkpoint / optimizer_file, weights_only=True)
        record = saved["state"][0]
        assert record["rank"] == 0 and len(record["error_feedback_by_rank"]) == 2
