"""The tests' one runner of process groups: real ``torch.distributed`` (gloo) processes on this
machine, each run bounded by a timeout after which every process of it is killed.

``run_distributed(worker_fn, world_size, *args, timeout=120)`` runs ``worker_fn(rank,
world_size, *args)`` on ``world_size`` processes joined in a gloo group on a free local port and
returns every rank's result. ``worker_fn`` must be importable at module level and return
something picklable. It is :func:`fn.app.launch.spawn_gloo` (the demo's launcher) with one
intra-op thread per rank, its ranks forked from a server that imported torch and fn once (a
launch takes a fraction of a second instead of a few seconds of imports per rank): any exception
in a child, a child that dies, or the timeout raises in the parent (a ``RuntimeError``), and
every child is killed, also when the parent dies (Linux). Batch many cases into one call, in a
module-scoped fixture whose tests each assert on their part of the result, unless a case kills
a rank or leaves the group unusable.

``torchrun(script, *args, nproc=2)`` runs a script (an example, or a worker that a stack must
launch itself) under ``torchrun --standalone``; ``run_command(command, ...)`` runs any command
(``torchrun``, ``python3``, ``bash``) in a session of its own, so that a timeout kills
``torchrun`` and its ranks together; ``rank_env(pythonpath)`` is the environment both give.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fn.app.launch import spawn_gloo

ROOT = Path(__file__).resolve().parents[1]

# What the ranks' server imports before it forks them: what nearly every worker needs, and the
# bulk of each rank's start-up (torch and fn.fsdp: about 3 s on a quiet core, 10 s on a busy
# one). A module missing here is imported by each rank as usual.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "fn",
    "fn.collectives",
    "fn.optim",
    "fn.ddp",
    "fn.fsdp",
    "fn.diloco",
    "pytest",
    "tests._distributed",
]
multiprocessing.set_forkserver_preload(_PRELOAD)


def _call(rank: int, world_size: int, send: Any, worker_fn: Callable[..., Any], args: bytes) -> Any:
    del send
    return worker_fn(rank, world_size, *pickle.loads(args))


def run_distributed(
    worker_fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    start_method: str = "forkserver",
) -> list[Any]:
    """Runs ``worker_fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    Args:
        worker_fn: a module-level function (it is pickled by name).
        world_size: the number of processes.
        *args: picklable arguments, the same for every rank.
        timeout: seconds for the whole run (process start included).
        start_method: ``"forkserver"`` (ranks forked from the preloaded server), or
            ``"spawn"``: each rank a fresh interpreter, for what a fork would change: page
            faults counted in a process whose heap is its own, glibc's ``MALLOC_*`` settings
            (read when a process starts).

    Returns:
        The results, indexed by rank.

    Raises:
        RuntimeError: a child raised (its traceback is in the message), died, or timed out.
    """
    # the arguments as plain pickled bytes: torch's pickler would send each tensor's storage as
    # a file descriptor, and a forkserver takes at most 256 in one start
    return spawn_gloo(
        _call,
        world_size,
        (worker_fn, pickle.dumps(args)),
        timeout=timeout,
        on_message=lambda rank, message: None,
        threads=1,
        start_method=start_method,
    )


def _in_turn(rank: int, world_size: int, parts: dict[str, tuple[Callable[..., Any], tuple]]):
    return {name: fn(rank, world_size, *args) for name, (fn, args) in parts.items()}


def run_together(
    parts: dict[str, tuple[Callable[..., Any], tuple]], world_size: int, *, timeout: float
) -> dict[str, list[Any]]:
    """One launch for several workers that leave the group usable: the ranks run each
    ``worker_fn(rank, world_size, *args)`` of ``parts`` (``{name: (worker_fn, args)}``) in turn.

    Returns:
        ``{name: results by rank}``, for each test of a module-scoped fixture to assert on its
        part.

    Raises:
        RuntimeError: as :func:`run_distributed`; a part that raised is named by its worker in
            the traceback (the parts after it did not run).
    """
    by_rank = run_distributed(_in_turn, world_size, parts, timeout=timeout)
    return {name: [result[name] for result in by_rank] for name in parts}


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended), from ``/proc`` (Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def still_running(pids: list[int], within_s: float) -> list[int]:
    """The processes of ``pids`` still running after waiting up to ``within_s`` seconds for them
    to end."""
    deadline = time.monotonic() + within_s
    while (running := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


def rank_env(pythonpath: str) -> dict[str, str]:
    """This environment for a launched command: this interpreter's ``python3`` and ``torchrun``
    first on ``PATH``, ``pythonpath`` as ``PYTHONPATH``, the CPU only, one intra-op thread per
    process, and no launcher's variables (a ``torchrun`` inside decides them)."""
    env = dict(
        os.environ,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        PYTHONPATH=pythonpath,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
    )
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_command(
    command: Sequence[str],
    *,
    env: dict[str, str],
    timeout: float,
    cwd: Path | str | None = None,
    merge_stderr: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Runs ``command`` in a session of its own and waits for it; its exit status is the
    caller's to judge.

    Args:
        command: the words; ``python``/``python3`` first is this interpreter.
        env: its environment (:func:`rank_env`).
        timeout: seconds; past them the whole process group (``torchrun`` and its ranks, a
            shell and what it started) is killed.
        cwd: its working directory (default: this one).
        merge_stderr: standard error into standard output, interleaved.

    Returns:
        The finished process, with its output as text.

    Raises:
        AssertionError: it ran past ``timeout``, with the ends of its output.
    """
    words = list(command)
    if words[0] in ("python", "python3"):
        words[0] = sys.executable
    process = subprocess.Popen(
        words,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,  # a timeout stops torchrun's ranks too
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        message = f"{shlex.join(command)}: timed out after {timeout:g} s\n"
        raise AssertionError(message + out[-4000:] + (err or "")[-4000:]) from None
    return subprocess.CompletedProcess(words, process.returncode, out, err)


def torchrun(
    script: Path | str,
    *args: str,
    nproc: int = 2,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
) -> str:
    """Runs ``script args`` under ``torchrun --standalone --nproc-per-node nproc`` (gloo, one
    intra-op thread per rank, the worktree on ``PYTHONPATH`` unless ``env`` says otherwise).

    Returns:
        Its standard output.

    Raises:
        AssertionError: it failed, or ran past ``timeout`` seconds (torchrun and its ranks
            are then killed), with the ends of its output.
    """
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
        str(nproc), str(script), *args,
    ]  # fmt: skip
    if env is None:
        env = rank_env(os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = run_command(command, env=env, timeout=timeout, cwd=cwd)
    ends = done.stdout[-3000:] + done.stderr[-6000:]
    assert done.returncode == 0, f"{shlex.join(command)}: exit status {done.returncode}\n{ends}"
    return done.stdout
