"""Doctest collection for the package.

``pyproject.toml`` runs pytest with ``--doctest-modules`` over ``tests`` and ``fn``, so the
``Example:`` blocks of every module in ``fn`` run with the test suite. A module that imports an
optional accelerator package (Triton, CuPy, torch_npu, Intel's extension) at module level cannot
be imported where that package is missing; such modules are left out of the collection, and
only then. Modules that import those packages inside functions are collected as usual.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

import fn

_OPTIONAL_PACKAGES = frozenset({"triton", "cupy", "torch_npu", "intel_extension_for_pytorch"})


def _top_level_imports(path: Path) -> set[str]:
    """The top-level package names that ``path`` imports at module level."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _missing_optional(path: Path) -> list[str]:
    wanted = _top_level_imports(path) & _OPTIONAL_PACKAGES
    return sorted(name for name in wanted if importlib.util.find_spec(name) is None)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leaves out the ``fn`` modules whose module-level optional imports are not installed."""
    package = Path(__file__).parent / "fn"
    if collection_path.suffix == ".py" and collection_path.is_relative_to(package):
        if _missing_optional(collection_path):
            return True
    return None


@pytest.fixture(autouse=True)
def _doctest_globals(doctest_namespace: dict) -> None:
    """``fn`` and ``torch`` in every doctest's namespace (examples import them anyway)."""
    doctest_namespace["fn"] = fn
    doctest_namespace["torch"] = torch
