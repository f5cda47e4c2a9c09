"""The demo's process launcher (fn.app.launch): failures, Ctrl-C and a killed parent end every
worker."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

import pytest
import torch
import torch.distributed

from fn.app import launch
from fn.app.launch import WorkerError, spawn_gloo
from tests._distributed import alive, still_running
from tests.app import ROOT, cli


def _fail_on_rank_1(rank, world_size, send):
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    time.sleep(600)  # only the parent's kill ends rank 0 in time


@pytest.mark.timeout(60)
def test_a_failing_worker_raises_and_the_others_are_killed():
    with pytest.raises(WorkerError, match="rank 1 gives up"):
        spawn_gloo(_fail_on_rank_1, 2, (), timeout=40, on_message=lambda *a: None)
    assert not [p for p in _children(os.getpid()) if _is_worker(p)]


def _killed_on_rank_1(rank, world_size, send):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


@pytest.mark.timeout(60)
def test_a_killed_worker_raises_and_the_others_are_killed():
    with pytest.raises(WorkerError, match="worker rank 1 died: .*signal SIGKILL"):
        spawn_gloo(_killed_on_rank_1, 2, (), timeout=40, on_message=lambda *a: None)
    assert not [p for p in _children(os.getpid()) if _is_worker(p)]


def _aborts_on_rank_1(rank, world_size, send):
    if rank == 1:
        os.abort()  # as a heap corruption found by the C library ends a process
    time.sleep(600)


@pytest.mark.timeout(60)
def test_a_crashed_worker_is_named_with_its_python_stack():
    with pytest.raises(WorkerError) as info:
        spawn_gloo(_aborts_on_rank_1, 2, (), timeout=40, on_message=lambda *a: None)
    assert info.value.ranks == [1] and info.value.died
    message = str(info.value)
    assert re.search(r"worker rank 1 died: .*SIGABRT", message), message
    assert "its Python stacks at the signal" in message and "_aborts_on_rank_1" in message


def _killed_while_rank_0_waits(rank, world_size, send):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.distributed.all_reduce(torch.zeros(1))  # fails when rank 1's connection closes
    time.sleep(600)


@pytest.mark.timeout(90)
def test_a_killed_worker_is_named_before_the_errors_it_caused():
    with pytest.raises(WorkerError) as info:
        spawn_gloo(_killed_while_rank_0_waits, 2, (), timeout=60, on_message=lambda *a: None)
    err = info.value
    assert err.ranks == [1] and err.died and not err.timed_out
    assert str(err).startswith("worker rank 1 died: killed by signal SIGKILL")
    if 0 in err.tracebacks:  # rank 0's own error, a lost connection, comes after, as such
        assert "as a consequence" in str(err)


def _stalls_on_rank_1(rank, world_size, send):
    if rank == 1:
        time.sleep(600)  # stalled outside any collective
    torch.distributed.all_reduce(torch.zeros(1))


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="stacks are dumped on SIGUSR1")
@pytest.mark.timeout(90)
def test_a_timeout_names_the_stalled_worker():
    with pytest.raises(WorkerError) as info:
        spawn_gloo(_stalls_on_rank_1, 2, (), timeout=30, on_message=lambda *a: None)
    err = info.value
    assert err.timed_out and not err.died and err.ranks == [1]
    stopped = re.search(r"not finished within 30 s \(stopped after ([\d.]+) s\)", str(err))
    assert stopped and 30 <= float(stopped[1]) < 40
    assert "worker rank(s) [1] stalled outside any collective" in str(err)
    assert "_stalls_on_rank_1" in str(err)  # where it stalled
    assert not [p for p in _children(os.getpid()) if _is_worker(p)]


def _leaves_a_thread_in_a_collective(rank, world_size, send):
    group = torch.distributed.new_group([0, 1])
    tensor = torch.ones(1 << 22)

    def all_reduce_repeatedly():
        for _ in range(50):
            torch.distributed.all_reduce(tensor, group=group)

    threading.Thread(target=all_reduce_repeatedly, daemon=True).start()
    return rank


@pytest.mark.timeout(90)
def test_a_finished_worker_is_not_failed_by_its_teardown():
    # gloo work still in flight at interpreter exit aborts the process (SIGABRT); the result
    # was sent before, so the run succeeds
    for _ in range(2):
        results = spawn_gloo(
            _leaves_a_thread_in_a_collective, 2, (), timeout=60, on_message=lambda *a: None
        )
        assert results == [0, 1]


def _returns_rank(rank, world_size, send):
    return rank


@pytest.mark.timeout(90)
def test_the_rendezvous_port_is_held_before_any_worker_starts(monkeypatch):
    # a port picked free, released and bound later by rank 0 can be taken in between
    # (EADDRINUSE under parallel tests): the launcher must hold it from the start
    start_processes = launch.mp.start_processes
    bind_errors = []

    def check_port_then_start(fn, args, **kwargs):
        port = args[2]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as err:
                bind_errors.append(err.errno)
        return start_processes(fn, args, **kwargs)

    monkeypatch.setattr(launch.mp, "start_processes", check_port_then_start)
    assert spawn_gloo(_returns_rank, 2, (), timeout=60, on_message=lambda *a: None) == [0, 1]
    assert bind_errors == [errno.EADDRINUSE]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _is_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"spawn_main" in cmdline and b"resource_tracker" not in cmdline


def _read_until(stream: TextIO, marker: str) -> None:
    """Reads ``stream`` until ``marker`` was read (a progress bar redraws without a newline)."""
    seen = ""
    while marker not in seen:
        char = stream.read(1)
        assert char, f"the output ended before {marker!r}: {seen!r}"
        seen += char


def _start_training_demo(
    tmp_path: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, list[int]]:
    """A long demo run, returned once its two gloo workers are training."""
    proc = subprocess.Popen(
        cli("demo", "--steps", "100000", "--optimizers", "adam", "--out", str(tmp_path)),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a shell that starts pytest in the background without job control
        # makes it ignore SIGINT, and a child inherits that (Python then keeps it ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    _read_until(proc.stderr, "starting 2 gloo worker processes")
    _read_until(proc.stderr, "[1/1] adam")  # the workers are training
    workers = [p for p in _children(proc.pid) if _is_worker(p)]
    assert len(workers) == 2
    return proc, workers


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes through /proc")
@pytest.mark.timeout(300)  # the demo starts 3 interpreters first: slow on a busy machine
@pytest.mark.parametrize(
    "sent, code, said",
    [
        (signal.SIGINT, 130, "interrupted: the workers were stopped"),  # Ctrl-C
        # timeout(1), docker stop, a job scheduler: to the demo's process only
        (signal.SIGTERM, 143, "terminated (SIGTERM): the workers were stopped"),
    ],
)
def test_ctrl_c_and_sigterm_stop_the_workers_and_leave_no_files(sent, code, said, tmp_path):
    temp = tmp_path / "tmp"  # where the launcher's stack files go
    temp.mkdir()
    proc, workers = _start_training_demo(tmp_path / "out", {**os.environ, "TMPDIR": str(temp)})
    try:
        assert len(list(temp.glob("fn-stacks-*"))) == 1
        proc.send_signal(sent)
        assert proc.wait(timeout=30) == code
        err = proc.stderr.read()  # to its end: the resource tracker's warnings too
        assert said in err and "Traceback" not in err and "leaked" not in err
        assert not [p for p in workers if alive(p)]
        assert not list(temp.glob("fn-stacks-*"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(300)  # the demo starts 3 interpreters first: slow on a busy machine
def test_workers_die_with_a_killed_demo(tmp_path):
    proc, workers = _start_training_demo(tmp_path)
    try:
        proc.kill()  # no cleanup runs in the parent: the kernel must end the workers
        proc.wait(timeout=30)
        assert not still_running(workers, 20)
    finally:
        for p in still_running(workers, 0):
            os.kill(p, signal.SIGKILL)
