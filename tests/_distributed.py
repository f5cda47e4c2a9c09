"""Runs a function on real ``torch.distributed`` (gloo) processes and returns every rank's result.

``run_distributed(worker_fn, world_size, *args, timeout=120)`` spawns ``world_size`` processes,
each joins a gloo group on a free local port and returns ``worker_fn(rank, world_size, *args)``.
``worker_fn`` must be importable at module level and return something picklable. Any exception in
a child, a child that dies, or the timeout raises in the parent, and every child is killed; on
Linux a child also dies with the parent (a killed pytest leaves no rank behind).
Batch many cases into one call: a launch costs a few seconds.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    worker_fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    results: mp.Queue,
    parent_pid: int,
    args: tuple[Any, ...],
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from fn._spawn import die_with_parent

    die_with_parent(parent_pid)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            out = worker_fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle: tensors travel by value, not through shared-memory handles that die
        # with the child.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _failures(rank: int, payload: str, results: mp.Queue, grace: float = 3.0) -> str:
    """The first failure plus any other rank's that arrives within ``grace`` seconds (the first
    to report is often a peer that lost its connection, not the rank that broke)."""
    messages = [f"rank {rank} failed:\n{payload}"]
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            other, ok, text = results.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if not ok:
            messages.append(f"rank {other} failed:\n{text}")
    return "\n".join(messages)


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
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(worker_fn, rank, world_size, port, timeout, results, os.getpid(), args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    try:
        while len(outputs) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode]
                if dead:
                    raise RuntimeError(f"ranks {dead} died without a result") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"run_distributed timed out after {timeout} s; results from ranks "
                        f"{sorted(outputs)}"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(_failures(rank, payload, results))
            outputs[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [outputs[r] for r in range(world_size)]
