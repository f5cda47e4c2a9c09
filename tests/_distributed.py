"""Runs a function on real ``torch.distributed`` (gloo) processes and returns every rank's result.

``run_distributed(worker_fn, world_size, *args, timeout=120)`` spawns ``world_size`` processes,
each joins a gloo group on a free local port and returns ``worker_fn(rank, world_size, *args)``.
``worker_fn`` must be importable at module level and return something picklable. It is
:func:`fn.app._launch.spawn_gloo` (the demo's launcher) with one intra-op thread per rank: any
exception in a child, a child that dies, or the timeout raises in the parent (a
``RuntimeError``), and every child is killed, also when the parent dies (Linux).
Batch many cases into one call: a launch costs a few seconds.

``torchrun(script, *args)`` runs a script (an example, or a worker that a stack must launch
itself) on 2 gloo ranks under ``torchrun``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fn.app._launch import spawn_gloo

ROOT = Path(__file__).resolve().parents[1]


def _call(rank: int, world_size: int, send: Any, worker_fn: Callable[..., Any], args: tuple) -> Any:
    del send
    return worker_fn(rank, world_size, *args)


def run_distributed(
    worker_fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120
) -> list[Any]:
    """Runs ``worker_fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    Args:
        worker_fn: a module-level function (it is pickled by name).
        world_size: the number of processes.
        *args: picklable arguments, the same for every rank.
        timeout: seconds for the whole run (process start included).

    Returns:
        The results, indexed by rank.

    Raises:
        RuntimeError: a child raised (its traceback is in the message), died, or timed out.
    """
    return spawn_gloo(
        _call,
        world_size,
        (worker_fn, args),
        timeout=timeout,
        on_message=lambda rank, message: None,
        threads=1,
    )


def torchrun(script: Path, *args: str, timeout: float = 240) -> str:
    """Runs ``script args`` under ``torchrun --standalone --nproc-per-node 2``, with the
    worktree on ``PYTHONPATH`` and one intra-op thread per rank.

    Returns:
        Its standard output.

    Raises:
        AssertionError: it failed (with the ends of its output); ``subprocess.TimeoutExpired``
            after ``timeout`` seconds, torchrun and its ranks killed.
    """
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    env.pop("WORLD_SIZE", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(script), *args,
    ]  # fmt: skip
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as run:
        try:
            stdout, stderr = run.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM: torchrun ends its ranks (each in a session of its own), which a SIGKILL
            # of torchrun alone would leave running
            run.terminate()
            try:
                run.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                run.kill()
            raise
    assert run.returncode == 0, stdout[-3000:] + stderr[-6000:]
    return stdout
