"""Doctest collection for the package.

``pyproject.toml`` runs pytest with ``--doctest-modules`` over ``tests`` and ``fn``, so the
``Example:`` blocks of every module in ``fn`` run with the test suite. fn's only hard
dependencies are torch and numpy; a module that imports anything else outside the standard
library at module level (an optional package: Triton, CuPy, torch_npu, an extra) cannot be
imported where that package is missing, nor can a package whose ``__init__`` imports such a
module (tests/_imports.py follows the imports). Such a module is left out of the collection,
and only then (the pytest header names it); modules that import optional packages inside
functions are collected as usual.

Under pytest-xdist (CI runs ``-n 2``) each worker process gets its share of the cores for
torch's intra-op threads: two workers each running as many threads as the machine has cores
oversubscribe it, and torch's OpenMP threads spin while they wait for a core (three of the
heaviest in-process files ran about 5% slower so on 2 cores; the whole suite, mostly launched
processes, about 1%). A test that needs other threads sets them itself; the processes the tests
launch choose their own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fn
from tests._imports import missing_packages

_ROOT = Path(__file__).parent


def _missing_optional(path: Path) -> list[str]:
    """The optional packages that importing ``path`` imports at module level (itself or through
    the ``fn`` modules it imports) and that are not installed."""
    return missing_packages(path.read_text(encoding="utf-8"))


def _left_out() -> dict[Path, list[str]]:
    """Every ``fn`` module that cannot be imported here, with the packages it lacks."""
    modules = {path: _missing_optional(path) for path in sorted((_ROOT / "fn").rglob("*.py"))}
    return {path: missing for path, missing in modules.items() if missing}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leaves out the ``fn`` modules whose module-level optional imports are not installed."""
    if collection_path.suffix == ".py" and collection_path.is_relative_to(_ROOT / "fn"):
        if _missing_optional(collection_path):
            return True
    return None


@pytest.fixture(autouse=True, scope="module")
def _import_path_restored() -> Iterator[None]:
    """``sys.path`` as it was before each test file, after it: a benchmark script loaded in a
    test puts ``benchmarks/`` first on the path, as when it runs, and left there its
    ``torchtitan.py`` would pass for the torchtitan package in every later file of the worker."""
    saved = list(sys.path)
    yield
    sys.path[:] = saved


def pytest_configure(config: pytest.Config) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [
        f"doctests: {path.relative_to(_ROOT)} left out (needs {', '.join(missing)})"
        for path, missing in _left_out().items()
    ]


@pytest.fixture(autouse=True)
def _doctest_globals(doctest_namespace: dict) -> None:
    """``fn`` and ``torch`` in every doctest's namespace (examples import them anyway)."""
    doctest_namespace["fn"] = fn
    doctest_namespace["torch"] = torch
