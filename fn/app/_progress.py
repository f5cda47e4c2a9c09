"""The demo's progress display: a tqdm bar per task, or plain lines where tqdm is not installed.

tqdm comes with the ``app`` extra (``pip install "fn-optim[app]"``). Without it the demo prints
one line per task at most every ``interval`` seconds, and when the task ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

__all__ = ["Progress", "make_progress"]

NOT_TTY_INTERVAL_S = 5.0  # seconds between redraws in a log file or a pipe


class Progress(Protocol):
    def update(self, task: int, name: str, step: int) -> None:
        """Reports that task ``task`` (0-based), called ``name``, has made ``step`` steps."""

    def close(self) -> None:
        """Ends the display."""


@dataclass
class _TqdmProgress:
    """One tqdm bar per task, opened when the task reports its first step."""

    tqdm: type
    stream: TextIO
    tasks: int
    steps: int
    task: int = field(default=-1, init=False)
    bar: Any = field(default=None, init=False)

    def update(self, task: int, name: str, step: int) -> None:
        if self.bar is None or task != self.task:
            self.close()
            self.task = task
            self.bar = self.tqdm(
                total=self.steps,
                desc=f"[{task + 1}/{self.tasks}] {name}",
                unit="step",
                file=self.stream,
                mininterval=0.1 if self.stream.isatty() else NOT_TTY_INTERVAL_S,
                dynamic_ncols=True,
            )
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@dataclass
class _LineProgress:
    """A line ``[task/tasks] name: step/steps steps`` at most every ``interval`` seconds."""

    stream: TextIO
    tasks: int
    steps: int
    interval: float
    last_line: float = field(default=-float("inf"), init=False)

    def update(self, task: int, name: str, step: int) -> None:
        now = time.monotonic()
        if step < self.steps and now - self.last_line < self.interval:
            return
        self.last_line = now
        self.stream.write(f"[{task + 1}/{self.tasks}] {name}: {step}/{self.steps} steps\n")
        self.stream.flush()

    def close(self) -> None:
        pass


def make_progress(
    stream: TextIO, tasks: int, steps: int, *, interval: float = NOT_TTY_INTERVAL_S
) -> Progress:
    """Progress over ``tasks`` tasks of ``steps`` steps each, written to ``stream``.

    Args:
        stream: where to write (normally ``sys.stderr``).
        tasks: the number of tasks (the demo's optimizers).
        steps: steps per task.
        interval: seconds between the plain lines printed when tqdm is not installed.

    Returns:
        A tqdm display, or, without tqdm, plain lines (after a line saying how to get tqdm).
    """
    try:
        from tqdm import tqdm
    except ImportError:
        stream.write('progress as plain lines (for a progress bar: pip install "fn-optim[app]")\n')
        return _LineProgress(stream, tasks, steps, interval)
    return _TqdmProgress(tqdm, stream, tasks, steps)
