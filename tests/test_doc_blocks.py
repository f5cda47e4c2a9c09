"""Every code block on the pages runs as copied: README.md and the pages under docs/.

A test reads the blocks out of the Markdown, so a page and its test cannot drift. A block is
run as it stands unless an HTML comment on the line above its fence says otherwise (GitHub and
the site show nothing of it):

- no comment: a complete program, run with ``python3`` in an empty folder;
- ``<!-- test: continues -->``: the next part of the page's previous Python block; the two
  (and what that one continues) run as one program, the way a reader pastes them in turn;
- ``<!-- test: file=train.py -->``: the program is saved as ``train.py`` in the folder, and the
  page's shell block marked ``<!-- test: run -->`` runs it, with the command the page shows
  (``torchrun --standalone --nproc-per-node 2 train.py``);
- ``<!-- test: fragment-of=NAME -->``: an excerpt. Its lines, but for ``...`` lines, appear in
  the same order in NAME: a ``file=`` block of the same page, or a file of the repository
  (``examples/lightning_ddp.py``), which its own tests run;
- ``<!-- test: run -->`` above a shell block: bash runs it, line by line and stopping at the
  first failure, in the folder where the page's ``file=`` blocks were written.

Other shell blocks (installs, launches on several hosts) are not run. A program that imports
a package outside fn's dependencies that is not installed (an extra: torchft, torchtitan) is
not run: its test skips, naming it (tests/_imports.py). Every run gets
``FN_DOC_BLOCK_TIMEOUT`` seconds (300 by default) on CPU, multi-rank blocks on gloo; up to
``min(4, cores)`` runs go at once.
"""

from __future__ import annotations

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from tests._distributed import rank_env, run_command
from tests._imports import missing_packages

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = float(os.environ.get("FN_DOC_BLOCK_TIMEOUT", "300"))
WORKERS = min(4, os.cpu_count() or 1)

_FENCE = re.compile(r"^(`{3,})(\w*)[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_MARKER = re.compile(r"<!--\s*test:\s*(.*?)\s*-->")
_SHELL = {"bash", "sh", "shell", "console"}


class Block(NamedTuple):
    """A fenced code block: its page, first line, language, text and marker."""

    page: Path
    line: int
    language: str
    text: str
    marker: str  # "", "continues", "run", "file=NAME" or "fragment-of=NAME"

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """README.md and every Markdown page of the site."""
    docs = ROOT / "docs"
    return [ROOT / "README.md"] + sorted(
        p for p in docs.rglob("*.md") if "_build" not in p.relative_to(docs).parts
    )


def blocks(page: Path) -> list[Block]:
    """The page's Python and shell blocks, each with the marker on the line above its fence."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        language = match.group(2).lower()
        if language not in _SHELL and language not in ("python", "py"):
            continue
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _MARKER.fullmatch(before.strip())
        line = text.count("\n", 0, match.start()) + 1
        language = "python" if language == "py" else "bash" if language in _SHELL else language
        found.append(Block(page, line, language, match.group(3), marker[1] if marker else ""))
    return found


def _marked(marker: str, key: str) -> str | None:
    return marker.split("=", 1)[1] if marker.startswith(key + "=") else None


def _programs() -> list[tuple[str, list[Block]]]:
    """The Python programs to run: each block that no later block continues, with the blocks
    it continues before it."""
    out = []
    for page in pages():
        chain: list[Block] = []
        python = [b for b in blocks(page) if b.language == "python"]
        for i, block in enumerate(python):
            if block.marker == "continues":
                if not chain:
                    raise ValueError(f"{block.where}: `continues` with no program before it")
                chain = [*chain, block]
            elif block.marker == "":
                chain = [block]
            else:
                chain = []
                continue
            ends = i + 1 == len(python) or python[i + 1].marker != "continues"
            if ends:
                out.append((block.where, chain))
    return out


def _pages_with_files() -> list[Path]:
    return [p for p in pages() if any(_marked(b.marker, "file") for b in blocks(p))]


def _fragments() -> list[Block]:
    return [b for p in pages() for b in blocks(p) if _marked(b.marker, "fragment-of")]


def _run(command: list[str], cwd: Path) -> str:
    """Run ``command`` in ``cwd`` on CPU with the timeout; its output, or a failed test."""
    env = rank_env(os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = run_command(command, env=env, timeout=TIMEOUT, cwd=cwd, merge_stderr=True)
    if done.returncode != 0:
        pytest.fail(f"exit status {done.returncode}:\n{done.stdout[-6000:]}")
    return done.stdout


def test_every_block_is_run_or_a_marked_excerpt():
    """The markers are ones this file knows; a saved program is run by a shell block of its
    page, and a shell block marked ``run`` names only programs the page saves or shell
    commands."""
    known = re.compile(r"(|continues|run|file=[\w.-]+\.py|fragment-of=[\w./-]+)")
    problems = []
    for page in pages():
        page_blocks = blocks(page)
        files = {_marked(b.marker, "file") for b in page_blocks} - {None}
        runs = " ".join(b.text for b in page_blocks if b.marker == "run")
        for block in page_blocks:
            if not known.fullmatch(block.marker):
                problems.append(f"{block.where}: unknown marker {block.marker!r}")
            elif block.marker == "run" and block.language != "bash":
                problems.append(f"{block.where}: `run` marks a shell block")
            elif block.marker not in ("", "run") and block.language != "python":
                problems.append(f"{block.where}: {block.marker!r} marks a Python block")
        for name in sorted(files):
            if not _names(name, runs):
                problems.append(f"{page.relative_to(ROOT)}: no `run` shell block runs {name}")
    assert not problems, "\n".join(problems)


def _names(name: str, command: str) -> bool:
    """Whether the shell ``command`` names the file ``name``."""
    return re.search(rf"(?<![\w/.-]){re.escape(name)}\b", command) is not None


def _run_program(chain: list[Block], folder: Path) -> str:
    program = "\n".join(block.text for block in chain)
    if missing := missing_packages(program):
        pytest.skip(f"{chain[-1].where} needs {', '.join(missing)} (an extra), not installed")
    (folder / "block.py").write_text(program, encoding="utf-8")
    return _run([sys.executable, "block.py"], folder)


def _run_page(page: Path, folder: Path) -> str:
    """Runs the page's ``run`` blocks in turn; one that runs a saved program needing an extra
    that is not installed is left out, and the test then skips, naming it, once the others
    passed."""
    page_blocks = blocks(page)
    saved = {}
    for block in page_blocks:
        if name := _marked(block.marker, "file"):
            (folder / name).write_text(block.text, encoding="utf-8")
            saved[name] = missing_packages(block.text)
    out, left_out = [], []
    for block in (b for b in page_blocks if b.marker == "run"):
        missing = sorted({m for name in saved if _names(name, block.text) for m in saved[name]})
        if missing:
            left_out.append(f"{block.where} (needs {', '.join(missing)}, an extra)")
            continue
        out.append(_run(["bash", "-e", "-o", "pipefail", "-c", block.text], folder))
    if left_out:
        pytest.skip(f"the other run blocks passed; not run here: {'; '.join(left_out)}")
    return "".join(out)


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """The selected runs of this file, started together on a pool of ``WORKERS`` threads (a run
    spends most of its time starting Python processes, one core each): the test of a run waits
    for its result."""
    selected = {
        item.callspec.id
        for item in request.session.items
        if getattr(item, "module", None) is sys.modules[__name__] and hasattr(item, "callspec")
    }
    # The pages that launch the most processes first: the runs of a page follow one another,
    # so the longest page bounds the wall time unless it starts at once.
    launches = {
        page: sum(b.text.count("torchrun") + 1 for b in blocks(page) if b.marker == "run")
        for page in _pages_with_files()
    }
    jobs = [(str(p.relative_to(ROOT)), _run_page, p) for p in sorted(launches, key=launches.get)]
    jobs = jobs[::-1] + [(where, _run_program, chain) for where, chain in _programs()]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        yield {
            key: pool.submit(run, what, tmp_path_factory.mktemp("block"))
            for key, run, what in jobs
            if key in selected
        }


# A test waits for its run and for the pool's runs before it (all of them, for the first test):
# more than pyproject's 600 s on a slow machine (torch 2.14.1's CUDA build imports slowly).
# Each run ends within TIMEOUT, killed with its processes, so no test here waits unbounded.
POOL_WAIT = pytest.mark.timeout(0)


@POOL_WAIT
@pytest.mark.parametrize("where", [w for w, _ in _programs()])
def test_python_block_runs_as_copied(where, started):
    started[where].result()


@POOL_WAIT
@pytest.mark.parametrize("page", [str(p.relative_to(ROOT)) for p in _pages_with_files()])
def test_shell_blocks_run_the_pages_programs(page, started):
    started[page].result()


@pytest.mark.parametrize("fragment", _fragments(), ids=[b.where for b in _fragments()])
def test_fragment_is_an_excerpt_of_its_program(fragment):
    name = _marked(fragment.marker, "fragment-of")
    sources = [b.text for b in blocks(fragment.page) if _marked(b.marker, "file") == name]
    if not sources and (ROOT / name).is_file():
        sources = [(ROOT / name).read_text(encoding="utf-8")]
    assert sources, f"{fragment.where}: no block file={name} on the page and no file {name}"
    program = [line.strip() for line in sources[0].splitlines()]
    position = 0
    for line in fragment.text.splitlines():
        line = line.strip()
        if not line or line == "..." or line.startswith("# ..."):
            continue
        try:
            position = program.index(line, position) + 1
        except ValueError:
            pytest.fail(f"{fragment.where}: {line!r} is not in {name} (in this order)")
