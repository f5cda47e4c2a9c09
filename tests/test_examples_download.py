"""The example scripts as downloads: docs/examples.md offers each with the command that runs it,
each imports only installed packages (what the scripts share is ``fn.app.examples``), each is
run from a copy of the file alone in an empty folder by a test of its own, and the built site's
links download the scripts themselves.

The training runs of docs/examples.md's commands, each on a copy of its script alone in an empty
folder, are the scripts' own tests: tests/integrations/test_examples.py (hf_trainer.py,
accelerate_loop.py), tests/integrations/test_lightning.py (lightning_ddp.py),
tests/integrations/test_lightning_fsdp.py (lightning_fsdp.py), tests/fsdp/test_example.py
(fsdp_loco.py, fsdp_onebit.py) and tests/integrations/test_hsdp_example.py (hsdp_onebit.py).
"""

from __future__ import annotations

import ast
import html
import re
from pathlib import Path

import pytest

from tests._examples import EXAMPLES, PAGE, ROOT, documented, scripts
from tests.test_site import site  # noqa: F401  (the built site, or a skip)

SCRIPTS = scripts()


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
def test_script_is_run_alone_in_an_empty_folder_by_a_test_of_its_own(script):
    """A test module names the script and runs it downloaded (``download``, ``run_downloaded``):
    its imports resolve from a copy of the file alone in an empty folder, on the page's command.
    (A ``python3 SCRIPT --help`` here would import the same packages a second time: 7 to 22 s
    a script.)"""
    runners = [
        path.relative_to(ROOT)
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if path != Path(__file__)
        and "run_downloaded(" in (text := path.read_text(encoding="utf-8"))
        and f'"{script}"' in text
    ]
    assert runners, f"no test runs {script} downloaded (tests/_examples.py: run_downloaded)"


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
