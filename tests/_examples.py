"""The example scripts run as a reader runs a downloaded one: the file alone in an empty folder,
with only installed packages and this checkout's ``fn`` importable (not the repository's root:
neither ``examples/`` nor ``tests/``), on the CPU, one intra-op thread per rank.

``documented(script)`` is the command docs/examples.md shows for ``examples/<script>``, split
into words; the tests of each example run it as their first, uninterrupted run, so that the page
and the tests cannot drift. ``download(script, folder)`` copies the script alone into ``folder``;
``run_downloaded(command, folder)`` runs a command there.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tests._distributed import rank_env, run_command

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PAGE = ROOT / "docs" / "examples.md"

_FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_FN_ONLY: tempfile.TemporaryDirectory | None = None


def scripts() -> list[str]:
    """The file names of the example scripts."""
    return sorted(p.name for p in EXAMPLES.glob("*.py"))


def documented(script: str) -> list[str]:
    """The command of docs/examples.md's shell blocks that runs ``script`` (``torchrun ...
    script ...``), split into words."""
    found = [
        shlex.split(line, comments=True)
        for block in _FENCE.findall(PAGE.read_text(encoding="utf-8"))
        for line in block.replace("\\\n", " ").splitlines()
        if script in shlex.split(line, comments=True)
    ]
    assert len(found) == 1, f"docs/examples.md: {len(found)} commands run {script}, not one"
    return found[0]


def option(command: Sequence[str], name: str) -> str:
    """The value that follows ``name`` in ``command``."""
    return command[list(command).index(name) + 1]


def with_option(command: Sequence[str], name: str, value: str) -> list[str]:
    """``command`` with the value that follows ``name`` replaced by ``value``."""
    words = list(command)
    words[words.index(name) + 1] = value
    return words


def download(script: str, folder: Path) -> Path:
    """Copies ``examples/<script>`` into ``folder`` (created if missing), which holds no other
    file of the repository; returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLES / script, folder / script)
    return folder


def _fn_only() -> str:
    """A folder that holds only a link to this checkout's ``fn``, for ``PYTHONPATH``."""
    global _FN_ONLY
    if _FN_ONLY is None:
        _FN_ONLY = tempfile.TemporaryDirectory(prefix="fn-only-")
        os.symlink(ROOT / "fn", Path(_FN_ONLY.name) / "fn")
    return _FN_ONLY.name


def run_downloaded(command: Sequence[str], folder: Path, timeout: float = 300) -> str:
    """Runs ``command`` (``torchrun`` or ``python3`` and its arguments) in ``folder``, where a
    script was downloaded; ``torchrun`` and ``python3`` are this interpreter's.

    Returns:
        Its standard output.

    Raises:
        AssertionError: it failed or ran past ``timeout`` seconds (its process group is then
            killed), with the ends of its output.
    """
    done = run_command(command, env=rank_env(_fn_only()), timeout=timeout, cwd=folder)
    assert done.returncode == 0, (
        f"{shlex.join(command)}:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    )
    return done.stdout
