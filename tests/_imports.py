"""The optional packages a program or an ``fn`` module needs at import: the packages outside
fn's hard dependencies (torch, numpy, the standard library) that it imports at module level,
directly or through the ``fn`` modules it imports at module level (``fn.integrations.torchft``
imports torchft through ``fn.integrations.torchft.comm``). Imports inside functions, or guarded
by ``try`` at module level, are not needed at import and not counted.

The root conftest.py leaves the ``fn`` modules that need a missing package out of the doctests;
tests/test_doc_blocks.py skips the docs' programs that need one.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = frozenset({"fn", "torch", "numpy", "__future__"}) | frozenset(sys.stdlib_module_names)
# CPython 3.11 may raise "SystemError: AST constructor recursion depth mismatch" where threads
# parse at once (tests/test_doc_blocks.py reads the pages' programs on a pool of threads)
_PARSING = threading.Lock()


def module_level_imports(source: str) -> frozenset[str]:
    """The dotted names ``source`` imports at module level (``from a.b import c``: ``a.b`` and
    ``a.b.c``, which may be a module)."""
    names = set()
    with _PARSING:
        tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return frozenset(names)


@functools.cache
def _file_imports(path: Path) -> frozenset[str]:
    return module_level_imports(path.read_text(encoding="utf-8"))


def _fn_file(name: str) -> Path | None:
    """The file of the ``fn`` module ``name``, or ``None`` (not fn's, or not a module)."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def optional_imports(source: str) -> set[str]:
    """The top-level packages outside :data:`REQUIRED` that importing ``source`` imports,
    through the ``fn`` modules it imports too."""
    found: set[str] = set()
    pending, seen = [module_level_imports(source)], set()
    while pending:
        for name in pending.pop():
            top = name.split(".")[0]
            if top != "fn":
                found.add(top)
            elif (path := _fn_file(name)) is not None and path not in seen:
                seen.add(path)
                pending.append(_file_imports(path))
    return found - REQUIRED


def missing_packages(source: str) -> list[str]:
    """The packages of :func:`optional_imports` that are not installed here."""
    return sorted(n for n in optional_imports(source) if importlib.util.find_spec(n) is None)


def missing_for_module(name: str) -> list[str]:
    """The packages of :func:`missing_packages` that importing ``fn``'s module ``name`` needs
    (``fn.integrations.torchtitan`` where torchtitan is not installed)."""
    path = _fn_file(name)
    return [] if path is None else missing_packages(path.read_text(encoding="utf-8"))
