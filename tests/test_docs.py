"""The documentation: docs/algorithms.md and the links to it, and the doctest collection.

The doctests themselves are collected by pytest from ``fn`` (``--doctest-modules`` in
pyproject.toml, see conftest.py); these tests check that this stays so.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = ROOT / "docs" / "algorithms.md"

# Other documents and docstrings link to these sections by name.
SECTIONS = [
    "Conventions",
    "Error-compensated 1-bit allreduce",
    "Hierarchical 1-bit allreduce",
    "1-bit Adam",
    "0/1 Adam",
    "1-bit LAMB",
    "Automatic freeze and momentum mask",
    "Safeguard against near-zero frozen variance",
    "Quantized allreduce with LoCo error feedback",
    "1-bit Adam and 1-bit LAMB on FSDP2",
    "1-bit Adam and 1-bit LAMB on HSDP",
    "Deviations from DeepSpeed",
]

_LINK = re.compile(r"docs/algorithms\.md#([A-Za-z0-9_-]+)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _documents() -> list[Path]:
    paths = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md")]
    for folder in ("fn", "tests", "benchmarks", "notebooks"):
        paths += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".ipynb")]
    return paths


def test_algorithms_has_the_linked_sections_in_order():
    headings = re.findall(r"^## (.+)$", ALGORITHMS.read_text(encoding="utf-8"), re.MULTILINE)
    assert headings == SECTIONS


def test_links_to_algorithms_name_existing_sections():
    anchors = {_anchor(h) for h in SECTIONS}
    assert _anchor("0/1 Adam") == "01-adam"
    broken = [
        f"{path.relative_to(ROOT)}: #{anchor}"
        for path in _documents()
        for anchor in _LINK.findall(path.read_text(encoding="utf-8"))
        if anchor not in anchors
    ]
    assert not broken, f"links to missing sections of docs/algorithms.md: {broken}"


def test_no_references_to_documents_outside_the_repository():
    """Code, tests and docs cite only files in the repository: the specification is
    docs/algorithms.md, the layout docs/architecture.md."""
    stale = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _documents()
        if path != Path(__file__).resolve()
        for name in ("ALGORITHMS.md", "DESIGN.md")
        if name in path.read_text(encoding="utf-8")
    ]
    assert not stale, f"cite docs/algorithms.md or docs/architecture.md instead: {stale}"
    assert "docs/algorithms.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_test_command_runs_doctests_and_fails_on_a_broken_one(tmp_path):
    """With the repository's pytest settings, fn's examples are collected and a wrong output
    fails the run."""
    broken = tmp_path / "broken_example.py"
    broken.write_text(
        textwrap.dedent(
            '''
            def double(x):
                """Example:
                    >>> double(2)
                    5
                """
                return 2 * x
            '''
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "pyproject.toml"]
        + ["--rootdir", ".", "fn/tree.py", str(broken)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert re.search(r"\b1 failed, [1-9]\d* passed\b", out), out
    assert "broken_example.double" in out, out
