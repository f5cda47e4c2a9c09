"""Sphinx configuration of fn's documentation site.

Build it from the repository root (the ``docs`` extra installs what it needs):

    python3 -m sphinx -W --keep-going -n -b html docs docs/_build/html

The Markdown pages are read by MyST, the notebooks (``docs/notebooks`` links to the repository's
``notebooks/``) are executed during the build by myst-nb, and the API pages are generated from
the docstrings by autodoc and napoleon (Google style).
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import os
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# This checkout's fn, also when another fn is installed.
sys.path.insert(0, str(ROOT))
# The notebooks' kernels inherit the environment: their models are tiny, and more threads than
# one only slow them down on a shared machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from docutils import nodes  # noqa: E402
from sphinx import addnodes  # noqa: E402
from sphinx.errors import PycodeError  # noqa: E402
from sphinx.pycode import ModuleAnalyzer  # noqa: E402
from sphinx.transforms.post_transforms import SphinxPostTransform  # noqa: E402
from sphinx.util.docutils import SphinxDirective  # noqa: E402
from sphinx.util.typing import stringify_annotation  # noqa: E402

import fn  # noqa: E402


def _repository_url() -> str | None:
    """The GitHub repository named in pyproject.toml's [project.urls], if any."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return None
    project_table = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for key in ("Repository", "Source", "Source Code", "Homepage"):
        url = project_table.get("urls", {}).get(key, "")
        if url.startswith("https://github.com/"):
            return url.rstrip("/").removesuffix(".git")
    return None


REPOSITORY = _repository_url()

project = "fn"
author = "fn contributors"
copyright = "fn contributors"
release = fn.__version__
version = release

extensions = [
    "myst_nb",  # MyST Markdown pages and Jupyter notebooks (it loads myst_parser itself)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx-mathjax-offline",  # MathJax served with the site: the pages render math offline
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "jupyter_execute", "**/.ipynb_checkpoints"]

# -- HTML --------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"fn {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]

# -- MyST ------------------------------------------------------------------------------------
myst_enable_extensions = ["amsmath", "dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# ```math fences are display math, as GitHub renders them too.
myst_fence_as_directive = ["math"]

# -- Notebooks (myst-nb) ---------------------------------------------------------------------
# Executed on every build, in the notebooks' own directory (their first cell finds this
# checkout's fn from there); a failing cell fails the build. For a quick look at the other
# pages, ``-D nb_execution_mode=off`` builds the notebooks without running them.
nb_execution_mode = "force"
nb_execution_timeout = 180
nb_execution_raise_on_error = True
nb_execution_show_tb = True

# -- autodoc and napoleon --------------------------------------------------------------------
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

# -- Cross-references ------------------------------------------------------------------------
# Nitpicky (-n): every reference must resolve. The site has no network access to fetch other
# projects' inventories, so references to the names of Python itself and of the packages fn
# builds on are left as plain text; a reference to a missing fn name still fails.
_THIRD_PARTY = {
    "torch",
    "numpy",
    "transformers",
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "torchtitan",
    "tyro",
}
_EXTERNAL = "|".join(sorted(re.escape(m) for m in _THIRD_PARTY | set(sys.stdlib_module_names)))
_BUILTINS = "|".join(
    sorted(n for n, v in vars(builtins).items() if isinstance(v, type) and not n.startswith("_"))
    + ["None", "True", "False", "Ellipsis", "NotImplemented"]
)
# The annotations of torchtitan's config fields that fn's subclasses inherit (strings in
# torchtitan's modules) and tyro's CLI marker name these without their package.
_UNQUALIFIED = r"Literal\[.*|Suppress"
nitpick_ignore_regex = [
    (r"py:.*", rf"({_EXTERNAL})\..+"),  # a name in another package: torch.Tensor, os.PathLike
    (r"py:mod", rf"({_EXTERNAL})"),
    (r"py:.*", rf"(builtins\.)?({_BUILTINS})"),
    (r"py:class", _UNQUALIFIED),
]
# Annotations that name a private alias (strings under ``from __future__ import annotations``):
# shown as what they stand for.
autodoc_type_aliases = {
    "leafwise.LearningRate": "float | collections.abc.Callable[[torch.Tensor], torch.Tensor]",
    "DeviceMesh": "torch.distributed.device_mesh.DeviceMesh",
    "PyTree": "fn.tree.PyTree",
    "Params": "fn.base.Params",
    "Updates": "fn.base.Updates",
    "OptState": "fn.base.OptState",
}


# -- The API pages ---------------------------------------------------------------------------
# Each public object is documented once, on the page of the package that defines it: fn's
# re-exports of fn.transforms are documented under fn.transforms (the fn page links to them),
# and fn.base's protocols and marks that fn does not re-export under fn.base. ``fn-autopackage``
# documents exactly these names, so every name in a package's ``__all__`` gets an entry.
def _exports(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    return [n for n in module.__all__ if not inspect.ismodule(getattr(module, n))]


API: dict[str, list[str]] = {
    "fn.transforms": _exports("fn.transforms"),
    "fn": [n for n in _exports("fn") if n not in _exports("fn.transforms")],
    "fn.base": [n for n in _exports("fn.base") if n not in _exports("fn")],
    "fn.tree": _exports("fn.tree"),
    "fn.collectives": _exports("fn.collectives"),
    "fn.kernels": _exports("fn.kernels"),
    "fn.optim": _exports("fn.optim"),
    "fn.ddp": _exports("fn.ddp"),
    "fn.fsdp": _exports("fn.fsdp"),
    "fn.integrations.transformers": _exports("fn.integrations.transformers"),
    "fn.integrations.accelerate": _exports("fn.integrations.accelerate"),
    "fn.integrations.lightning": _exports("fn.integrations.lightning"),
    "fn.integrations.torchtitan": _exports("fn.integrations.torchtitan"),
}
# Where each public object is documented, by identity (functions and classes) or by the names
# under which the packages export it.
_HOME_BY_ID: dict[int, str] = {}
_HOME_BY_NAME: dict[str, str] = {}
for _module_name, _names in API.items():
    _module = importlib.import_module(_module_name)
    for _name in _names:
        _obj = getattr(_module, _name)
        _home = f"{_module_name}.{_name}"
        if inspect.isclass(_obj) or inspect.isfunction(_obj):
            _HOME_BY_ID[id(_obj)] = _home
        _HOME_BY_NAME[_home] = _home
for _module_name in ("fn", "fn.base", "fn.transforms"):
    for _name in _exports(_module_name):
        _obj = getattr(importlib.import_module(_module_name), _name)
        _HOME_BY_NAME.setdefault(
            f"{_module_name}.{_name}", _HOME_BY_ID.get(id(_obj), f"fn.transforms.{_name}")
        )


def _is_alias(module_name: str, name: str, obj: object) -> bool:
    """Whether a public name is a value (a constant, a type alias) rather than a function or
    class defined under that name."""
    if inspect.ismodule(obj):
        return False
    defined_as = getattr(inspect.unwrap(obj), "__name__", None) if callable(obj) else None
    defined_in = getattr(obj, "__module__", None) or ""
    return not (defined_as == name and (defined_in == "fn" or defined_in.startswith("fn.")))


def _value_doc(module_name: str, name: str, obj: object) -> list[str]:
    """The doc comment or docstring of a module-level value, from the module that assigns it
    (a package's ``__init__`` only re-exports it, so autodoc does not find it there)."""
    candidates = [module_name] + sorted(
        m for m in sys.modules if m.startswith(module_name + ".") or m.startswith("fn.")
    )
    for candidate in candidates:
        module = sys.modules.get(candidate)
        if module is None or vars(module).get(name) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(candidate).find_attr_docs()
        except PycodeError:
            continue
        if ("", name) in docs:
            return list(docs[("", name)])
    return []


def _private_bases(cls: type) -> list[type]:
    """The classes ``cls`` inherits from that are fn's but not documented, themselves or as the
    base of a documented base (whose entry shows their members)."""
    documented = [base for base in cls.__mro__[1:] if id(base) in _HOME_BY_ID]
    covered = {c for base in documented for c in base.__mro__}
    return [
        base
        for base in cls.__mro__[1:]
        if base.__module__.split(".")[0] == "fn" and base not in covered
    ]


def _value_repr(obj: object) -> str:
    if isinstance(obj, (tuple, list, str, int, float, torch.dtype)):
        return repr(obj)
    return stringify_annotation(obj, "fully-qualified-except-typing")


class AutoPackage(SphinxDirective):
    """``.. fn-autopackage:: fn.fsdp``: the package's docstring, then an entry per public name
    in ``__all__``'s order (``API`` says which names a package's page documents)."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        module = importlib.import_module(module_name)
        lines = [f".. automodule:: {module_name}", ""]
        for name in API[module_name]:
            obj = getattr(module, name)
            full_name = f"{module_name}.{name}"
            if _is_alias(module_name, name, obj):
                doc = _value_doc(module_name, name, obj)
                self.env.events.emit("autodoc-process-docstring", "data", full_name, obj, {}, doc)
                lines += [f".. py:data:: {name}", f"   :module: {module_name}"]
                lines += [f"   :value: {_value_repr(obj)}", ""]
                lines += [f"   {line}" if line else "" for line in doc] + [""]
            elif inspect.isclass(obj):
                kind = "autoexception" if issubclass(obj, BaseException) else "autoclass"
                lines += [f".. {kind}:: {full_name}", "   :members:"]
                if private := _private_bases(obj):
                    # What the class inherits from fn's private bases is part of its own API.
                    others = [c.__name__ for c in obj.__mro__[1:] if c not in private]
                    lines.append(f"   :inherited-members: {', '.join(others)}")
                lines.append("")
            else:
                lines += [f".. autofunction:: {full_name}", ""]
        return self.parse_text_to_nodes("\n".join(lines))


class ReExports(SphinxDirective):
    """``.. fn-reexports:: fn fn.transforms``: a list of links to the names the first package
    re-exports from the second, which are documented there."""

    required_arguments = 2

    def run(self) -> list[nodes.Node]:
        _, source = self.arguments
        items = "\n".join(f"- :py:obj:`{source}.{n}`" for n in API[source])
        return self.parse_text_to_nodes(items + "\n")


def _lookup(target: str) -> object | None:
    """The object that a dotted name reaches by imports and attributes, or None."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _public_name(target: str) -> str | None:
    """The documented name of the fn object that ``target`` names, or None.

    ``target`` may name it through a re-export (``fn.adam``) or its defining module
    (``fn.fsdp.onebit.OnebitAdam``), and may go on to a member (``...OnebitAdam.step``).
    """
    if target in _HOME_BY_NAME:
        return _HOME_BY_NAME[target]
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        home = _HOME_BY_NAME.get(head)
        if home is None:
            obj = _lookup(head) if head.startswith("fn.") or head == "fn" else None
            home = _HOME_BY_ID.get(id(obj)) if obj is not None else None
        if home is not None:
            return ".".join([home, *parts[i:]])
    return None


def _resolve_fn_reference(app, env, node, contnode):
    """Resolve a Python reference to an fn object by the name it is documented under.

    A short name is looked up as Python looks it up where the documenting object is defined:
    in its class, then in its module's namespace. A name no public fn object answers to is left
    unresolved, so nitpicky mode reports it.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    candidates = [target]
    module_name, class_name = node.get("py:module"), node.get("py:class")
    if module_name:
        owner = _lookup(f"{module_name}.{class_name}") if class_name else None
        if class_name:
            candidates.append(f"{module_name}.{class_name}.{target}")
        defining = getattr(owner, "__module__", None) or module_name
        candidates += [f"{module_name}.{target}", f"{defining}.{target}"]
    domain = env.domains["py"] if hasattr(env, "domains") else env.get_domain("py")
    for candidate in candidates:
        if not (candidate == "fn" or candidate.startswith("fn.")):
            continue
        public = _public_name(candidate)
        if public is None or public == target:
            continue
        found = domain.resolve_xref(
            env, node["refdoc"], app.builder, node["reftype"], public, node, contnode
        )
        if found is not None:
            return found
    return None


def _alias_signature(app, what, name, obj, options, signature, return_annotation):
    """Apply ``autodoc_type_aliases`` to annotations that autodoc shows as written: those of a
    ``__signature__`` built at run time (fn.transforms.hyperparameters) stay strings."""
    if signature is None and return_annotation is None:
        return None
    out = []
    for text in (signature, return_annotation):
        for alias, value in autodoc_type_aliases.items():
            if text:
                text = re.sub(rf"(?<![\w.]){re.escape(alias)}(?![\w])", value, text)
        if text:
            # Sphinx writes an alias inside a union or a subscript as its repr.
            text = re.sub(r"TypeAliasForwardRef\('([\w.]+)'\)", r"\1", text)
        out.append(text)
    return tuple(out)


def _skip_member(app, what, name, obj, skip, options):
    # A NamedTuple field's generated getter ("Alias for field number 0"); the class docstring's
    # Attributes section describes the fields.
    if what in ("class", "exception") and (obj.__doc__ or "").startswith("Alias for field number"):
        return True
    # A class attribute that holds a function documented elsewhere (fn.fsdp.OnebitAdam's
    # sharded_rule is fn.transforms.onebit_adam_sharded): its page is the function's own.
    if what == "class" and callable(obj) and getattr(obj, "__name__", name) != name:
        return True
    return None


class RepositoryLinks(SphinxPostTransform):
    """Links from the pages to files of the repository outside docs/.

    The pages are written to be read on GitHub too, so they link to repository paths:
    ``../notebooks/README.md``, ``../../examples/fsdp_onebit.py``. A link to a file that the site
    shows as a page (a notebook through ``docs/notebooks``, ``benchmarks/README.md`` included by
    ``benchmarks.md``) goes to that page. Other files: on GitHub when pyproject.toml names the
    repository; otherwise Markdown files get a relative link to the file in the checkout
    (Sphinx does not check it), and other files (examples/*.py) are copied as downloads.
    """

    default_priority = 5  # before MyST resolves its links (and warns about missing documents)

    def run(self, **kwargs) -> None:
        env = self.env
        srcdir = Path(env.srcdir)
        pages: dict[Path, str] = {}
        for docname in env.found_docs:
            pages.setdefault(Path(env.doc2path(docname)).resolve(), docname)
        for docname, dependencies in env.dependencies.items():
            for dependency in dependencies:
                if str(dependency).endswith(".md"):
                    pages.setdefault((srcdir / dependency).resolve(), docname)
        for node in list(self.document.findall(addnodes.pending_xref)):
            if node.get("reftype") != "myst" or node.get("refdomain") != "doc":
                continue
            target = node["reftarget"]
            if target in env.all_docs:
                continue
            found = [
                path.resolve()
                for suffix in (".md", ".ipynb")
                if (path := srcdir / (target + suffix)).is_file()
            ]
            if not found:
                continue
            if found[0] in pages:
                node["reftarget"] = pages[found[0]]
            else:
                node.replace_self(self._external(found[0], node))
        if REPOSITORY:
            for node in list(self.document.findall(addnodes.download_reference)):
                docdir = Path(env.doc2path(node["refdoc"])).parent
                path = (docdir / node["reftarget"]).resolve()
                if not path.is_relative_to(DOCS):
                    node.replace_self(self._external(path, node))

    def _external(self, path: Path, node: nodes.Element) -> nodes.reference:
        relative = path.relative_to(ROOT).as_posix()
        if REPOSITORY:
            uri = f"{REPOSITORY}/blob/main/{relative}"
        else:
            page = Path(self.app.outdir, self.env.docname).parent
            uri = Path(os.path.relpath(path, page)).as_posix()
        reference = nodes.reference("", "", refuri=uri, internal=False)
        reference += node.children or [nodes.literal(relative, relative)]
        return reference


def setup(app):
    app.add_directive("fn-autopackage", AutoPackage)
    app.add_directive("fn-reexports", ReExports)
    app.connect("missing-reference", _resolve_fn_reference)
    app.add_post_transform(RepositoryLinks)
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("autodoc-process-signature", _alias_signature)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
