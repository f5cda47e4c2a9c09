"""``python -m fn demo`` runs and its loss goes down."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_demo_runs_and_learns():
    result = subprocess.run(
        [sys.executable, "-m", "fn", "demo", "--steps", "30", "--lr", "0.02"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", result.stdout)]
    assert len(losses) >= 3
    assert losses[-1] < losses[0]


def test_main_in_process(capsys):
    from fn.__main__ import main

    assert main(["demo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("loss") == 3


def test_main_needs_a_command():
    from fn.__main__ import main

    with pytest.raises(SystemExit):
        main([])
