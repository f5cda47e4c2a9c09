"""Per-process choice of a kernel setting that changes no result, only the speed.

Some settings of the CPU kernels are best chosen per host: how far ahead a kernel prefetches its
input streams helps on one CPU (whose hardware prefetchers keep too few misses in flight for a
kernel with this much work per cache line) and slows another (whose prefetchers already do, and
whose queues the extra requests crowd). A :class:`Tuner` lets the candidates take turns on the
first large calls of each kind, times them, and keeps the fastest from then on, as cuDNN's
benchmark mode and Triton's autotuner do for theirs. Small calls, which run from the caches, are
neither timed nor tuned: they take the default until a choice is made.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

_V = TypeVar("_V")


class Tuner(Generic[_V]):
    """Chooses one of ``candidates`` per key by timing ``trials`` large calls with each.

    Args:
        candidates: the settings, the default first.
        trials: timed calls per candidate; the least time per element of each counts.
        min_elements: calls on fewer elements are not timed.
    """

    def __init__(self, candidates: Sequence[_V], trials: int = 3, min_elements: int = 1 << 22):
        if not candidates or trials < 1:
            raise ValueError("a Tuner needs at least one candidate and one trial")
        self.candidates = tuple(candidates)
        self.trials = trials
        self.min_elements = min_elements
        self._samples: dict[Hashable, dict[int, list[float]]] = {}
        self._chosen: dict[Hashable, _V] = {}
        self._lock = threading.Lock()
        # A child forked while another thread held the lock would wait on it forever.
        os.register_at_fork(after_in_child=self._reset_lock)

    def _reset_lock(self) -> None:
        self._lock = threading.Lock()

    def pending(self) -> bool:
        """Whether some key has begun but not finished its trials."""
        with self._lock:
            return bool(self._samples)

    def chosen(self, key: Hashable) -> _V | None:
        """The setting kept for ``key``, or ``None`` while the candidates still take turns."""
        return self._chosen.get(key)

    def run(self, key: Hashable, elements: int, call: Callable[[_V], None]) -> None:
        """``call(setting)`` with the setting for ``key``; timed while ``key`` is being tuned
        and the call is large."""
        with self._lock:
            if key in self._chosen or elements < self.min_elements:
                setting, turn = self._chosen.get(key, self.candidates[0]), None
            else:
                samples = self._samples.setdefault(
                    key, {i: [] for i in range(len(self.candidates))}
                )
                turn = min(samples, key=lambda i: len(samples[i]))
                setting = self.candidates[turn]
        if turn is None:
            call(setting)
            return
        start = time.perf_counter()
        call(setting)
        seconds = time.perf_counter() - start
        with self._lock:
            samples = self._samples.get(key)
            if samples is None:  # another thread chose meanwhile
                return
            samples[turn].append(seconds / elements)
            if all(len(s) >= self.trials for s in samples.values()):
                best = min(samples, key=lambda i: min(samples[i]))
                self._chosen[key] = self.candidates[best]
                del self._samples[key]
