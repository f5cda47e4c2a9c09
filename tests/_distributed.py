"""Runs a function on real ``torch.distributed`` (gloo) processes and returns every rank's result.

``run_distributed(worker_fn, world_size, *args, timeout=120)`` spawns ``world_size`` processes,
each joins a gloo group on a free local port and returns ``worker_fn(rank, world_size, *args)``.
``worker_fn`` must be importable at module level and return something picklable. It is
:func:`fn.app._launch.spawn_gloo` (the demo's launcher) with one intra-op thread per rank: any
exception in a child, a child that dies, or the timeout raises in the parent (a
``RuntimeError``), and every child is killed, also when the parent dies (Linux).
Batch many cases into one call: a launch costs a few seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fn.app._launch import spawn_gloo


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
