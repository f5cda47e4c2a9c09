"""The package layout: every module of fn is reachable by its dotted name."""

from __future__ import annotations

import importlib
import pkgutil
import types

import fn


def _packages() -> list[types.ModuleType]:
    found = [fn]
    for info in pkgutil.walk_packages(fn.__path__, "fn.", onerror=lambda name: None):
        if info.ispkg:
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
