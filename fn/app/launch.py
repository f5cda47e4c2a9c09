"""Runs a function on real ``torch.distributed`` gloo processes on this machine.

``spawn_gloo(worker_fn, world_size, args, timeout=..., on_message=...)`` starts ``world_size``
processes with :func:`torch.multiprocessing.start_processes` (the ``spawn`` start method, or
``forkserver`` for many short launches: see ``spawn_gloo``); each joins a gloo group and runs
``worker_fn(rank, world_size, send, *args)``. The group meets at a ``TCPStore`` that the parent
serves on a port the kernel picks and holds for the whole run: no port is chosen, released and
bound again, so two launches at once cannot take the same one.
``send(payload)`` passes a picklable message to the parent's ``on_message`` while the workers run
(the demo's progress). torch collects the traceback of a child that raises and ends the other
children when one fails; this module adds the rendezvous, the gloo group, the results, one
deadline for the whole run and the handling of Ctrl-C and of the parent's death. The children
ignore SIGINT: the parent alone handles Ctrl-C and kills them. On Linux the kernel also kills
them when the parent dies without cleaning up (``kill -9``), so none keeps training.

A failure names the rank that caused it: a rank that died without an error of its own (killed,
out of memory) comes first, as the errors of its peers (a closed connection) are consequences;
where a fatal signal ended it (a crash, an abort), its Python stacks at that moment follow.
On a timeout each rank dumps its Python stack (``faulthandler`` on ``SIGUSR1``, where the
platform has it): a rank that is not inside a ``torch.distributed`` call is named as the one
the others wait for.

A child ends with :func:`fn.collectives.exit_distributed` once its result has reached the
parent: its atexit handlers run, interpreter finalization does not. In a process that used gloo
finalization can abort (SIGABRT) while torch's C++ threads still hold tensors; skipping it keeps
a finished run from being reported as a dead rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import os
import pickle
import queue
import select
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fn.collectives import exit_distributed

__all__ = ["WorkerError", "spawn_gloo"]

ERROR_GRACE_S = 2.0  # after a first failure, the other ranks have this long to report theirs
POLL_S = 0.2
_HOST = "127.0.0.1"
STACK_WAIT_S = 1.0  # how long the ranks have to dump their stacks on a timeout
_PR_SET_PDEATHSIG = 1  # prctl(2) option, <linux/prctl.h>
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # None on Windows
_COLLECTIVE_FRAME = "torch/distributed/"


class WorkerError(RuntimeError):
    """A worker process failed, died or timed out.

    Attributes:
        ranks: the ranks named as the cause (a rank that died, raised, or stalled).
        died: whether a rank died without an error of its own (a signal or an exit code).
        timed_out: whether the run ran past its timeout.
        tracebacks: ``{rank: traceback}`` of the ranks that raised.
    """

    def __init__(
        self,
        message: str,
        ranks: list[int],
        *,
        died: bool = False,
        timed_out: bool = False,
        tracebacks: dict[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.died = died
        self.timed_out = timed_out
        self.tracebacks = dict(tracebacks or {})


def _serve_store(timeout: float) -> dist.TCPStore:
    """The rendezvous the workers meet at: a ``TCPStore`` on ``127.0.0.1``, bound to a port the
    kernel picks (``.port``) and held until it is garbage collected."""
    return dist.TCPStore(
        _HOST,
        0,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _die_with_parent(launcher_pid: int) -> None:
    """Linux: has the kernel SIGKILL this process when the thread that started it ends (the
    launcher's main thread, or the fork server's), even when the launcher is killed with
    SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()  # the launcher, or under ``forkserver`` the fork server
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    # the parent, or the launcher, was gone before prctl took effect
    if os.getppid() != parent or not _alive(launcher_pid):
        os._exit(1)


def _die_with_launcher(launcher_pid: int) -> None:
    """Under ``forkserver``: a thread that SIGKILLs this process when the launcher ends. The
    parent-death signal is not enough there: the parent is the fork server, which its children
    keep running (they hold its "alive" pipe) after the launcher died."""
    try:
        launcher = os.pidfd_open(launcher_pid)  # Linux 5.3: readable once the launcher ended
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):  # no pidfd here: look every POLL_S
        launcher = None

    def watch() -> None:
        if launcher is not None:
            select.select([launcher], [], [])
        else:
            while _alive(launcher_pid):
                time.sleep(POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="fn-watch-launcher", daemon=True).start()


def _stack_file(stacks: Path, rank: int, *, fatal: bool) -> Path:
    """Where ``rank`` writes its Python stacks: at a fatal signal, or on the timeout's signal."""
    return stacks / (f"rank{rank}-fatal.txt" if fatal else f"rank{rank}.txt")


def _child(
    rank: int,
    worker_fn: Callable[..., Any],
    world_size: int,
    port: int,
    timeout: float,
    threads: int,
    messages: Any,
    launcher_pid: int,
    stacks: str,
    environ: dict[str, str] | None,
    args: tuple[Any, ...],
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if environ is not None:  # forked from a server started earlier: the launcher's variables
        os.environ.clear()
        os.environ.update(environ)
    # kept open for the process's life: faulthandler writes to their file descriptors
    fatal_file = open(_stack_file(Path(stacks), rank, fatal=True), "w")  # noqa: SIM115
    faulthandler.enable(file=fatal_file, all_threads=True)  # SIGSEGV, SIGABRT, ...: the stacks
    if _STACK_SIGNAL is not None:
        stack_file = open(_stack_file(Path(stacks), rank, fatal=False), "w")  # noqa: SIM115
        faulthandler.register(_STACK_SIGNAL, file=stack_file, all_threads=False)
    # torch's parent-death signal is SIGINT, which is ignored here and which a rank blocked in a
    # gloo call would not act on: SIGKILL instead.
    _die_with_parent(launcher_pid)
    if environ is not None:
        _die_with_launcher(launcher_pid)
    torch.set_num_threads(threads)
    deadline = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=deadline)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=deadline)
    dist.barrier()  # gloo connects lazily: connect before the timed work starts
    try:
        out = worker_fn(rank, world_size, lambda m: messages.put(("message", rank, m)), *args)
    finally:
        dist.destroy_process_group()
    # Plain pickle: tensors travel by value, not as shared-memory handles that die with the child.
    messages.put(("result", rank, pickle.dumps(out)))
    messages.close()
    messages.join_thread()  # the result has reached the pipe
    exit_distributed()


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _failure(context: mp.ProcessContext, exits: dict[int, int], stacks: Path) -> WorkerError:
    """The error for a failed run: every rank's traceback, led by the ranks that died without
    one (their peers' errors, a closed connection, are then consequences), with the Python
    stacks a fatal signal (a crash, an abort) left of them.

    Args:
        context: the workers.
        exits: ``{rank: exit code}`` of the ranks seen exiting before torch ended the others.
        stacks: the folder of the ranks' stack files.
    """
    tracebacks = {}
    for rank, path in enumerate(context.error_files):
        try:
            with open(path, "rb") as f:
                tracebacks[rank] = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue  # no traceback: the rank did not raise, or was killed while writing it
    died = {r: code for r, code in sorted(exits.items()) if code != 0 and r not in tracebacks}
    lines = []
    for r, code in died.items():
        lines.append(f"worker rank {r} died: {_describe_exit(code)}, without an error of its own")
        with contextlib.suppress(OSError):
            if fatal := _stack_file(stacks, r, fatal=True).read_text().strip():
                lines.append(f"its Python stacks at the signal:\n{fatal}")
    if died and tracebacks:
        lines.append("the other ranks failed after it (probably as a consequence):")
    lines += [f"worker rank {r} failed:\n{tb}" for r, tb in sorted(tracebacks.items())]
    message = "\n".join(lines) or "the workers failed without a traceback"
    causes = list(died) or sorted(tracebacks)
    return WorkerError(message, causes, died=bool(died), tracebacks=tracebacks)


def _timed_out(
    context: mp.ProcessContext, done: set[int], stacks: Path, timeout: float, started: float
):
    """The error for a run past its deadline (``timeout`` seconds after ``started`` on the
    ``time.monotonic`` clock): names the ranks that had not finished and, from their stacks,
    the one(s) not waiting inside a ``torch.distributed`` call."""
    running = [r for r, p in enumerate(context.processes) if p.is_alive() and r not in done]
    if _STACK_SIGNAL is not None:
        for r in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(context.processes[r].pid, _STACK_SIGNAL)
        time.sleep(STACK_WAIT_S)
    frames = {}
    for r in running:
        with contextlib.suppress(OSError):
            frames[r] = _stack_file(stacks, r, fatal=False).read_text()
    waiting = [r for r in running if _COLLECTIVE_FRAME in frames.get(r, "")]
    stalled = [r for r in running if r in frames and frames[r] and r not in waiting]
    message = (
        f"the workers timed out: not finished within {timeout:g} s (stopped after "
        f"{time.monotonic() - started:.1f} s); "
    )
    if waiting and stalled:
        where = frames[stalled[0]].strip().splitlines()
        message += (
            f"worker rank(s) {stalled} stalled outside any collective while rank(s) {waiting} "
            f"waited for them in one; rank {stalled[0]} was at: {' <- '.join(where[1:4])}"
        )
        return WorkerError(message, stalled, timed_out=True)
    message += f"worker rank(s) {running} had not finished"
    return WorkerError(message, running, timed_out=True)


def spawn_gloo(
    worker_fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    *,
    timeout: float,
    on_message: Callable[[int, Any], None],
    threads: int | None = None,
    start_method: str = "spawn",
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
        start_method: ``"spawn"``, a fresh interpreter per worker that imports torch (a few
            seconds), or ``"forkserver"``: workers forked from a server process started at the
            first such launch, which imports the modules named by
            :func:`multiprocessing.set_forkserver_preload` once (a launch then takes a fraction
            of a second: for many short runs, as the tests make). The workers get the
            launcher's environment variables as they are at the launch either way.

    Returns:
        The workers' return values, indexed by rank.

    Raises:
        WorkerError: a child raised (its traceback is in the message), died, or timed out; the
            message and ``ranks`` name the rank(s) that caused it.
        KeyboardInterrupt: Ctrl-C in the parent (the children are killed first).
    """
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', not {start_method!r}")
    messages = mp.get_context(start_method).Queue()
    stacks = tempfile.TemporaryDirectory(prefix="fn-stacks-")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    store = _serve_store(timeout)
    child_args = (
        worker_fn,
        world_size,
        store.port,
        timeout,
        threads,
        messages,
        os.getpid(),
        stacks.name,
        dict(os.environ) if start_method == "forkserver" else None,
        args,
    )
    started = time.monotonic()
    results: dict[int, Any] = {}
    exits: dict[int, int] = {}  # exit codes as first seen, before torch ends the other ranks
    context = None
    try:
        context = mp.start_processes(
            _child,
            child_args,
            nprocs=world_size,
            join=False,
            daemon=True,
            start_method=start_method,
        )
        _collect(context, messages, on_message, results, exits, (started, timeout, stacks.name))
    except mp.ProcessExitedException as err:
        # torch saw this rank's exit first, maybe between our look at the exit codes and its own
        exits.setdefault(err.error_index, err.exit_code)
        raise _failure(context, exits, Path(stacks.name)) from None
    except mp.ProcessRaisedException:
        raise _failure(context, exits, Path(stacks.name)) from None
    finally:
        if context is not None:
            _stop(context)
        messages.close()
        stacks.cleanup()
    return [results[r] for r in range(world_size)]


def _collect(
    context: Any,
    messages: Any,
    on_message: Callable[[int, Any], None],
    results: dict[int, Any],
    exits: dict[int, int],
    clock: tuple[float, float, str],
) -> None:
    """Hands the children's messages to ``on_message`` and their results to ``results`` until
    every child has returned one; records each exit code as first seen in ``exits`` (before
    torch ends the other ranks). ``clock``: the start, the timeout and the stacks' folder."""
    started, timeout, stacks = clock
    world_size = len(context.processes)
    while True:
        for rank, process in enumerate(context.processes):
            if rank not in exits and process.exitcode is not None:
                exits[rank] = process.exitcode
        # Raises when a child failed, once the others had ERROR_GRACE_S to fail too.
        exited = context.join(timeout=0, grace_period=ERROR_GRACE_S)
        if exited and len(results) == world_size:
            return
        if time.monotonic() > started + timeout:
            raise _timed_out(context, set(results), Path(stacks), timeout, started)
        try:
            kind, rank, payload = messages.get(timeout=POLL_S)
        except queue.Empty:
            if exited:  # every child has exited and flushed its messages
                missing = sorted(set(range(world_size)) - set(results))
                raise WorkerError(
                    f"worker ranks {missing} exited without a result", missing
                ) from None
            continue
        if kind == "message":
            on_message(rank, payload)
        else:
            results[rank] = pickle.loads(payload)


def _stop(context: Any) -> None:
    """Kills the children still running (a timeout or Ctrl-C leaves them: torch ends them only
    on a failure) and removes the traceback files torch leaves behind."""
    for p in context.processes:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    for path in context.error_files:
        Path(path).unlink(missing_ok=True)
