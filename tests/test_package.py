"""The package layout: every module of fn is reachable by its dotted name, the package root holds
only the core modules, and imports run one way (docs/architecture.md), never into another
package's private module."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import types
from pathlib import Path

import fn
from tests._imports import missing_for_module

ROOT = Path(fn.__file__).parent

# Each package (or root module) with the ones it may import, bottom-up as in docs/architecture.md.
ALLOWED = {
    "errors": set(),
    "tree": set(),
    "kernels": {"errors", "tree"},
    "base": {"errors", "tree"},
    "collectives": {"errors", "tree", "kernels", "base"},
    "transforms": {"errors", "tree", "kernels", "base", "collectives"},
    "optim": {"errors", "tree", "kernels", "base", "collectives", "transforms"},
    "fsdp": {"errors", "tree", "kernels", "base", "collectives", "transforms"},
    "diloco": {"errors", "tree", "kernels", "base", "collectives", "transforms"},
    "ddp": {"errors", "tree", "kernels", "base", "collectives", "transforms", "optim"},
    "integrations": {"errors", "tree", "base", "collectives", "transforms", "optim", "fsdp"}
    | {"diloco", "ddp"},
    "app": {"errors", "tree", "base", "collectives", "transforms", "optim", "ddp", "fsdp"},
}


def _packages() -> list[types.ModuleType]:
    found = [fn]
    for info in pkgutil.walk_packages(fn.__path__, "fn.", onerror=lambda name: None):
        if info.ispkg and not missing_for_module(info.name):
            found.append(importlib.import_module(info.name))
    return found


def test_no_module_is_shadowed_by_a_name_of_its_package():
    """A package attribute named as one of its modules (``fn.transforms.adam`` the function over
    a module ``adam.py``) would make ``fn.transforms.adam.ScaleByAdamState`` unreachable, the
    path pickle and ``torch.serialization.add_safe_globals`` use."""
    shadowed = []
    for package in _packages():
        for info in pkgutil.iter_modules(package.__path__):
            attribute = getattr(package, info.name, None)
            if attribute is not None and not isinstance(attribute, types.ModuleType):
                shadowed.append(f"{package.__name__}.{info.name}")
    assert not shadowed, f"modules shadowed by a same-named attribute of their package: {shadowed}"


def _imports() -> list[tuple[str, str, list[str], str]]:
    """``(importing unit, imported module, imported names, where)`` for every ``from fn...``
    import; a unit is a package of fn or a module of its root."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        unit = parts[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fn"):
                names = [alias.name for alias in node.names]
                found.append((unit, node.module, names, f"{path.relative_to(ROOT)}:{node.lineno}"))
    return found


def test_the_package_root_holds_only_the_core_modules():
    modules = {p.name for p in ROOT.iterdir() if p.suffix == ".py"}
    assert modules == {"__init__.py", "__main__.py", "base.py", "tree.py", "errors.py"}


def test_imports_run_one_way():
    wrong = []
    for unit, module, names, where in _imports():
        if unit in ("__init__", "__main__"):
            continue
        targets = [module.split(".")[1]] if module != "fn" else names
        wrong += [
            f"{where}: {unit} imports {t}" for t in targets if t != unit and t not in ALLOWED[unit]
        ]
    assert not wrong, wrong


def test_no_package_imports_a_private_module_of_another():
    wrong = []
    for unit, module, names, where in _imports():
        parts = module.split(".")[1:]
        owner = parts[0] if parts else None
        if owner == unit:
            continue
        private = [n for n in parts + names if n.startswith("_") and not n.endswith("__")]
        if private:
            wrong.append(f"{where}: {unit} imports {module} {names}")
    assert not wrong, wrong
