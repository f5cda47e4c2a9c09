"""A plain-text progress bar on a stream (no dependency).

On a terminal it is one line, redrawn with ``\\r`` at most every ``refresh`` seconds; otherwise (a
log file, a pipe) it prints a new line at most every ``interval`` seconds and when a task ends.
"""

from __future__ import annotations

import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Progress over ``tasks`` tasks of ``steps`` steps each.

    Args:
        stream: where to write (normally ``sys.stderr``).
        tasks: the number of tasks (the demo's optimizers).
        steps: steps per task.
        interval: seconds between lines when ``stream`` is not a terminal.
        refresh: seconds between redraws on a terminal.
        width: characters of the bar.
    """

    def __init__(
        self,
        stream: TextIO,
        tasks: int,
        steps: int,
        *,
        interval: float = 5.0,
        refresh: float = 0.1,
        width: int = 30,
    ) -> None:
        self.stream = stream
        self.tasks = tasks
        self.steps = steps
        self.width = width
        self.tty = stream.isatty()
        self.interval = refresh if self.tty else interval
        self.start = time.monotonic()
        self.last_draw = -float("inf")
        self.line_len = 0

    def update(self, task: int, name: str, step: int) -> None:
        """Reports that task ``task`` (0-based), called ``name``, has made ``step`` steps."""
        now = time.monotonic()
        finished = step >= self.steps
        if not finished and now - self.last_draw < self.interval:
            return
        self.last_draw = now
        frac = (task * self.steps + step) / (self.tasks * self.steps)
        filled = round(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        line = (
            f"[{task + 1}/{self.tasks}] {name:<14} |{bar}| {step:>{len(str(self.steps))}}/"
            f"{self.steps} steps  {100 * frac:5.1f}%  {now - self.start:6.1f} s"
        )
        if self.tty:
            self.stream.write("\r" + line.ljust(self.line_len))
            self.line_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends the bar's line on a terminal."""
        if self.tty and self.line_len:
            self.stream.write("\n")
            self.stream.flush()
            self.line_len = 0
