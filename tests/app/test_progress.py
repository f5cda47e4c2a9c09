"""The demo's progress display: tqdm where installed (the ``app`` extra), plain lines without."""

from __future__ import annotations

import io
import sys

import pytest

from fn.app._progress import make_progress


def _run(progress, tasks=2, steps=4):
    for task in range(tasks):
        for step in range(1, steps + 1):
            progress.update(task, f"opt{task}", step)
    progress.close()


class _Tty(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream", [io.StringIO(), _Tty()], ids=["log", "tty"])
def test_one_tqdm_bar_per_task(stream):
    pytest.importorskip("tqdm")
    _run(make_progress(stream, tasks=2, steps=4))
    text = stream.getvalue()
    # Each bar is redrawn after "\r" and ends its line when its task ends.
    first, second = (line.rsplit("\r", 1)[-1] for line in text.split("\n")[:-1])
    assert text.endswith("\n") and text.count("\n") == 2
    assert "[1/2] opt0" in first and "4/4" in first and "100%" in first
    assert "[2/2] opt1" in second and "4/4" in second


def test_plain_lines_without_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # importing it now fails
    every, sparse = io.StringIO(), io.StringIO()
    _run(make_progress(every, tasks=2, steps=4, interval=0.0))
    _run(make_progress(sparse, tasks=2, steps=4, interval=3600.0))
    hint, *lines = every.getvalue().splitlines()
    assert 'pip install "fn-optim[app]"' in hint
    assert lines == [f"[{t + 1}/2] opt{t}: {s}/4 steps" for t in range(2) for s in range(1, 5)]
    # At most one line per interval, and always the line that ends a task.
    assert sparse.getvalue().splitlines()[1:] == [
        "[1/2] opt0: 1/4 steps",
        "[1/2] opt0: 4/4 steps",
        "[2/2] opt1: 4/4 steps",
    ]
