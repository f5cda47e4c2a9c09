"""Runs a function on real ``torch.distributed`` gloo processes on this machine.

``spawn_gloo(worker_fn, world_size, args, timeout=..., on_message=...)`` starts ``world_size``
processes with :func:`torch.multiprocessing.start_processes` (the ``spawn`` start method); each
joins a gloo group on a free local port and runs ``worker_fn(rank, world_size, send, *args)``.
``send(payload)`` passes a picklable message to the parent's ``on_message`` while the workers run
(the demo's progress). torch collects the traceback of a child that raises and ends the other
children when one fails; this module adds the free port, the gloo group, the results, one
deadline for the whole run and the handling of Ctrl-C and of the parent's death. The children
ignore SIGINT: the parent alone handles Ctrl-C and kills them. On Linux the kernel also kills
them when the parent dies without cleaning up (``kill -9``), so none keeps training.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import pickle
import queue
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["WorkerError", "spawn_gloo"]

ERROR_GRACE_S = 2.0  # after a first failure, the other ranks have this long to report theirs
POLL_S = 0.2
_PR_SET_PDEATHSIG = 1  # prctl(2) option, <linux/prctl.h>


class WorkerError(RuntimeError):
    """A worker process failed, died or timed out."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    """Linux: has the kernel SIGKILL this process when the thread that started it ends (the
    parent's main thread), even when the parent is killed with SIGKILL."""
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
    rank: int,
    worker_fn: Callable[..., Any],
    world_size: int,
    port: int,
    timeout: float,
    threads: int,
    messages: Any,
    parent_pid: int,
    args: tuple[Any, ...],
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # torch's parent-death signal is SIGINT, which is ignored here and which a rank blocked in a
    # gloo call would not act on: SIGKILL instead.
    _die_with_parent(parent_pid)
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
    # Plain pickle: tensors travel by value, not as shared-memory handles that die with the child.
    messages.put(("result", rank, pickle.dumps(out)))


def _failures(
    context: mp.ProcessContext, err: mp.ProcessRaisedException | mp.ProcessExitedException
) -> str:
    """Every rank's traceback (the first failure to arrive is often a consequence, a peer's
    connection closed, of the one that caused it), or how the first failed rank died."""
    reports = []
    for rank, path in enumerate(context.error_files):
        try:
            with open(path, "rb") as f:
                reports.append(f"worker rank {rank} failed:\n{pickle.load(f)}")
        except (OSError, EOFError, pickle.UnpicklingError):
            continue  # no traceback: the rank did not raise, or was killed while writing it
    return "\n".join(reports) or f"worker rank {err.error_index} died: {err.msg}"


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
    messages = mp.get_context("spawn").Queue()
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    child_args = (
        worker_fn,
        world_size,
        _free_port(),
        timeout,
        threads,
        messages,
        os.getpid(),
        args,
    )
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    context = None
    try:
        context = mp.start_processes(
            _child, child_args, nprocs=world_size, join=False, daemon=True, start_method="spawn"
        )
        while True:
            # Raises when a child failed, once the others had ERROR_GRACE_S to fail too.
            exited = context.join(timeout=0, grace_period=ERROR_GRACE_S)
            if exited and len(results) == world_size:
                break
            if time.monotonic() > deadline:
                raise WorkerError(f"the workers timed out: not finished within {timeout:g} s")
            try:
                kind, rank, payload = messages.get(timeout=POLL_S)
            except queue.Empty:
                if exited:  # every child has exited and flushed its messages
                    missing = sorted(set(range(world_size)) - set(results))
                    raise WorkerError(f"worker ranks {missing} exited without a result") from None
                continue
            if kind == "message":
                on_message(rank, payload)
            else:
                results[rank] = pickle.loads(payload)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
        raise WorkerError(_failures(context, err)) from None
    finally:
        if context is not None:
            # A timeout or Ctrl-C leaves the children running: torch ends them only on a failure.
            for p in context.processes:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
            for path in context.error_files:  # torch leaves the tracebacks' files behind
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        messages.close()
    return [results[r] for r in range(world_size)]
