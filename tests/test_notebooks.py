"""The notebooks in notebooks/ run top to bottom without error and draw their plots inline.

Each notebook is executed with nbclient in a fresh ``python3`` kernel, from the notebooks/
directory, with this checkout first on the kernel's ``PYTHONPATH``. The documentation site's
build (docs/conf.py) executes them too, the same way, and caches the executed notebooks with
jupyter-cache under its output folder (README.md's build: ``docs/_build/html/.jupyter_cache``):
a cached run of the notebook's code made after the last change to ``fn`` is checked in place of
a second run (CI builds the site just before the tests). ``FN_NOTEBOOK_TIMEOUT`` (seconds,
default 1200) limits a notebook's run here, as it limits a cell's in the site build. The
notebooks are committed without outputs; that is checked too.
"""

from __future__ import annotations

import os
import pathlib
from datetime import timezone

import pytest

_MISSING = "notebook tests need the test extra: pip install -e '.[test]'"
nbformat = pytest.importorskip("nbformat", reason=_MISSING)
nbclient = pytest.importorskip("nbclient", reason=_MISSING)
pytest.importorskip("ipykernel", reason=_MISSING)

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = ("01_quickstart.ipynb", "02_error_feedback.ipynb", "03_convergence.ipynb")
NOTEBOOK_TIMEOUT_S = int(os.environ.get("FN_NOTEBOOK_TIMEOUT", "1200"))  # kernel start included
SITE_CACHES = ROOT / "docs" / "_build" / "html" / ".jupyter_cache"  # README.md's build


def code_cells(nb):
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def test_notebooks_are_committed_without_outputs():
    assert [p.name for p in NOTEBOOKS] == list(EXPECTED)
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for i, cell in enumerate(code_cells(nb)):
            assert cell.outputs == [], f"{path.name}: code cell {i} has outputs; clear them"
            assert cell.execution_count is None, f"{path.name}: code cell {i} has a count"


@pytest.mark.slow
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, monkeypatch):
    nb = executed_by_site(path)
    if nb is None:
        # The kernel inherits the environment: this checkout's fn comes first, and torch uses
        # one thread (the models are tiny; several threads on a shared CI machine only slow
        # them down).
        python_path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(python_path))
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        nb = nbformat.read(path, as_version=4)
        # A last cell, not in the notebook: which fn the kernel imported.
        nb.cells.append(nbformat.v4.new_code_cell("import fn\nprint('fn from', fn.__file__)"))
        client = nbclient.NotebookClient(
            nb,
            timeout=NOTEBOOK_TIMEOUT_S,
            kernel_name="python3",
            resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
        )
        client.execute()  # raises CellExecutionError, with the traceback, if a cell fails
        printed = nb.cells.pop().outputs[0].text
        assert printed == f"fn from {ROOT / 'fn' / '__init__.py'}\n"

    outputs = [out for cell in code_cells(nb) for out in cell.outputs]
    assert all(cell.execution_count is not None for cell in code_cells(nb))
    assert not [out for out in outputs if out.output_type == "error"]
    # A warning that a notebook expects is silenced there, with the reason; no other is raised.
    stderr = [out.text for out in outputs if out.get("name") == "stderr"]
    assert not [text for text in stderr if "Warning" in text], stderr
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert images, f"{path.name} drew no inline plot"


def executed_by_site(path: pathlib.Path):
    """The site build's cached execution of the notebook at ``path``, if one was made after the
    last change to ``fn`` (so it ran this code), else ``None``."""
    try:
        from jupyter_cache import get_cache  # installed with myst-nb (the docs extra)
    except ImportError:
        return None
    nb = nbformat.read(path, as_version=4)
    fn_sources = [*(ROOT / "fn").rglob("*.py"), *(ROOT / "fn").rglob("*.c")]
    changed = max(p.stat().st_mtime for p in fn_sources)
    for folder in sorted(SITE_CACHES.glob("*")):
        cache = get_cache(folder)
        try:
            record = cache.match_cache_notebook(nb)
        except KeyError:
            continue
        created = record.created  # in UTC; SQLite returns it without the time zone
        if created.replace(tzinfo=created.tzinfo or timezone.utc).timestamp() > changed:
            return cache.merge_match_into_notebook(nb)[1]
    return None
