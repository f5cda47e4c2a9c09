"""The example scripts as downloads: docs/examples.md offers each with the command that runs it,
each imports only installed packages (what the scripts share is ``fn.app.examples``), each
starts from a copy of the file alone in an empty folder, and the built site's links download
the scripts themselves.

The training runs of docs/examples.md's commands, each on a copy of its script alone in an empty
folder, are the scripts' own tests: tests/integrations/test_examples.py (hf_trainer.py,
accelerate_loop.py), tests/integrations/test_lightning.py (lightning_ddp.py),
tests/integrations/test_lightning_fsdp.py (lightning_fsdp.py), tests/fsdp/test_example.py
(fsdp_loco.py, fsdp_onebit.py) and tests/integrations/test_hsdp_example.py (hsdp_onebit.py).
"""

from __future__ import annotations

import ast
import html
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests._examples import EXAMPLES, PAGE, documented, download, run_downloaded, scripts
from tests.test_site import site  # noqa: F401  (the built site, or a skip)

SCRIPTS = scripts()
_BUILTIN = set(sys.stdlib_module_names)


def _imports(script: str) -> set[str]:
    """The top-level names of the modules ``script`` imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse((EXAMPLES / script).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{script}: a relative import"
            names.add(node.module.split(".")[0])
    return names


def test_the_page_offers_every_script_with_its_command():
    text = PAGE.read_text(encoding="utf-8")
    assert SCRIPTS, "no example scripts"
    for script in SCRIPTS:
        assert f"](../examples/{script})" in text, f"docs/examples.md does not link {script}"
        command = documented(script)
        assert command[:2] == ["torchrun", "--standalone"] and script in command, command


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_imports_only_installed_packages(script):
    """No import of a file beside it (examples/ is not installed) and no ``sys.path`` set-up."""
    source = (EXAMPLES / script).read_text(encoding="utf-8")
    assert "sys.path" not in source, f"{script} edits sys.path"
    beside = {p.stem for p in EXAMPLES.iterdir()} | {"examples", "tests", "benchmarks"}
    assert not _imports(script) & beside, f"{script} imports {_imports(script) & beside}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_starts_alone_in_an_empty_folder(script, tmp_path):
    """``python3 SCRIPT --help`` on a copy of the script alone: every import resolves."""
    missing = [
        name
        for name in sorted(_imports(script) - _BUILTIN - {"fn", "torch"})
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        pytest.skip(f"{script} needs {missing}, an extra that is not installed")
    out = run_downloaded(["python3", script, "--help"], download(script, tmp_path), timeout=120)
    assert out.startswith("usage: ") and "--max-steps" in out, out[-2000:]


def test_the_site_downloads_every_script(site):  # noqa: F811
    page = (site / "examples.html").read_text(encoding="utf-8")
    links = {
        Path(href).name: site / href
        for href in map(
            html.unescape, re.findall(r'<a class="[^"]*download[^"]*"[^>]* href="([^"]+)"', page)
        )
    }
    for script in SCRIPTS:
        assert script in links, f"examples.html has no download link for {script}"
        assert links[script].read_bytes() == (EXAMPLES / script).read_bytes(), script
