"""``SerialWorker``: a daemon thread that runs a hook state's bucket work in submission order."""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch


def _serve(tasks: queue.SimpleQueue) -> None:
    while (task := tasks.get()) is not None:
        work, future = task
        try:
            result = work()
        except BaseException as err:  # noqa: BLE001 (delivered to the future's waiter)
            future.set_exception(err)
        else:
            future.set_result(result)
        del task, work, future


class SerialWorker:
    """Runs submitted callables one at a time, in the order submitted, on one daemon thread.

    The thread starts at the first :meth:`submit`, and again in a forked child (which has no copy
    of its parent's thread); it ends when the worker is garbage collected, or with the process
    (daemon). Every rank submits its buckets in DDP's bucket order, so one thread per hook state
    issues its collectives in the same order on every rank.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._pid: int | None = None
        self._tasks: queue.SimpleQueue | None = None
        self._last: torch.futures.Future | None = None

    def submit(self, work: Callable[[], Any]) -> torch.futures.Future:
        """A future of ``work()``'s result, or of the exception it raised."""
        if self._pid != os.getpid():
            self._tasks = queue.SimpleQueue()
            threading.Thread(
                target=_serve, args=(self._tasks,), name=self._name, daemon=True
            ).start()
            weakref.finalize(self, self._tasks.put, None)
            self._pid, self._last = os.getpid(), None
        future: torch.futures.Future = torch.futures.Future()
        self._tasks.put((work, future))
        self._last = future
        return future

    def drain(self) -> None:
        """Waits until everything submitted so far has run (its errors are its futures')."""
        last = self._last
        if last is None or self._pid != os.getpid():
            return
        try:
            last.wait()
        except Exception:  # noqa: BLE001, S110 (the waiter of that future gets the error)
            pass
