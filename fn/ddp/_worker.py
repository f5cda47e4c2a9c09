"""``SerialWorker``: one background thread that runs a hook state's bucket work in order."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch


def _unwrap(future: torch.futures.Future) -> Any:
    # Raised in a ``then`` callback, the error completes the chained future with an error that
    # C++ waiters (DDP's reducer) see too; ``Future.set_exception`` is seen by Python only.
    result, error = future.value()
    if error is not None:
        raise error
    return result


def _settle(work: Callable[[], Any], outcome: torch.futures.Future) -> None:
    try:
        result = (work(), None)
    except Exception as err:  # noqa: BLE001 (delivered to the future's waiter)
        result = (None, err)
    outcome.set_result(result)


class SerialWorker:
    """Runs submitted callables one at a time, in the order submitted, on one thread.

    A single-thread ``ThreadPoolExecutor``, started at the first :meth:`submit` and again in a
    forked child (which has no copy of its parent's thread). Its thread ends when the worker is
    garbage collected, and at the interpreter's exit after the work already submitted. Every
    rank submits its buckets in DDP's bucket order, so one thread per hook state issues its
    collectives in the same order on every rank.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._pid: int | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._last: torch.futures.Future | None = None

    def submit(self, work: Callable[[], Any]) -> torch.futures.Future:
        """A future of ``work()``'s result; when ``work`` raises, waiting raises a
        ``RuntimeError`` naming its error (in Python and in C++, e.g. in DDP's reducer)."""
        if self._pid != os.getpid():
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            self._pid, self._last = os.getpid(), None
        outcome: torch.futures.Future = torch.futures.Future()
        self._executor.submit(_settle, work, outcome)
        self._last = outcome
        return outcome.then(_unwrap)

    def drain(self) -> None:
        """Waits until everything submitted so far has run (its errors are its futures')."""
        if self._last is not None and self._pid == os.getpid():
            self._last.wait()
