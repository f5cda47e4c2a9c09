"""The documentation: README.md as the front door, the pages under docs/ and the links between
them, docs/algorithms.md's sections, the examples the pages show, and the doctest collection.

The doctests themselves are collected by pytest from ``fn`` (``--doctest-modules`` in
pyproject.toml, see conftest.py); these tests check that this stays so.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ALGORITHMS = DOCS / "algorithms.md"

# The guide pages: the site's table of contents names them, README.md links to them.
GUIDES = [
    "simulated-workers",
    "compile",
    "ddp",
    "hf-trainer",
    "accelerate",
    "lightning",
    "fsdp",
    "torchtitan",
    "hierarchical",
    "diloco",
    "freeze-step",
    "memory",
    "checkpoints",
    "policies",
    "kernels",
]
# The pages this project writes by hand, each a title, an introduction, then its sections.
PAGES = [
    "getting-started.md",
    *(f"guides/{name}.md" for name in GUIDES),
    "benchmarks.md",
    "torch-optim.md",
    "precision.md",
    "migrating-from-deepspeed.md",
    "troubleshooting.md",
    "examples.md",
]

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
    "Accumulation and clipping on FSDP2 and HSDP",
    "DiLoCo: local steps and a compressed outer step",
    "Deviations from DeepSpeed",
]

# A link to a section of algorithms.md from anywhere: docs/algorithms.md#<section>, or relative
_LINK = re.compile(r"algorithms\.md#([A-Za-z0-9_-]+)")
# A Markdown link or image: [text](target), the target without a title
_MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside code blocks), as GitHub makes them:
    a repeated heading gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    out = set()
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE):
        anchor = _anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        out.add(anchor if count == 0 else f"{anchor}-{count}")
    return out


def _markdown() -> list[Path]:
    """README.md, every page under docs/ and the other folders' READMEs, each once."""
    paths = [README, *sorted(DOCS.rglob("*.md")), *sorted(ROOT.glob("*/README.md"))]
    unique = {p.resolve(): None for p in paths if "_build" not in p.relative_to(ROOT).parts}
    return list(unique)


def _documents() -> list[Path]:
    paths = [*_markdown(), *ROOT.glob("benchmarks/*.md")]
    for folder in ("fn", "tests", "benchmarks", "notebooks"):
        paths += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".ipynb")]
    return paths


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(encoding="utf-8"), re.M | re.S)


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


def test_readme_is_a_front_door():
    """README.md stays short: the details live on the pages it links to."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move details to docs/"


def test_readme_links_every_guide_and_each_exists():
    text = README.read_text(encoding="utf-8")
    linked = re.findall(r"\]\(docs/guides/([\w-]+)\.md(?:#[\w-]+)?\)", text)
    assert sorted(set(linked)) == sorted(GUIDES), "README.md links each guide once or more"
    missing = [name for name in linked if not (DOCS / "guides" / f"{name}.md").is_file()]
    assert not missing, f"README.md links missing guides: {missing}"


def test_readme_keeps_the_commands_ci_runs():
    """.ci/run installs and tests as README.md says: README keeps its test command as a line of
    its own, pins the torch that CI installs on a fresh machine, and installs for development
    the extras that CI installs."""
    readme = README.read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m pytest -q\n" in readme
    assert re.search(r"^python3 -m pytest -q$", ci, re.MULTILINE)
    torch_pin = 'pip install "torch==2.13.0"'
    assert f"python3 -m {torch_pin}\n" in readme
    assert torch_pin in ci.replace("pip install -q ", "pip install ")
    (extras,) = re.findall(r'^\s*"\.\[([\w,]+)\]"$', readme, re.MULTILINE)
    ci_extras = {e for found in re.findall(r'-e "\.\[([\w,]+)\]"', ci) for e in found.split(",")}
    assert set(extras.split(",")) == ci_extras, (extras, ci_extras)
    assert 'python3 -m pip install -e \\\n    ".[' + extras + ']"' in readme


def test_readme_keeps_the_torchtitan_set_up_that_ci_runs():
    """torchtitan's environment (torch 2.14.1 first, then the pytest and torchtitan extras, then
    the tests) is README.md's and Getting started's, and CI's second script runs it: the same
    test paths in all three; the development install that CI runs on torch 2.13.0 goes without
    torchtitan, whose extra asks for the torch it needs."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11 and later")

    def commands(text: str) -> str:
        """The text's lines but comments, continuations joined, without pip's and pytest's -q,
        pip's --no-compile and the script's torch pin."""
        lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        joined = " ".join(" ".join(lines).replace("\\", " ").split())
        for option in (" -q", " --no-compile", ' -c "$tmp/torch-pin"'):
            joined = joined.replace(option, "")
        return joined

    def tested(text: str) -> list[list[str]]:
        """The paths (of this checkout) that each ``-m pytest`` command of ``text`` names, for
        those that name some."""
        found = []
        for command in text.split("-m pytest ")[1:]:
            words = command.split()
            paths = list(itertools.takewhile(lambda word: (ROOT / word).exists(), words))
            found += [paths] if paths else []
        return found

    readme = commands(README.read_text(encoding="utf-8"))
    ci = commands((ROOT / ".ci" / "torch-2.14").read_text(encoding="utf-8"))
    for command in ('pip install "torch==2.14.1"', 'pip install -e ".[pytest,torchtitan]"'):
        assert f"python3 -m {command}" in readme and command in ci, command
    assert "bash .ci/torch-2.14" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    (on_torch_2_14,) = tested(ci)
    assert "tests/integrations/test_torchtitan.py" in on_torch_2_14, on_torch_2_14
    assert tested(readme) == [on_torch_2_14], tested(readme)
    # Getting started installs the same two environments and runs the same tests
    started = commands((DOCS / "getting-started.md").read_text(encoding="utf-8"))
    (develop,) = re.findall(r'^\s*"\.\[[\w,]+\]"$', README.read_text(encoding="utf-8"), re.M)
    assert f"python3 -m pip install -e {develop.strip()}" in started
    assert 'python3 -m pip install "torch==2.14.1"' in started
    assert 'python3 -m pip install -e ".[pytest,torchtitan]"' in started
    assert tested(started) == [on_torch_2_14], tested(started)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    # the floor is the torch that the README's set-up installs first, and the page says so
    floor = re.search(r'install "torch==(2\.\d+)\.\d+"', README.read_text(encoding="utf-8"))[1]
    assert f"torch>={floor}" in project["dependencies"]
    assert f"`torch>={floor}`" in (DOCS / "getting-started.md").read_text(encoding="utf-8")
    assert "torch>=2.14" in extras["torchtitan"]
    assert not any("torchtitan" in requirement for requirement in extras["docs"])
    # the pytest extra, the torch 2.14.1 environment's runner, is the test extra's too
    assert any(requirement.startswith("pytest>=") for requirement in extras["pytest"])
    assert "fn-optim[pytest]" in extras["test"]


@pytest.mark.parametrize("page", PAGES)
def test_each_page_has_a_title_and_an_introduction(page):
    text = _FENCE.sub("", (DOCS / page).read_text(encoding="utf-8"))
    assert text.startswith("# "), f"docs/{page} starts with its title"
    intro = text.split("\n", 1)[1].split("\n## ", 1)[0]
    assert len(intro.split()) >= 15, f"docs/{page}: a short introduction before its sections"


def test_relative_links_reach_files_and_headings():
    """Every relative link in README.md and the pages names a file of the repository, and a
    heading of it where the link has an anchor (as GitHub makes anchors; the site resolves the
    same links)."""
    broken = []
    for path in _markdown():
        text = _FENCE.sub("", path.read_text(encoding="utf-8"))
        for target in _MD_LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}: {target}"
            if not linked.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_references_to_readme_sections_name_its_headings():
    """A document that cites a section of README.md by name (README, "Set-up ...") cites one
    README.md has; the sections that left README.md are cited by their pages' paths."""
    cite = re.compile(r"(?<![/\w])README(?:\.md)?(?:'s)?[,:]?\s+\"([^\"]+)\"")
    headings = re.findall(r"^#+ (.+)$", README.read_text(encoding="utf-8"), re.MULTILINE)
    paths = [*_markdown()]
    for folder in ("tests", "benchmarks", "notebooks", "examples"):
        paths += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".ipynb")]
    stale = [
        f"{path.relative_to(ROOT)}: {name!r}"
        for path in paths
        if path != Path(__file__).resolve()
        for name in cite.findall(path.read_text(encoding="utf-8"))
        if not any(h.startswith(" ".join(name.split())) for h in headings)
    ]
    assert not stale, f"README.md has no such section: {stale}"


def test_the_benchmarks_page_includes_the_benchmarks_readme():
    """docs/benchmarks.md shows benchmarks/README.md itself (one source for every table)."""
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    (included,) = re.findall(r"^```\{include\} (\S+)$", text, re.MULTILINE)
    assert (DOCS / included).resolve() == (ROOT / "benchmarks" / "README.md").resolve()


def _run_blocks(blocks: list[str], capsys) -> str:
    namespace: dict = {"__name__": "__docs__"}
    exec(compile("\n".join(blocks), "<docs>", "exec"), namespace)  # noqa: S102
    return capsys.readouterr().out


def test_the_first_custom_loop_runs(capsys):
    """getting-started.md's pure loop writes nothing it is given; its fast loop, from the same
    start, ends with the same bits, as the page says."""
    pure, fast = _python_blocks(DOCS / "getting-started.md")[:2]
    assert "fn.apply_updates" in pure and "fn.update_and_apply" in fast
    restart = (
        "p_pure = params\n"
        "params = {k: v.detach().clone() for k, v in model.named_parameters()}\n"
        "print(float(loss_fn(params)), float(loss_fn(p_pure)))\n"
    )
    check = "print(all(torch.equal(params[k], p_pure[k]) for k in params))"
    out = _run_blocks([pure, restart, fast, check], capsys).split()
    assert float(out[1]) < float(out[0])  # trained
    assert out[2] == "True"


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
