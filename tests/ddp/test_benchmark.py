"""Smoke tests of benchmarks/ddp.py: tiny runs (never timings), their bytes in the right order."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BARE = "fn OnebitAdam (no DDP)"
REGISTERED = "DDP + fn.ddp.register(OnebitAdam)"
TRAINER = "Trainer + attach(OnebitAdam)"
ACCELERATE = "Accelerate + attach(OnebitAdam)"
DENSE = "DDP + AdamW (dense)"
HOOKS = ("DDP + AdamW + onebit_hook", "DDP + AdamW + loco_hook (4 bit)")
INSIDE = "DDP + AdamW + onebit_hook (no overlap)"
STACKS_MISSING = [
    name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None
]


def run_benchmark(tmp_path, setups: list[str]) -> tuple[dict, str]:
    """``({setup: row}, stdout)`` of a tiny run of ``setups``."""
    out = tmp_path / "ddp.json"
    args = ["--width", "32", "--layers", "2", "--steps", "6", "--freeze", "3", "--json", str(out)]
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ddp.py"), *args, "--setups", *setups],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert run.returncode == 0, run.stderr
    results = {row["setup"]: row for row in json.loads(out.read_text())["results"]}
    assert list(results) == [BARE, *(s for s in setups if s != BARE)]
    assert all(setup in run.stdout for setup in results)
    return results, run.stdout


def compressed(row: dict) -> int:
    return row["total"] - row["warmup"]


@pytest.mark.timeout(300)
def test_ddp_benchmark_smoke(tmp_path):
    results, _ = run_benchmark(tmp_path, [BARE, REGISTERED, DENSE, HOOKS[0], INSIDE, HOOKS[1]])
    bare, registered, dense = results[BARE], results[REGISTERED], results[DENSE]
    # a step time for every plain-loop setup; overlap changes when bytes go, not how many
    assert all(row["step_s"] > 0 for row in results.values())
    assert compressed(results[INSIDE]) <= 1.05 * compressed(results[HOOKS[0]])
    assert compressed(results[HOOKS[0]]) <= 1.05 * compressed(results[INSIDE])
    # compressed steps: DDP adds nothing to fn's 1-bit traffic; dense sends ~ 32x more
    assert compressed(registered) <= 1.05 * compressed(bare)
    assert compressed(dense) > 4 * compressed(bare)
    for setup in HOOKS:
        assert compressed(results[setup]) < 0.5 * compressed(dense), setup
    assert bare["fn_counter"] > 0 and dense["fn_counter"] is None


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    bool(STACKS_MISSING), reason=f"the integrations extra is missing: {STACKS_MISSING}"
)
def test_ddp_benchmark_stacks_smoke(tmp_path):
    results, _ = run_benchmark(tmp_path, [TRAINER, ACCELERATE, DENSE])
    bare, dense = results[BARE], results[DENSE]
    # Accelerate's loop sends what the bare loop sends; Trainer adds a small allreduce per step
    # (DDP's find_unused_parameters), far from the dense gradients DDP would send unsilenced
    assert compressed(results[ACCELERATE]) <= 1.05 * compressed(bare)
    assert compressed(results[TRAINER]) < 0.5 * compressed(dense)
    for setup in (TRAINER, ACCELERATE):
        assert results[setup]["warmup"] <= 1.5 * dense["warmup"], setup  # DDP averages once
    # fn.ddp.register in both: fn's own collectives are the same
    assert 0 < results[TRAINER]["fn_counter"] == results[ACCELERATE]["fn_counter"]
