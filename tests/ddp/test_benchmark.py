"""Smoke test of benchmarks/ddp.py: a tiny run (never timings), its bytes in the right order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_ddp_benchmark_smoke(tmp_path):
    out = tmp_path / "ddp.json"
    args = ["--width", "32", "--layers", "2", "--steps", "6", "--freeze", "3", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ddp.py"), *args],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert run.returncode == 0, run.stderr
    results = {row["setup"]: row for row in json.loads(out.read_text())["results"]}
    assert len(results) == 5 and all(setup in run.stdout for setup in results)
    bare = results["fn OnebitAdam (no DDP)"]
    registered = results["DDP + fn.ddp.register(OnebitAdam)"]
    dense = results["DDP + AdamW (dense)"]
    # compressed steps: DDP adds nothing to fn's 1-bit traffic; dense sends ~ 32x more
    assert registered["total"] - registered["warmup"] <= 1.05 * (bare["total"] - bare["warmup"])
    assert dense["total"] - dense["warmup"] > 4 * (bare["total"] - bare["warmup"])
    for setup in ("DDP + AdamW + onebit_hook", "DDP + AdamW + loco_hook (4 bit)"):
        row = results[setup]
        assert row["total"] - row["warmup"] < 0.5 * (dense["total"] - dense["warmup"]), setup
    assert bare["fn_counter"] > 0 and dense["fn_counter"] is None
