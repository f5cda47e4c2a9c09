"""Every public name of the API reference has a complete docstring.

The API pages (docs/api) document each package's ``__all__``. Each name there needs a docstring
with an example (a doctest, ``>>>``), ``Args:`` for a function's or a class's parameters,
``Returns:`` for a function that returns something, ``Attributes:`` for a NamedTuple or a
dataclass with fields. Constants and type aliases keep their docstring in the string after
their assignment, which doctest does not collect: their examples run here. Where Sphinx is
installed (the ``docs`` extra), napoleon's reading of each docstring is checked too: a first line
``text: more`` of a ``Returns:`` section or of a constant is read as a type.

Run as a script, it prints what each name lacks: ``python3 tests/test_api_docstrings.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import importlib
import importlib.util
import inspect
import re
import sys
import typing
from pathlib import Path

import pytest
import torch

import fn

PACKAGES = [
    "fn",
    "fn.base",
    "fn.transforms",
    "fn.tree",
    "fn.collectives",
    "fn.kernels",
    "fn.optim",
    "fn.ddp",
    "fn.fsdp",
    "fn.diloco",
    "fn.integrations.transformers",
    "fn.integrations.accelerate",
    "fn.integrations.lightning",
    "fn.integrations.torchtitan",
    "fn.integrations.torchft",
]
# the optional package each integration module imports
_NEEDS = {
    f"fn.integrations.{name}": name
    for name in ("transformers", "accelerate", "lightning", "torchtitan", "torchft")
}
_SECTION = re.compile(r"^\s*([A-Z][A-Za-z ]*):\s*$", re.M)
_ROOT = Path(fn.__file__).parent


def _packages() -> list[str]:
    return [p for p in PACKAGES if p not in _NEEDS or importlib.util.find_spec(_NEEDS[p])]


def _assigned_docs() -> dict[str, dict[str, str]]:
    """Per module of fn, the string after each module-level assignment, by name."""
    docs: dict[str, dict[str, str]] = {}
    for path in _ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(_ROOT.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        body = ast.parse(path.read_text(encoding="utf-8")).body
        for node, after in zip(body, body[1:], strict=False):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            is_string = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            text = after.value.value if is_string else None
            for target in targets:
                if isinstance(target, ast.Name) and isinstance(text, str):
                    docs.setdefault(module, {})[target.id] = inspect.cleandoc(text)
    return docs


def _kind(obj: object) -> str:
    alias = not inspect.isclass(obj) and type(obj).__module__ in ("typing", "collections.abc")
    if obj is typing.Any or alias:
        return "value"  # a type alias
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        if issubclass(obj, tuple) and hasattr(obj, "_fields"):
            return "namedtuple"
        if dataclasses.is_dataclass(obj):
            return "dataclass"
        return "protocol" if getattr(obj, "_is_protocol", False) else "class"
    return "function" if callable(obj) else "value"


def _value_doc(assigned: dict[str, dict[str, str]], name: str, obj: object) -> str:
    """The docstring of a constant or an alias, from the module that assigns it."""
    for module_name, docs in assigned.items():
        module = sys.modules.get(module_name)
        if name in docs and getattr(module, name, None) is obj:
            return docs[name]
    return ""


def _own_doc(obj: object) -> str:
    """``obj``'s own docstring; none for a class whose docstring NamedTuple or dataclass made."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
    doc = inspect.cleandoc(doc or "")
    made = isinstance(obj, type) and re.fullmatch(rf"{re.escape(obj.__name__)}\(.*\)", doc, re.S)
    return "" if made else doc


def _public() -> list[tuple[str, object, str, str]]:
    """``(name, object, kind, docstring)`` of every public name, each object once."""
    assigned = _assigned_docs()
    reexported = set(importlib.import_module("fn.transforms").__all__)
    seen: set[object] = set()
    out = []
    for package in _packages():
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            kind = _kind(obj)
            # each function, class and module once; a value once per name (aliases of Any)
            key = name if kind == "value" else id(obj)
            if key in seen or (package == "fn" and name in reexported):
                continue  # fn's re-exports of fn.transforms are documented there
            seen.add(key)
            doc = _value_doc(assigned, name, obj) if kind == "value" else _own_doc(obj)
            out.append((f"{package}.{name}", obj, kind, doc))
    return out


def _named_parameters(obj: object) -> tuple[list[str], bool]:
    """The parameters a docstring's ``Args:`` names, and whether it returns something."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return [], True
    names = [p for p in signature.parameters if p not in ("self", "cls")]
    returns = signature.return_annotation not in (None, "None")
    return names, returns


def missing(name: str, obj: object, kind: str, doc: str) -> list[str]:
    """What the docstring of ``obj`` lacks."""
    if not doc.strip():
        return ["docstring"]
    sections = {m.group(1) for m in _SECTION.finditer(doc)}
    lacks = [] if ">>>" in doc else ["example"]
    if kind == "function":
        parameters, returns = _named_parameters(obj)
        if parameters and "Args" not in sections:
            lacks.append("Args")
        if returns and not sections & {"Returns", "Yields"}:
            lacks.append("Returns")
    elif kind in ("namedtuple", "dataclass"):
        fields = obj._fields if kind == "namedtuple" else dataclasses.fields(obj)
        if fields and not sections & {"Attributes", "Args"}:
            lacks.append("Attributes")
    elif kind == "class" and not re.fullmatch(rf"{obj.__name__}\(\)", doc.splitlines()[0]):
        # (a first line "Name()" is the signature autodoc shows: no arguments)
        parameters, _ = _named_parameters(obj)
        if parameters and not sections & {"Args", "Attributes"}:
            lacks.append("Args")
    return lacks


PUBLIC = _public()


@pytest.mark.parametrize(("name", "obj", "kind", "doc"), PUBLIC, ids=[p[0] for p in PUBLIC])
def test_docstring_is_complete(name, obj, kind, doc):
    assert missing(name, obj, kind, doc) == [], f"{name}'s docstring lacks these"


VALUES = [p for p in PUBLIC if p[2] == "value" and ">>>" in p[3]]


@pytest.mark.parametrize(("name", "obj", "kind", "doc"), VALUES, ids=[p[0] for p in VALUES])
def test_the_examples_of_constants_and_aliases_run(name, obj, kind, doc):
    globs = {"fn": fn, "torch": torch, "__name__": name.rsplit(".", 1)[0]}
    test = doctest.DocTestParser().get_doctest(doc, globs, name, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def _members(cls: type) -> dict[str, object]:
    """The public functions and properties of a class and of its bases in fn (the site shows
    what a class inherits from fn's private bases)."""
    out: dict[str, object] = {}
    for owner in cls.__mro__:
        if owner.__module__.split(".")[0] != "fn":
            continue
        for attr, value in vars(owner).items():
            value = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            member = inspect.isfunction(value) or isinstance(value, property)
            doc = inspect.getdoc(value) or "" if member else ""
            if not attr.startswith("_") and doc and ":meta private:" not in doc:
                out.setdefault(attr, value)
    return out


def test_napoleon_reads_no_text_as_a_type():
    napoleon = pytest.importorskip("sphinx.ext.napoleon", reason="Sphinx is in the 'docs' extra")
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    config = napoleon.Config(napoleon_use_ivar=True)
    misread = []
    for name, obj, kind, doc in PUBLIC:
        entries = [(name, "data" if kind == "value" else "function", doc)]
        if inspect.isclass(obj):
            entries = [(name, "class", doc)]
            for attr, value in _members(obj).items():
                what = "property" if isinstance(value, property) else "method"
                entries.append((f"{name}.{attr}", what, inspect.getdoc(value) or ""))
        for qualified, what, text in entries:
            parsed = str(GoogleDocstring(text, config, what=what, name=qualified))
            for line in parsed.splitlines():
                if re.match(r"\s*:(rtype|type):", line):
                    misread.append(f"{qualified}: {line.strip()}")
    assert misread == []


# How a docstring points to a page of the site, and to a section (a heading of level 1 to 3,
# which MyST gives an anchor): docs/algorithms.md, "1-bit Adam". The site links both (docs/conf.py).
_PAGE_MENTION = re.compile(r'(``)?docs/([\w/.-]+\.md)\1?(,\s+"([^"]+)")?')
_OTHER_MENTION = re.compile(r'docs/[\w/.-]+\.md(#|`{0,2}\s*\((section\s+)?")')


def _headings(path: Path) -> set[str]:
    text = re.sub(r"^(```|~~~).*?^\1", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {h.replace("`", "").strip() for h in re.findall(r"^#{1,3} (.+)$", text, re.M)}


def test_page_mentions_name_a_page_and_a_heading():
    docs = _ROOT.parent / "docs"
    texts = [(name, doc) for name, _, _, doc in PUBLIC]
    texts += [(p, inspect.getdoc(importlib.import_module(p)) or "") for p in _packages()]
    for name, obj, _, _ in PUBLIC:
        if inspect.isclass(obj):
            texts += [(f"{name}.{a}", inspect.getdoc(v) or "") for a, v in _members(obj).items()]
    wrong = []
    for name, doc in texts:
        wrong += [f"{name}: {m.group()!r}" for m in _OTHER_MENTION.finditer(doc)]
        for mention in _PAGE_MENTION.finditer(doc):
            page, title = docs / mention.group(2), mention.group(4)
            if not page.is_file():
                wrong.append(f"{name}: no page {mention.group(2)}")
            elif title and " ".join(title.split()) not in _headings(page):
                wrong.append(f"{name}: no heading {title!r} in {mention.group(2)}")
    assert not wrong, 'write docs/page.md, "Heading" (a heading of the page):\n' + "\n".join(wrong)


if __name__ == "__main__":
    lacking = [(name, kind, missing(name, obj, kind, doc)) for name, obj, kind, doc in PUBLIC]
    for name, kind, lacks in lacking:
        if lacks:
            print(f"{name:55s} {kind:10s} {', '.join(lacks)}")
    count = sum(1 for _, _, lacks in lacking if lacks)
    print(f"{len(lacking)} public names, {count} with an incomplete docstring")
