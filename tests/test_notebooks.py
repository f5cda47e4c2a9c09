"""The notebooks in notebooks/ run top to bottom without error and draw their plots inline.

Each notebook is executed with nbclient in a fresh ``python3`` kernel, from the notebooks/
directory, with this checkout's ``fn`` first on the kernel's path. The documentation site's
build (docs/conf.py) executes them too, the same way, and keeps the executed copies in
``docs/_build/jupyter_execute/notebooks``: a copy newer than the notebook and than every file
of ``fn`` is checked in place of a second run (CI builds the site just before the tests). The
notebooks are committed without outputs; that is checked too.
"""

from __future__ import annotations

import os
import pathlib

import pytest

_MISSING = "notebook tests need the test extra: pip install -e '.[test]'"
nbformat = pytest.importorskip("nbformat", reason=_MISSING)
nbclient = pytest.importorskip("nbclient", reason=_MISSING)
pytest.importorskip("ipykernel", reason=_MISSING)

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = ("01_quickstart.ipynb", "02_error_feedback.ipynb", "03_convergence.ipynb")
NOTEBOOK_TIMEOUT_S = 180  # a whole notebook, kernel start included
EXECUTED_BY_SITE = ROOT / "docs" / "_build" / "jupyter_execute" / "notebooks"


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
        client = nbclient.NotebookClient(
            nb,
            timeout=NOTEBOOK_TIMEOUT_S,
            kernel_name="python3",
            resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
        )
        client.execute()  # raises CellExecutionError, with the traceback, if a cell fails

    outputs = [out for cell in code_cells(nb) for out in cell.outputs]
    assert all(cell.execution_count is not None for cell in code_cells(nb))
    assert not [out for out in outputs if out.output_type == "error"]
    printed = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert f"fn from {ROOT / 'fn' / '__init__.py'}" in printed
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert images, f"{path.name} drew no inline plot"


def executed_by_site(path: pathlib.Path):
    """The site build's executed copy of the notebook at ``path``, if it is newer than the
    notebook and than every file of ``fn`` (so it ran this code), else ``None``."""
    copy = EXECUTED_BY_SITE / path.name
    if not copy.exists():
        return None
    sources = [path, *(ROOT / "fn").rglob("*.py")]
    if copy.stat().st_mtime < max(p.stat().st_mtime for p in sources):
        return None
    return nbformat.read(copy, as_version=4)
