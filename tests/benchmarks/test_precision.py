"""benchmarks/precision.py: the 1-bit optimizers trained in bf16 stay close to their fp32 runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from fn.app import _data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "precision.py")
ONEBIT = ("onebit_adam", "zero_one_adam", "onebit_lamb")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
    )


@pytest.mark.timeout(150)
def test_bf16_params_stay_within_3_percent_of_fp32(tmp_path):
    out = tmp_path / "runs.json"
    proc = _run(
        "--quick",
        "--tasks",
        "demo",
        "--precisions",
        "fp32,bf16",
        "--optimizers",
        ",".join(ONEBIT),
        "--json",
        str(out),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    runs = {(r["optimizer"], r["precision"]): r for r in json.loads(out.read_text())["runs"]}
    assert len(runs) == 2 * len(ONEBIT)
    uniform = math.log(_data.VOCAB_SIZE)
    for name in ONEBIT:
        fp32, bf16 = runs[name, "fp32"]["heldout"], runs[name, "bf16"]["heldout"]
        assert fp32 < uniform - 0.4, f"{name} did not learn in fp32 ({fp32:.3f})"
        assert abs(bf16 / fp32 - 1) <= 0.03, f"{name}: bf16 {bf16:.4f} vs fp32 {fp32:.4f}"
        rows = [
            line for line in proc.stdout.splitlines() if line.startswith("| demo | bf16 params")
        ]
        assert any(f"| {name} | {bf16:.4f} |" in line for line in rows), proc.stdout


@pytest.mark.timeout(60)
def test_optimizer_kwargs_the_optimizers_do_not_take_are_refused_before_any_run():
    proc = _run("--quick", "--optimizer-kwargs", '{"no_such_option": "bfloat16"}', timeout=50)
    assert proc.returncode == 2
    assert "no_such_option" in proc.stderr and "runs;" not in proc.stdout
