"""Tiny runs of benchmarks/fsdp.py: all modes, bytes counted at the interface, and (as root)
the same on rate-limited links between network namespaces."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_benchmark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "fsdp.py"), *args],
        capture_output=True,
        text=True,
        timeout=560,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )


@pytest.mark.timeout(600)
def test_tiny_benchmark_counts_bytes_and_losses(tmp_path):
    out = tmp_path / "fsdp.json"
    tiny = ["--steps", "3", "--layers", "1", "--d-model", "32", "--timeout", "500"]
    proc = _run_benchmark(*tiny, "--json", str(out))
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
    # 1-bit Adam (freeze_step 2): one compressed step after the freeze, counted at the interface
    onebit = results["onebit"]["bytes_per_step"]
    assert "reduce_scatter" not in onebit  # no dense reduce-scatter once compressed
    assert (
        onebit["all_gather"] - dense["all_gather"] + onebit["all_to_all"]
        == (
            results["onebit"]["fn_bytes_per_step"]  # fn's own count: the 1-bit exchange's bytes
        )
    )
    assert results["onebit"]["fn_bytes_per_step"] < 0.1 * dense["reduce_scatter"]
    qwz = results["onebit+qwz"]  # the same 1-bit gradients, the params in 8 bits (+ scales)
    assert qwz["fn_bytes_per_step"] == results["onebit"]["fn_bytes_per_step"]
    assert qwz["bytes_per_step"]["all_gather"] < 0.4 * onebit["all_gather"]
    assert results["ddp+onebit"]["fn_bytes_per_step"] is None
    assert 0 < results["ddp+onebit"]["bytes_per_step"]["all_to_all"] < 0.1 * dense["reduce_scatter"]
    assert "gradient bytes, FSDP2 + fn OnebitAdam / FSDP2 + AdamW reduce-scatter" in proc.stdout
    assert "FSDP2/DDP" in proc.stdout


def _load_benchmark():
    path = os.path.join(ROOT, "benchmarks", "fsdp.py")
    spec = importlib.util.spec_from_file_location("_bench_fsdp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _namespaces_unavailable() -> str | None:
    """Why ``--rate`` cannot run here, or ``None``."""
    if os.geteuid() != 0:
        return "--rate needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"--rate needs iproute2 ({', '.join(missing)} missing)"
    probe = "fnprobe-rate"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "cannot create network namespaces here"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


@pytest.mark.timeout(600)
def test_tiny_benchmark_on_rate_limited_links(tmp_path):
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "fsdp.json"
    tiny = ["--steps", "3", "--warmup", "1", "--layers", "1", "--d-model", "32"]
    links = ["--rate", "1gbit", "--prefix", "fntest", "--subnet", "10.215.0", "--timeout", "400"]
    proc = _run_benchmark(*tiny, *links, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "links at 1gbit" in proc.stdout and "dense/this" in proc.stdout
    assert "dense: step 1/3" in proc.stdout  # rank 0's progress comes through
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "fntest-" not in listed  # the namespaces were removed
    results = json.loads(out.read_text())["rank0"]
    dense = results["dense"]["bytes_per_step"]
    for mode in ("dense", "loco", "qgz", "loco+qwz"):
        assert results[mode]["step_s"] > 0
    for mode in ("loco", "qgz"):  # the same byte counts as over loopback
        assert results[mode]["bytes_per_step"]["all_to_all"] < 0.25 * dense["reduce_scatter"]
        assert results[mode]["bytes_per_step"]["all_gather"] == dense["all_gather"]


def test_rate_needs_root(monkeypatch):
    bench = _load_benchmark()
    monkeypatch.setattr(bench.cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match=r"fsdp.py --rate needs root"):
        bench.main(["--rate", "1gbit"])


def test_rate_needs_iproute2(monkeypatch):
    bench = _load_benchmark()
    monkeypatch.setattr(bench.cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bench.cluster.shutil, "which", lambda tool: None)
    with pytest.raises(SystemExit, match="ip, tc not found"):
        bench.main(["--rate", "1gbit"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rate", "fast"], "--rate"),
        (["--rate", "1gbit", "--prefix", "Bad"], "--prefix"),
        (["--rate", "1gbit", "--subnet", "8.8.8"], "private"),
        (["--steps", "2", "--warmup", "2"], "--warmup"),
        (["--ranks", "1"], "--ranks"),
        (["--steps", "4", "--freeze-step", "4"], "--freeze-step"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        _load_benchmark().parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_tiny_hsdp_benchmark_reads_the_uplinks_of_the_two_level_cluster(tmp_path):
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "hsdp.json"
    tiny = ["--nodes", "2", "--ranks-per-node", "2", "--steps", "4", "--layers", "1"]
    links = ["--rate", "100mbit", "--prefix", "fntesth", "--subnet", "10.216.0", "--timeout", "400"]
    proc = _run_benchmark(*tiny, "--d-model", "32", *links, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "uplinks at 100mbit" in proc.stdout and "across (uplinks)" in proc.stdout
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "fntesth-" not in listed  # the namespaces were removed
    rank0 = json.loads(out.read_text())["rank0"]
    adamw, onebit = rank0["hsdp+adamw"], rank0["hsdp+onebit"]
    # the wire carries the payload counted at the interface, and headers and acknowledgements
    assert adamw["uplinks"] >= adamw["by_kind"]["inter"] > 0
    assert 0 < onebit["uplinks"] < adamw["uplinks"]
    assert rank0["fsdp1d+onebit+qwz"]["uplinks"] > 0
