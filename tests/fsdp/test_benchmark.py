"""A tiny run of benchmarks/fsdp.py: it trains all three modes and counts bytes at the interface."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(600)
def test_tiny_benchmark_counts_bytes_and_losses(tmp_path):
    out = tmp_path / "fsdp.json"
    tiny = ["--steps", "2", "--layers", "1", "--d-model", "32", "--timeout", "500"]
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "fsdp.py"), *tiny, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=560,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out loss" in proc.stdout
    results = json.loads(out.read_text())["rank0"]
    dense = results["dense"]["bytes_per_step"]
    assert dense["reduce_scatter"] > 0 and "all_to_all" not in dense
    for mode in ("loco", "qgz", "loco+qwz"):
        counted = results[mode]["bytes_per_step"]
        assert "reduce_scatter" not in counted  # every gradient went through fn's all-to-all
        # the interface count and fn's own count agree; 4 bits + scales: well under 1/4 of fp32
        assert counted["all_to_all"] == results[mode]["fn_bytes_per_step"]
        assert counted["all_to_all"] < 0.25 * dense["reduce_scatter"]
        if mode == "loco+qwz":  # parameters in 8 bits (+ scales): about 1/4 of fp32
            assert counted["all_gather"] < 0.4 * dense["all_gather"]
        else:  # parameters: FSDP2's own all-gather
            assert counted["all_gather"] == dense["all_gather"]
        assert abs(results[mode]["held_out_loss"] / results["dense"]["held_out_loss"] - 1) < 0.05
