"""tests/_distributed.py itself: results by rank, failures and hangs raise in the parent; the
ranks forked from the preloaded server get the launcher's environment as it is at the launch
and die with a launcher killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._distributed import ROOT, rank_env, run_distributed, still_running

pytestmark = pytest.mark.distributed


def _echo_or_fail(rank, world_size, mode):
    import torch
    import torch.distributed as dist

    if mode == "fail" and rank == 1:
        raise KeyError("rank one broke")
    if mode == "hang" and rank == 0:
        time.sleep(600)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, world_size, float(total)


@pytest.mark.timeout(120)
def test_results_failures_and_hangs():
    assert run_distributed(_echo_or_fail, 2, "ok", timeout=60) == [(0, 2, 1.0), (1, 2, 1.0)]
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*rank one broke"):
        run_distributed(_echo_or_fail, 2, "fail", timeout=60)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        run_distributed(_echo_or_fail, 2, "hang", timeout=10)
    # the timeout ends the run, not the hang's 600 s: the margin is for a loaded machine's
    # process starts and kills (above 40 s seen under load)
    assert time.monotonic() - start < 90


def _environment(rank, world_size, name):
    import torch

    return os.environ.get(name), torch.get_num_threads()


@pytest.mark.timeout(120)
def test_the_ranks_get_the_environment_of_the_launch(monkeypatch):
    run_distributed(_echo_or_fail, 2, "ok", timeout=60)  # the ranks' server is running
    monkeypatch.setenv("FN_TEST_SET_AFTER_THE_SERVER", "late")
    assert run_distributed(_environment, 2, "FN_TEST_SET_AFTER_THE_SERVER", timeout=60) == [
        ("late", 1),
        ("late", 1),
    ]


def _write_pid_and_sleep(rank, world_size, folder):
    (Path(folder) / f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(360)
def test_the_ranks_die_with_a_killed_launcher(tmp_path):
    code = (
        "from tests._distributed import run_distributed\n"
        "from tests.collectives.test_distributed_helper import _write_pid_and_sleep\n"
        f"run_distributed(_write_pid_and_sleep, 2, {str(tmp_path)!r}, timeout=300)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=rank_env(str(ROOT)))
    pids = []
    try:
        deadline = time.monotonic() + 240  # a fresh launcher starts its server: imports
        while len(pids) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
            pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid") if p.read_text()]
        assert len(pids) == 2, launcher.poll()
        launcher.send_signal(signal.SIGKILL)  # no cleanup runs in it: the kernel ends the ranks
        launcher.wait(timeout=30)
        assert not still_running(pids, 30)
    finally:
        launcher.kill()
        for pid in still_running(pids, 0):
            os.kill(pid, signal.SIGKILL)
