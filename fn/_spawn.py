"""Runs a function on real ``torch.distributed`` gloo processes on this machine.

``spawn_gloo(worker_fn, world_size, args, timeout=..., on_message=...)`` starts ``world_size``
processes (the ``spawn`` start method), each joins a gloo group on a free local port and runs
``worker_fn(rank, world_size, send, *args)``; ``send(payload)`` passes a picklable message to the
parent's ``on_message`` while the workers run (the demo's progress). Any exception in a child, a
child that dies, the timeout or Ctrl-C in the parent kills every child and raises in the parent.
The children ignore SIGINT: the parent alone handles Ctrl-C and ends them. On Linux the kernel
also kills them when the parent dies without cleaning up (``kill -9``), so none keeps training.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["WorkerError", "spawn_gloo"]

ERROR_GRACE_S = 2.0
_PR_SET_PDEATHSIG = 1  # prctl(2) option, <linux/prctl.h>


class WorkerError(RuntimeError):
    """A worker process failed, died or timed out."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    """Linux: has the kernel SIGKILL this process when the thread that started it ends (the
    parent's main thread in the demo), even when the parent is killed with SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent was gone before prctl took effect
        os._exit(1)


def _child(
    worker_fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    threads: int,
    messages: Any,
    parent_pid: int,
    args: tuple[Any, ...],
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    try:
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        dist.barrier()  # gloo connects lazily: connect before the timed work starts
        try:
            out = worker_fn(rank, world_size, lambda m: messages.put(("message", rank, m)), *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle: tensors travel by value, not as shared-memory handles that die with the
        # child.
        messages.put(("result", rank, pickle.dumps(out)))
    except BaseException:
        messages.put(("error", rank, traceback.format_exc()))


def spawn_gloo(
    worker_fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    *,
    timeout: float,
    on_message: Callable[[int, Any], None],
    threads: int | None = None,
) -> list[Any]:
    """Runs ``worker_fn(rank, world_size, send, *args)`` on ``world_size`` gloo processes.

    Args:
        worker_fn: a module-level function (it is pickled by name).
        world_size: the number of processes.
        args: picklable arguments, the same for every rank.
        timeout: seconds for the whole run, process start included (also the gloo timeout).
        on_message: called in the parent as ``on_message(rank, payload)`` for every ``send``.
        threads: torch intra-op threads per worker (default: this machine's cores shared
            out, at least 1).

    Returns:
        The workers' return values, indexed by rank.

    Raises:
        WorkerError: a child raised (its traceback is in the message), died, or timed out.
        KeyboardInterrupt: Ctrl-C in the parent (the children are killed first).
    """
    ctx = mp.get_context("spawn")
    messages = ctx.Queue()
    port = _free_port()
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = [
        ctx.Process(
            target=_child,
            args=(worker_fn, rank, world_size, port, timeout, threads, messages, os.getpid(), args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    grace = None  # after a first failure, the others have ERROR_GRACE_S to report theirs
    try:
        for p in procs:
            p.start()
        while len(results) + len(errors) < world_size:
            if grace is not None and time.monotonic() > grace:
                break
            try:
                kind, rank, payload = messages.get(timeout=0.2)
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in results and r not in errors and p.exitcode
                ]
                if dead and not errors:
                    raise WorkerError(f"worker ranks {dead} died without a result") from None
                if time.monotonic() > deadline:
                    raise WorkerError(
                        f"the workers timed out: not finished within {timeout:g} s"
                    ) from None
                continue
            if kind == "message":
                on_message(rank, payload)
            elif kind == "error":
                errors[rank] = payload
                grace = grace or time.monotonic() + ERROR_GRACE_S
            else:
                results[rank] = pickle.loads(payload)
        if errors:
            # Every failure is shown: the first to arrive is often a consequence (a peer's
            # connection closed) of the one that caused it.
            raise WorkerError(
                "\n".join(f"worker rank {r} failed:\n{tb}" for r, tb in sorted(errors.items()))
            )
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(timeout=5)
        messages.close()
    return [results[r] for r in range(world_size)]
