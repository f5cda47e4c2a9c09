"""Sphinx configuration of fn's documentation site.

Build it from the repository root (the ``docs`` extra installs what it needs):

    python3 -m sphinx -W --keep-going -n -b html docs docs/_build/html

The Markdown pages are read by MyST, the notebooks (``docs/notebooks`` links to the repository's
``notebooks/``) are executed during the build by myst-nb, and the API pages are generated from
the docstrings by autodoc and napoleon (Google style).

The notebooks' outputs are cached (jupyter-cache) in ``.jupyter_cache`` under the output folder
(``docs/_build/html/.jupyter_cache`` here), keyed on each notebook and on a hash of fn's sources,
so a build runs only the notebooks whose code or fn has changed since the last one into that
folder. A notebook cell that runs longer than ``FN_NOTEBOOK_TIMEOUT``
seconds (an environment variable; default 1200, enough for a machine under heavy load) fails
the build. ``-D nb_execution_mode=off`` builds the notebooks without running them.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import shutil
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
from myst_parser.slugs import github_slugify  # noqa: E402
from sphinx import addnodes  # noqa: E402
from sphinx.errors import PycodeError  # noqa: E402
from sphinx.pycode import ModuleAnalyzer  # noqa: E402
from sphinx.transforms import SphinxTransform  # noqa: E402
from sphinx.transforms.post_transforms import SphinxPostTransform  # noqa: E402
from sphinx.util import logging  # noqa: E402
from sphinx.util.docutils import SphinxDirective  # noqa: E402
from sphinx.util.inspect import stringify_signature  # noqa: E402
from sphinx.util.typing import stringify_annotation  # noqa: E402

import fn  # noqa: E402

logger = logging.getLogger(__name__)

# torchtitan 0.3.0 needs torch 2.14 (the torchtitan extra), which the development install (torch
# 2.13.0) goes without: there fn.integrations.torchtitan is documented with torchtitan's modules
# mocked: fn's classes with their docstrings, their own members and the signatures of their own
# __init__ (_mocked_signature), as with torchtitan; what they inherit from torchtitan's classes
# (the fields of its configs) is left out, and annotations name torchtitan's classes in full.
# tyro (torchtitan's command-line parser, which fn's config annotations name) comes with
# torchtitan, so it is mocked with it.
TORCHTITAN_MOCKED = importlib.util.find_spec("torchtitan") is None
if TORCHTITAN_MOCKED:
    from sphinx.ext.autodoc.mock import mock  # noqa: E402

    autodoc_mock_imports = ["torchtitan", "tyro"]
    with mock(autodoc_mock_imports):
        import fn.integrations.torchtitan.config_registry  # noqa: E402, F401

# fn.integrations.torchft imports torchft (its extra, not the docs extra) for its annotations
# only: where torchft is missing, it is documented with torchft mocked.
if importlib.util.find_spec("torchft") is None:
    from sphinx.ext.autodoc.mock import mock  # noqa: E402

    autodoc_mock_imports = [*globals().get("autodoc_mock_imports", []), "torchft"]
    with mock(["torchft"]):
        import fn.integrations.torchft  # noqa: E402, F401


def _mocked_signature(app, what, name, obj, options, signature, return_annotation):
    """With torchtitan mocked, a class of fn.integrations.torchtitan whose base is a mock (whose
    ``__new__`` takes anything) shows its own ``__init__``'s signature."""
    mocked = "(*args: Any, **kwargs: Any)"
    if not (TORCHTITAN_MOCKED and what == "class" and signature == mocked):
        return None
    if not name.startswith("fn.integrations.torchtitan."):
        return None
    init = inspect.signature(obj.__init__)
    init = init.replace(parameters=list(init.parameters.values())[1:])
    return stringify_signature(init, show_return_annotation=False), return_annotation


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
    "sphinx_copybutton",  # a copy button on every code block
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "jupyter_execute", "**/.ipynb_checkpoints"]

# -- HTML --------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"fn {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]

# The copy button copies the commands without their prompts ("$ ", ">>> ", "... ") and
# without the output lines that follow a prompt. A "..." that stands for omitted code in an
# excerpt (followed by a comment, or alone) is not a prompt.
copybutton_prompt_text = r"\$ |>>> |\.\.\. (?!\s*#)"
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = True

# -- MyST ------------------------------------------------------------------------------------
myst_enable_extensions = ["amsmath", "dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
# ```math fences are display math, as GitHub renders them too.
myst_fence_as_directive = ["math"]

# -- Notebooks (myst-nb) ---------------------------------------------------------------------
# Executed in the notebooks' own directory by kernels that import this checkout's fn (first on
# their PYTHONPATH); a failing cell fails the build. The executed notebooks are cached in a
# folder named after fn's sources: jupyter-cache matches a notebook by its code cells only, so
# a changed fn needs a new folder, and since the folder is part of the configuration, Sphinx
# then reads every page again. The folders of other sources are removed.


def _fn_sources_key() -> str:
    """A hash of fn's Python and C sources and of torch's version."""
    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted([*(ROOT / "fn").rglob("*.py"), *(ROOT / "fn").rglob("*.c")]):
        data = path.read_bytes()
        digest.update(f"\0{path.relative_to(ROOT).as_posix()}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()[:16]


def _notebook_cache(app, config) -> None:
    """Sets ``nb_execution_cache_path`` under the build's output folder (a build into another
    folder writes nothing into the source tree), in a folder named after fn's sources, and
    removes the folders of other sources."""
    caches = Path(app.outdir) / ".jupyter_cache"
    config.nb_execution_cache_path = str(caches / _fn_sources_key())
    for stale in caches.glob("*"):
        if str(stale) != config.nb_execution_cache_path:
            shutil.rmtree(stale)


nb_execution_mode = "cache"
nb_execution_timeout = int(os.environ.get("FN_NOTEBOOK_TIMEOUT", "1200"))
nb_execution_raise_on_error = True
nb_execution_show_tb = True
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


class NotebookDownload(SphinxTransform):
    """A link under a notebook page's title that downloads the notebook, as committed (without
    outputs). It is added here rather than written in the notebooks, where Jupyter and GitHub
    would show MyST's role syntax."""

    default_priority = 500

    def apply(self, **kwargs) -> None:
        source = Path(self.env.doc2path(self.env.docname))
        title = next(self.document.findall(nodes.title), None)
        if source.suffix != ".ipynb" or title is None:
            return
        link = addnodes.download_reference(
            "", "", reftarget=source.name, refdoc=self.env.docname, refexplicit=True
        )
        link += nodes.literal(source.name, source.name, classes=["xref", "download"])
        paragraph = nodes.paragraph("", "Download this notebook: ", link)
        title.parent.insert(title.parent.index(title) + 1, paragraph)


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
    "torchft",
    "tyro",
}
_EXTERNAL = "|".join(sorted(re.escape(m) for m in _THIRD_PARTY | set(sys.stdlib_module_names)))
_BUILTINS = "|".join(
    sorted(n for n, v in vars(builtins).items() if isinstance(v, type) and not n.startswith("_"))
    + ["None", "True", "False", "Ellipsis", "NotImplemented"]
)
# The annotations of torchtitan's config fields that fn's subclasses inherit (strings in
# torchtitan's modules) and tyro's CLI marker name these without their package; so do the
# fields fn's configs annotate with torchtitan's config classes while torchtitan is mocked.
_UNQUALIFIED = r"Literal\[.*|Suppress"
if TORCHTITAN_MOCKED:
    _UNQUALIFIED += r"|ParallelismConfig|TrainingConfig"
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
    "fn.diloco": _exports("fn.diloco"),
    "fn.integrations.transformers": _exports("fn.integrations.transformers"),
    "fn.integrations.accelerate": _exports("fn.integrations.accelerate"),
    "fn.integrations.lightning": _exports("fn.integrations.lightning"),
    "fn.integrations.torchtitan": _exports("fn.integrations.torchtitan"),
    "fn.integrations.torchft": _exports("fn.integrations.torchft"),
}
# The groups of each package's summary table (``fn-summary``), in the order its page shows them;
# its entries (``fn-autopackage``) follow the same order. What a newcomer reaches for comes
# first; what fn's own optimizers and integrations are built from comes last, under "Building
# blocks". A group may name a re-export documented on another page (fn's optimizers): the table
# links to its entry there. Every name a page documents is in exactly one group: the build
# warns about one that is not, and lists it last.
API_GROUPS: dict[str, list[tuple[str, str]]] = {
    "fn": [
        ("Optimizers", "onebit_adam zero_one_adam onebit_lamb adam adamw lamb sgd"),
        (
            "Running an optimizer",
            "apply_updates update_and_apply chain set_hyperparams get_hyperparam"
            " GradientTransformation",
        ),
        ("Errors", "NonFiniteError"),
        (
            "Building blocks",
            "CompressedOptimizer staged StagedState identity stateless stateless_with_tree_map"
            " EmptyState",
        ),
    ],
    "fn.base": [
        ("Type aliases", "Params Updates OptState"),
        ("Protocols", "TransformInitFn TransformUpdateFn FastStepFn"),
        (
            "State field marks",
            "SecondMomentField SecondMoment PerRankField PerRank marked_fields",
        ),
    ],
    "fn.tree": [
        ("Structure", "PyTree tree_leaves tree_flatten tree_unflatten tree_map"),
        ("New trees", "tree_zeros_like tree_full_like tree_cast"),
        (
            "Arithmetic",
            "tree_add tree_sub tree_scale tree_vdot tree_sum_of_squares tree_l2_norm"
            " tree_numel tree_all_finite",
        ),
    ],
    "fn.transforms": [
        ("Optimizers", "onebit_adam zero_one_adam onebit_lamb adam adamw lamb sgd"),
        ("Freeze and local-step schedules", "AutoFreeze ZeroOneAdamSchedule Schedule"),
        (
            "Composable transforms",
            "scale_by_adam scale_by_learning_rate scale_by_trust_ratio trace"
            " add_decayed_weights masked set_to_zero",
        ),
        ("Reading a state", "momentum_of"),
        (
            "States",
            "OnebitAdamState ZeroOneAdamState OnebitLambState AutoState ScaleByAdamState"
            " ScaleByLearningRateState TraceState MaskedState",
        ),
        (
            "Building blocks",
            "onebit_adam_sharded onebit_lamb_sharded OnebitAdamPlan ZeroOneAdamPlan"
            " OnebitLambPlan gradient_energy",
        ),
    ],
    "fn.collectives": [
        ("Communicators", "Local Simulated ProcessGroup simulate replicate Comm"),
        (
            "Compressed allreduces",
            "onebit_allreduce loco_allreduce quantized_allreduce dense_allreduce"
            " topk_allreduce cast_allreduce",
        ),
        (
            "States",
            "OnebitAllreduceState LocoAllreduceState TopkAllreduceState TopkOwnerState",
        ),
        (
            "Exchanges and their header",
            "Compressor Exchanged HEADER_BYTES topk_exchange_form TOPK_EXCHANGES"
            " cast_exchange_form",
        ),
        ("Participation", "Participation participants_mean"),
        ("Errors and exit", "CollectiveTimeoutError exit_distributed"),
        (
            "Building blocks",
            "compressed_allreduce quantized_reduce_scatter quantized_reduce_scatter_into"
            " quantized_all_gather_into ErrorFeedback QuantizedError PackedSigns"
            " init_error_feedback padded_numel quantized_padded_numel error_feedback_leaves"
            " ErrorFeedbackField ParamShapedErrorFeedbackField LaidOutAsParams positional_leaves"
            " ERROR_DTYPES check_error_dtype SimulatedGroup"
            " topk_message_bytes CAST_DTYPES local_shard as_sharded_like",
        ),
    ],
    "fn.kernels": [
        (
            "Kernel sets and accelerators",
            "kernel_set select_kernels KERNEL_NAMES get_accelerator set_accelerator"
            " Accelerator register_accelerator register_kernels tuning_pending",
        ),
        (
            "Building blocks: 1-bit compression",
            "packbits unpackbits sign_compress feedback_sign_compress feedback_apply_error"
            " sign_sum_compress sign_sum_apply_error unpack_scaled",
        ),
        ("Building blocks: Adam steps", "adam_direction adam_apply adamw_step sqrt_rn"),
        (
            "Building blocks: quantization",
            "quantize dequantize loco_quantize loco_error dequantize_sum dequantize_into sum_ranks"
            " check_quant_args",
        ),
    ],
    "fn.optim": [
        ("Optimizers", "OnebitAdam ZeroOneAdam OnebitLamb FunctionalOptimizer"),
        ("Checkpoints", "PerRankState"),
        (
            "From DeepSpeed",
            "from_deepspeed convert_checkpoint checkpoint_files scheduler_from_deepspeed"
            " DeepSpeedLR",
        ),
        ("Building blocks", "OnebitFamily default_comm"),
    ],
    "fn.ddp": [
        ("fn.optim optimizers on DDP", "register"),
        ("Comm hooks", "onebit_hook OnebitHookState loco_hook LocoHookState"),
    ],
    "fn.fsdp": [
        ("Optimizers", "OnebitAdam OnebitLamb ZeroOneAdam"),
        ("Checkpoints", "TrainingCheckpoint read_onebit_state CheckpointWriteError"),
        (
            "Compressed collectives",
            "loco_reduce_scatter LocoReduceScatterHandle quantized_all_gather",
        ),
        (
            "Building blocks",
            "ShardedOnebitOptimizer QuantizedReduceScatter QuantizedAllGather CommCache"
            " reduce_scale",
        ),
    ],
    "fn.diloco": [
        ("Training with DiLoCo", "DiLoCo OUTER_RULES"),
        ("Outer rules", "nesterov sparseloco compression COMPRESSIONS"),
        ("Building blocks", "outer_step outer_update OuterStep pseudo_gradient trainable_params"),
    ],
    "fn.integrations.transformers": [("Hugging Face Trainer", "attach FnTrainerCallback")],
    "fn.integrations.accelerate": [("Accelerate", "attach")],
    "fn.integrations.lightning": [("PyTorch Lightning", "FnCallback check_strategy")],
    "fn.integrations.torchtitan": [
        ("Configs", "onebit_config check_supported"),
        (
            "torchtitan's components",
            "OnebitTrainer OnebitOptimizersContainer OnebitCheckpointManager ShardMeshParallelize",
        ),
    ],
    "fn.integrations.torchft": [
        ("Elastic DiLoCo", "ElasticDiLoCo POSITIONAL_COMPRESSIONS"),
        ("Building blocks", "ManagerComm"),
    ],
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


def _groups(module_name: str, warn: bool, location: object = None) -> list[tuple[str, list[str]]]:
    """The groups of ``module_name``'s page (``API_GROUPS``), each name checked against the
    package's ``__all__`` (``warn``: a warning for each mistake); the documented names no group
    places come last, in a group of their own."""
    exported = set(importlib.import_module(module_name).__all__)
    groups = [(title, names.split()) for title, names in API_GROUPS[module_name]]
    placed = [name for _, names in groups for name in names]
    unknown = [name for name in placed if name not in exported]
    repeated = sorted({name for name in placed if placed.count(name) > 1})
    unplaced = [name for name in API[module_name] if name not in placed]
    for problem, names in (
        ("not in its __all__", unknown),
        ("in more than one group", repeated),
        ("in no group", unplaced),
    ):
        if names and warn:
            logger.warning(
                "API_GROUPS (docs/conf.py) of %s: %s %s",
                module_name,
                ", ".join(names),
                problem,
                location=location,
            )
    if unplaced:
        groups.append(("Not yet placed in API_GROUPS", unplaced))
    return groups


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


def _docstring(module_name: str, name: str, obj: object) -> list[str]:
    """The lines of the docstring that the entry of ``module_name.name`` shows."""
    if _is_alias(module_name, name, obj):
        return _value_doc(module_name, name, obj)
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return inspect.cleandoc(doc or "").splitlines()


# A full stop that ends a sentence: before a capital, a literal or the end, not after an
# abbreviation ("e.g. a", "Lu et al. 2022").
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bal)(?<!\betc)\.(?=\s+[A-Z`(:]|$)")


def _first_sentence(doc: list[str]) -> str:
    """The first sentence of a docstring, on one line (a first line that only overrides the
    signature, ``Local()``, skipped)."""
    paragraphs = [" ".join(p.split()) for p in "\n".join(doc).split("\n\n") if p.strip()]
    if paragraphs and re.fullmatch(r"\w+\(.*\)", paragraphs[0]):
        paragraphs = paragraphs[1:]
    text = paragraphs[0] if paragraphs else ""
    literals = [m.span() for m in re.finditer(r"``.+?``|`[^`]+`", text)]
    for end in _SENTENCE_END.finditer(text):
        if not any(start < end.start() < stop for start, stop in literals):
            return text[: end.end()]
    return text


class Summary(SphinxDirective):
    """``.. fn-summary:: fn.fsdp [more packages]``: a table per group of ``API_GROUPS``, each
    name linked to its entry beside the first sentence of its docstring."""

    required_arguments = 1
    optional_arguments = 8

    def run(self) -> list[nodes.Node]:
        lines = []
        for module_name in self.arguments:
            module = importlib.import_module(module_name)
            # Short names in the summaries resolve as in the entries, in the package.
            lines += [f".. py:currentmodule:: {module_name}", ""]
            for title, names in _groups(module_name, warn=False):
                lines += [f".. rubric:: {title}", "   :class: fn-summary-group", ""]
                lines += [".. list-table::", "   :class: fn-summary", "   :widths: 3 5", ""]
                for name in names:
                    obj = getattr(module, name)
                    summary = _link_mentions_in(_first_sentence(_docstring(module_name, name, obj)))
                    lines += [f"   * - :py:obj:`{name} <{module_name}.{name}>`"]
                    lines += [f"     - {summary}" if summary else "     -"]
                lines.append("")
        return self.parse_text_to_nodes("\n".join(lines))


class AutoPackage(SphinxDirective):
    """``.. fn-autopackage:: fn.fsdp``: the package's docstring, then an entry per name that its
    page documents (``API``), group by group in ``API_GROUPS``' order."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        module = importlib.import_module(module_name)
        lines = [f".. automodule:: {module_name}", ""]
        groups = _groups(module_name, warn=True, location=self.get_location())
        for title, names in groups:
            names = [name for name in names if name in API[module_name]]
            if names and len(groups) > 1:
                lines += [f".. rubric:: {title}", "   :class: fn-entry-group", ""]
            for name in names:
                lines += self._entry(module_name, name, getattr(module, name))
        return self.parse_text_to_nodes("\n".join(lines))

    def _entry(self, module_name: str, name: str, obj: object) -> list[str]:
        full_name = f"{module_name}.{name}"
        if _is_alias(module_name, name, obj):
            doc = _value_doc(module_name, name, obj)
            self.env.events.emit("autodoc-process-docstring", "data", full_name, obj, {}, doc)
            lines = [f".. py:data:: {name}", f"   :module: {module_name}"]
            lines += [f"   :value: {_value_repr(obj)}", ""]
            return lines + [f"   {line}" if line else "" for line in doc] + [""]
        if inspect.isclass(obj):
            kind = "autoexception" if issubclass(obj, BaseException) else "autoclass"
            lines = [f".. {kind}:: {full_name}", "   :members:"]
            if private := _private_bases(obj):
                # What the class inherits from fn's private bases is part of its own API.
                others = [c.__name__ for c in obj.__mro__[1:] if c not in private]
                lines.append(f"   :inherited-members: {', '.join(others)}")
            return lines + [""]
        return [f".. autofunction:: {full_name}", ""]


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


@functools.cache  # the docstrings name the same objects many times
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


# -- Links inside the docstrings ---------------------------------------------------------------
# Docstrings are read as plain text too (help(), doctest, an editor's hover), so they name fn's
# objects as literals (``fn.fsdp.OnebitAdam``, ``fn.adam(lr=1e-3)``) and the site's pages by
# their path in the repository (docs/algorithms.md, "1-bit Adam"). On the site, each becomes a
# link: a literal that starts with a dotted ``fn.`` name (a call's arguments may follow) is a
# ``:py:obj:`` reference to that name, and a page mention is a link to the page and section. The
# build is nitpicky (-n), so a literal naming no documented object, a page that does not exist
# or a section title that is not one of its headings fails it.
_FN_LITERAL = re.compile(
    r"(?<![`:\w])(?P<quote>``?)(?P<name>fn(?:\.\w+)+)(?P<call>\([^`\n]*\))?(?P=quote)(?![`\w])"
)
_DOCS_MENTION = re.compile(
    r'(?P<quote>``)?docs/(?P<path>[\w/.-]+?)\.md(?(quote)``)(?:,\s+"(?P<title>[^"]+)")?'
)
# A section named in another way than ``docs/page.md, "Title"``: only the page would be linked.
_DOCS_MENTION_ELSE = re.compile(r'docs/[\w/.-]+\.md(#|`{0,2}\s*\((section\s+)?")')


def _link_mentions_in(text: str) -> str:
    """``text`` (reStructuredText) with its fn literals and page mentions as references."""

    def fn_reference(match: re.Match) -> str:
        shown = match["name"] + (match["call"] or "")
        if shown == match["name"]:
            return f":py:obj:`{shown}`"
        return f":py:obj:`{shown} <{match['name']}>`"

    def docs_reference(match: re.Match) -> str:
        section = f', "{" ".join(match["title"].split())}"' if match["title"] else ""
        return f":fn-docs:`docs/{match['path']}.md{section}`"

    return _DOCS_MENTION.sub(docs_reference, _FN_LITERAL.sub(fn_reference, text))


def _link_mentions(app, what, name, obj, options, lines: list[str]) -> None:
    text = "\n".join(lines)
    for mention in _DOCS_MENTION_ELSE.finditer(text):
        logger.warning(
            '%s names a section as %r: write docs/page.md, "Section title"', name, mention.group()
        )
    lines[:] = _link_mentions_in(text).split("\n")


def _docs_role(name, rawtext, text, lineno, inliner, options=None, content=()):
    """``:fn-docs:`docs/algorithms.md, "1-bit Adam"```: a link to the page, titled as the page,
    and one to its section (``, "Title"`` optional), titled as the section. MyST resolves both
    and warns about a page or section it does not find."""
    mention = _DOCS_MENTION.fullmatch(" ".join(text.split()))
    if mention is None:
        message = inliner.reporter.error(f"not a docs/ page mention: {text!r}", line=lineno)
        return [inliner.problematic(rawtext, rawtext, message)], [message]
    env = inliner.document.settings.env
    anchor = github_slugify(mention["title"]) if mention["title"] else ""
    source, line = inliner.reporter.get_source_and_line(lineno)

    def reference(target_id: str) -> addnodes.pending_xref:
        shown = f"docs/{mention['path']}.md" + (f"#{target_id}" if target_id else "")
        node = addnodes.pending_xref(
            "",
            nodes.inline(shown, shown),
            refdomain="doc",
            reftype="myst",
            reftarget=mention["path"],
            reftargetid=target_id or None,
            refexplicit=False,
            refdoc=env.docname,
        )
        node.source, node.line = source, line
        return node

    if not anchor:
        return [reference("")], []
    return [reference(""), nodes.Text(", “"), reference(anchor), nodes.Text("”")], []


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
    Downloads of files under docs/, such as the notebooks, stay downloads.
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
                # Through docs/notebooks, a notebook's download is a file under docs/.
                docdir = (Path(env.srcdir).resolve() / node["refdoc"]).parent
                path = Path(os.path.normpath(docdir / node["reftarget"]))
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
    app.connect("config-inited", _notebook_cache)
    app.connect("autodoc-process-signature", _mocked_signature, priority=400)  # before aliases
    app.add_directive("fn-summary", Summary)
    app.add_directive("fn-autopackage", AutoPackage)
    app.add_role("fn-docs", _docs_role)
    app.connect("autodoc-process-docstring", _link_mentions)
    app.add_directive("fn-reexports", ReExports)
    app.connect("missing-reference", _resolve_fn_reference)
    app.add_post_transform(RepositoryLinks)
    app.add_transform(NotebookDownload)
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("autodoc-process-signature", _alias_signature)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
