"""Optimizer-state bytes and peak memory of the 1-bit optimizers against torch.optim.Adam.

``W`` gloo ranks (``--world-sizes``, one process per rank, all on this machine) each build the same
MLP of about ``--params`` parameters (``cluster.py``'s shape: ``w -> 4w -> 4w -> w``; fp32, or
``--dtype bfloat16``) and train it on random batches of 8 rows (loss: the mean square of the output)
with one optimizer (one launch per optimizer, so that every row's peak is its own):
``torch.optim.Adam``, ``torch.optim.AdamW(fused=True)`` and the ``fn.optim`` adapters
``OnebitAdam``, ``ZeroOneAdam`` and ``OnebitLamb`` with ``freeze_step=--freeze`` (0/1 Adam:
``var_freeze_step``; its schedule, not 1-bit Adam's phases, decides which of its updates communicate
1 bit). Two measurements per run: ``warmup`` after ``--freeze - 1`` updates (the last dense update
of 1-bit Adam and LAMB), ``compressed`` after ``--compressed-steps`` more.

Columns, per rank (rank 0's bytes; the peaks are the largest of the ranks'):

- ``state``: the optimizer state, the sum of the sizes of the unique untyped storages of every
  tensor reachable from it (dicts, lists, tuples, NamedTuples and other pytree nodes walked;
  storages counted once, by address). ``torch.optim``: ``optimizer.state``. The ``fn.optim``
  adapters: the live functional state of every param group, plus the fp32 master copy of
  fp16/bf16 params (fp32 params are their own master, so there is none).
- ``x Adam``: ``state`` over ``torch.optim.Adam``'s ``state`` measured in the same run.
- ``spare``: the adapter's second state, which the next step is donated to write into
  (storages not already in ``state``); ``grads``: its gradient buffer, into which the params'
  ``.grad`` are copied before every step. Neither exists for ``torch.optim``; both are part of
  the peak.
- ``peak``: ``ru_maxrss`` (``resource.getrusage``), the process's peak resident memory;
  ``+peak``: the peak over the one measured once the model and its gradients exist (after a
  first forward and backward, and after the optimizer ran once through both phases on a tiny
  param, so that the code its steps load is not counted): what the optimizer and its steps add
  to the process's own (model, gradients, activations, libraries).

``today's layout (computed)`` rows give the fp32 layout of DeepSpeed 0.18.9's optimizers, from
the formula: ``4 (3n + n/W)`` bytes for 1-bit Adam (``exp_avg``,
``exp_avg_sq`` and ``worker_error`` of ``n`` values each, ``server_error`` of ``n/W``) and
``4 (4n + n/W)`` for 1-bit LAMB (with ``exp_avg_sq_fresh``). Targets (``W = 4``, against
``torch.optim.Adam``): in the compressed phase 1-bit Adam <= 1.2x with fp32 error feedback,
<= 0.9x with bf16 error feedback, 1-bit LAMB <= 1.75x and <= 1.4x; in the warmup phase both
<= 1.0x. A target is met when the printed ratio (two decimals) is at most it.

An optimizer is ``NAME`` or ``NAME:KEY=VALUE,...`` with extra keyword arguments of the adapter
(``onebit-adam:error_dtype=bfloat16``; ``bfloat16``, ``float16`` and ``float32`` are
``torch`` dtypes, other values Python literals or strings); ``--optimizer-kwargs`` adds its
arguments to every ``fn.optim`` optimizer. An adapter whose signature lacks one of the arguments
gets an ``n/a`` row instead of a run.

With a GPU (``torch.cuda.is_available()``) the same rows are measured again on ``cuda:0``, in
this process, one optimizer after the other: the comm is one rank of ``W`` whose collectives
return this rank's own tensors (the state and the buffers are those of a rank of ``W``), and
``peak`` is ``torch.cuda.max_memory_allocated``; ``+peak`` is over the memory allocated once the
model and its gradients exist.

``--fsdp-onebit`` measures instead, per rank, params + grads + optimizer state of FSDP2 +
``fn.fsdp.OnebitAdam`` (``fully_shard`` on every ``Linear`` and the root) against replicated
params + ``fn.optim.OnebitAdam`` (DDP's own buckets not counted), fp32 params, fp32 and bf16
error feedback, in the compressed phase, each beside its formula (docs/algorithms.md, "1-bit Adam
and 1-bit LAMB on FSDP2"): FSDP2 ``4n/W`` params ``+ 4n/W`` grads ``+ 4n/W`` (v) ``+ n/8`` (m)
``+ e n + e n/W`` (errors, ``e`` bytes each), replicated ``4n + 4n + 4n + n/8 + e n + e n/W``.
Targets at ``W = 4``: <= 0.5x of the replicated fp32-error total with fp32 errors, <= 0.4x with
bf16 errors. ``--fsdp-onebit lamb`` measures ``fn.fsdp.OnebitLamb`` against
``fn.optim.OnebitLamb`` the same way: both add the fresh variance ``v~`` (``4n/W`` and ``4n``)
and FSDP2 the momentum's fp32 shard (``4n/W``, which 1-bit LAMB's step reads); the same targets
are shown. The FSDP2 optimizer's state is what it holds between steps (the shards of ``v``,
each module's packed momentum and this rank's errors); the adapter's is ``state`` above, its
spare state and gradient buffer printed beside, not in the total.

Run: python3 benchmarks/memory.py [--world-sizes 2,4] [--params 25e6] [--dtype float32]
     [--freeze 3] [--compressed-steps 3] [--optimizers NAME[:KEY=VALUE,...] ...]
     [--optimizer-kwargs KEY=VALUE,...] [--timeout 600] [--json FILE]
     python3 benchmarks/memory.py --fsdp-onebit [adam|lamb] [--world-sizes 2,4] [--params 25e6]
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import math
import os
import resource
import sys
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils import _pytree as pytree

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the other benchmarks

import cluster  # noqa: E402

import fn.optim  # noqa: E402
from fn.app.launch import spawn_gloo  # noqa: E402
from fn.collectives import Local  # noqa: E402

MIB = 2**20
PHASES = ("warmup", "compressed")
# name -> (class, its fixed keyword arguments for a freeze step)
OPTIMIZERS: dict[str, tuple[type, Callable[[int], dict[str, Any]]]] = {
    "adam": (torch.optim.Adam, lambda freeze: {}),
    "adamw-fused": (torch.optim.AdamW, lambda freeze: {"fused": True}),
    "onebit-adam": (fn.optim.OnebitAdam, lambda freeze: {"freeze_step": freeze}),
    "zero-one-adam": (fn.optim.ZeroOneAdam, lambda freeze: {"var_freeze_step": freeze}),
    "onebit-lamb": (fn.optim.OnebitLamb, lambda freeze: {"freeze_step": freeze}),
}
DEFAULT_OPTIMIZERS = (
    "adam",
    "adamw-fused",
    "onebit-adam",
    "onebit-adam:error_dtype=bfloat16",
    "zero-one-adam",
    "onebit-lamb",
    "onebit-lamb:error_dtype=bfloat16",
)
# (optimizer, error feedback dtype, phase) -> the most state it may hold, in x Adam, at W = 4
TARGETS = {
    ("onebit-adam", "float32", "compressed"): 1.2,
    ("onebit-adam", "bfloat16", "compressed"): 0.9,
    ("onebit-lamb", "float32", "compressed"): 1.75,
    ("onebit-lamb", "bfloat16", "compressed"): 1.4,
    ("onebit-adam", "float32", "warmup"): 1.0,
    ("onebit-adam", "bfloat16", "warmup"): 1.0,
    ("onebit-lamb", "float32", "warmup"): 1.0,
    ("onebit-lamb", "bfloat16", "warmup"): 1.0,
}
TARGET_WORLD_SIZE = 4
# 4 bytes per fp32 value: (values of size n, values of size n / W) of today's layout
TODAYS_LAYOUT = {"onebit-adam": (3, 1), "onebit-lamb": (4, 1)}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def storages(tree: Any, seen: dict[int, int] | None = None) -> dict[int, int]:
    """The unique untyped storages of the tensors in ``tree`` (dicts, lists, tuples,
    NamedTuples and other pytree nodes walked), as ``{address: bytes}``, added to ``seen`` if
    given.

    Example:
        >>> x = torch.zeros(4)
        >>> sum(storages({"a": x, "b": [x[:2], (torch.zeros(2),)]}).values())
        24
    """
    seen = {} if seen is None else seen
    if isinstance(tree, torch.Tensor):
        storage = tree.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    elif isinstance(tree, dict):
        for value in tree.values():
            storages(value, seen)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            storages(value, seen)
    else:  # a registered pytree node (a dataclass, ...) or a leaf that holds no tensor
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                storages(leaf, seen)
    return seen


def state_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    """``{"state", "spare", "grads"}`` bytes of ``opt`` (the module docstring's columns)."""
    groups = getattr(opt, "_groups", None)
    if groups is None:  # torch.optim
        return {"state": sum(storages(dict(opt.state)).values()), "spare": 0, "grads": 0}
    live: dict[int, int] = {}
    for runtime in groups:
        storages(runtime.state, live)
        if runtime.flat.has_master_copy:
            storages(runtime.flat.master, live)
    spare = storages([runtime.spare for runtime in groups])
    grads = storages([runtime.flat.grads for runtime in groups if runtime.flat.grads is not None])
    return {
        "state": sum(live.values()),
        "spare": sum(n for ptr, n in spare.items() if ptr not in live),
        "grads": sum(n for ptr, n in grads.items() if ptr not in live and ptr not in spare),
    }


def mlp_widths(params: float) -> tuple[int, int]:
    """``(width, hidden)`` of the ``w -> 4w -> 4w -> w`` MLP closest to ``params`` parameters
    (``hidden`` a multiple of 64 where that is not too coarse); ``1.5 hidden^2`` weights."""
    hidden = math.sqrt(params / 1.5)
    step = 64 if hidden >= 256 else 4
    hidden = max(step, round(hidden / step) * step)
    return hidden // 4, hidden


def build_mlp(
    width: int, hidden: int, device: str, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """``cluster.py``'s MLP ``width -> hidden -> hidden -> width``, seeded, in ``dtype``."""
    return cluster.build_mlp(width, hidden).to(device, dtype)


def parse_kwargs(text: str) -> dict[str, Any]:
    """``"a=1,error_dtype=bfloat16"`` as keyword arguments (dtype names as ``torch`` dtypes).

    Raises:
        ValueError: an item without ``=``.
    """
    kwargs = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        if value in _DTYPES:
            kwargs[key] = _DTYPES[value]
        else:
            try:
                kwargs[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                kwargs[key] = value
    return kwargs


def parse_optimizer(spec: str, common: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name, kwargs)`` of ``NAME[:KEY=VALUE,...]``; ``common`` added for fn optimizers.

    Raises:
        ValueError: an unknown name or a malformed argument.
    """
    name, _, kwargs = spec.partition(":")
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from {sorted(OPTIMIZERS)}")
    cls = OPTIMIZERS[name][0]
    extra = common if issubclass(cls, fn.optim.FunctionalOptimizer) else {}
    return name, {**extra, **parse_kwargs(kwargs)}


def missing_kwargs(name: str, kwargs: dict[str, Any]) -> list[str]:
    """The keyword arguments in ``kwargs`` that optimizer ``name``'s signature does not take."""
    params = inspect.signature(OPTIMIZERS[name][0]).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [k for k in kwargs if k not in params]


def label(name: str, kwargs: dict[str, Any]) -> str:
    """A row's optimizer: ``name`` and its ``kwargs`` as ``key=value`` (dtypes by name)."""

    def show(v: Any) -> str:
        return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else repr(v)

    return name + "".join(f" {k}={show(v)}" for k, v in kwargs.items())


def error_dtype(kwargs: dict[str, Any]) -> str:
    """The error feedback's dtype that ``kwargs`` give (``float32`` by default), by name."""
    return str(kwargs.get("error_dtype", torch.float32)).removeprefix("torch.")


def build_optimizer(
    name: str, params: Any, kwargs: dict[str, Any], freeze: int
) -> torch.optim.Optimizer:
    """Optimizer ``name`` of ``params`` with freeze step ``freeze`` and ``kwargs``."""
    cls, fixed = OPTIMIZERS[name]
    return cls(params, **fixed(freeze), **kwargs)


def load_code(name: str, kwargs: dict[str, Any], freeze: int, device: str) -> None:
    """Runs optimizer ``name`` through both phases on a tiny param, so that the code and
    libraries its steps load (``torch._dynamo``, the kernels) are not counted as its data."""
    param = torch.zeros(64, device=device, requires_grad=True)
    param.grad = torch.ones_like(param)
    opt = build_optimizer(name, [param], kwargs, freeze)
    for _ in range(freeze + 1):
        opt.step()


def measure(
    name: str,
    kwargs: dict[str, Any],
    cfg: dict[str, Any],
    device: str,
    peak: Callable[[], int],
) -> dict[str, dict[str, int]]:
    """Trains the MLP of ``cfg`` with optimizer ``name`` and returns, per phase, its
    :func:`state_bytes` with ``peak`` (``peak()`` bytes) and ``base`` (``peak()`` once the
    model and its gradients exist)."""
    dtype = _DTYPES[cfg["dtype"]]
    model = build_mlp(cfg["width"], cfg["hidden"], device, dtype)
    generator = torch.Generator().manual_seed(cfg["rank"])

    def backward() -> None:
        x = torch.randn(8, cfg["width"], generator=generator).to(device, dtype)
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    result = {}
    with warnings.catch_warnings():
        # the 1-bit optimizers' warning on a variance frozen after a few steps: expected here
        warnings.filterwarnings("ignore", "[a-z_]+: the variance froze", RuntimeWarning)
        # OneOf (the in-process rows): every "rank" holds this process's gradients, which the
        # adapter's check of averaged gradients takes for a DDP model it was not told about
        warnings.filterwarnings("ignore", "fn.optim: the gradients of .* are bit-identical")
        backward()
        load_code(name, kwargs, cfg["freeze"], device)
        base = peak()
        opt = build_optimizer(name, model.parameters(), kwargs, cfg["freeze"])
        steps = (cfg["freeze"] - 1, cfg["compressed_steps"])
        for phase, count in zip(PHASES, steps, strict=True):
            for _ in range(count):
                backward()
                opt.step()
            result[phase] = {**state_bytes(opt), "peak": peak(), "base": base}
    return result


def max_rss() -> int:
    """This process's peak resident memory in bytes (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def rank_worker(rank: int, world_size: int, send: Any, name: str, kwargs: dict, cfg: dict) -> dict:
    """One gloo rank of :func:`measure` on the CPU; ``peak`` is ``ru_maxrss``."""
    del send, world_size
    return measure(name, kwargs, {**cfg, "rank": rank}, "cpu", max_rss)


class OneOf(Local):
    """Rank 0 of ``world_size`` ranks whose tensors equal this process's: the state and buffers
    of a rank of ``world_size``, in one process (the CUDA rows)."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self._world_size = world_size

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        return 0

    def all_reduce(self, x: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return x.clone() if op == "mean" else x * self._world_size

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x] * self._world_size)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[0]] * self._world_size)

    def reduce_scatter(self, x: torch.Tensor, op: str = "mean") -> torch.Tensor:
        return x[0].clone() if op == "mean" else x[0] * self._world_size


def measure_in_process(
    name: str, kwargs: dict, cfg: dict, world_size: int, device: str
) -> dict[str, dict[str, int]]:
    """:func:`measure` on ``device`` in this process, the fn optimizers on an :class:`OneOf`
    comm of ``world_size`` ranks; ``peak`` is ``torch.cuda.max_memory_allocated`` on CUDA
    (reset first), else ``ru_maxrss``."""
    if issubclass(OPTIMIZERS[name][0], fn.optim.FunctionalOptimizer):
        kwargs = {**kwargs, "comm": OneOf(world_size)}
    peak = max_rss
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        peak = partial(torch.cuda.max_memory_allocated, device)
    return measure(name, kwargs, {**cfg, "rank": 0}, device, peak)


def rows_of(
    runs: Sequence[tuple[str, dict, dict | None]], numel: int, world_size: int
) -> list[dict[str, Any]]:
    """The table's rows of one world size: every run (``None``: not run, ``n/a``) in every
    phase, each with its ratio to ``torch.optim.Adam``'s state and its target, then the
    computed rows of today's layout."""
    adam = next((r for name, kw, r in runs if name == "adam" and not kw and r), None)
    rows = []
    for phase in PHASES:
        adam_bytes = adam[phase]["state"] if adam else None
        for name, kwargs, result in runs:
            row = {"W": world_size, "optimizer": label(name, kwargs), "phase": phase}
            target = TARGETS.get((name, error_dtype(kwargs), phase))
            if world_size != TARGET_WORLD_SIZE or set(kwargs) - {"error_dtype"}:
                target = None
            if result is not None:
                row.update(result[phase])
                if adam_bytes:
                    row["ratio"] = result[phase]["state"] / adam_bytes
            rows.append({**row, "target": target, "na": result is None})
        for name, (full, sharded) in TODAYS_LAYOUT.items():
            nbytes = 4 * (full * numel + math.ceil(numel / world_size) * sharded)
            row = {"W": world_size, "optimizer": f"{name} today's layout (computed)"}
            row.update(phase=phase, state=nbytes, na=False)
            if phase == "compressed" and world_size == TARGET_WORLD_SIZE:
                row["target"] = TARGETS[(name, "float32", phase)]
            if adam_bytes:
                row["ratio"] = nbytes / adam_bytes
            rows.append(row)
    return rows


def target_status(row: dict[str, Any]) -> str:
    target, ratio = row.get("target"), row.get("ratio")
    if target is None:
        return "-"
    if ratio is None:
        return f"<= {target:.2f}x: not measured"
    met = round(ratio, 2) <= target
    return f"<= {target:.2f}x: {'met' if met else 'NOT met'}"


def format_table(rows: Sequence[dict[str, Any]], peak_name: str) -> str:
    """The rows as a markdown table (MiB, ratios with two decimals, ``n/a`` for rows not run,
    ``-`` where a column does not apply)."""

    def mib(row: dict, key: str) -> str:
        if row["na"]:
            return "n/a"
        return f"{row[key] / MIB:.1f}" if key in row else "-"

    header = (
        f"| W | optimizer | phase | state MiB | x Adam | spare MiB | grads MiB | {peak_name} MiB "
        f"| +{peak_name} MiB | target |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        ratio = "n/a" if row["na"] else f"{row['ratio']:.2f}x" if "ratio" in row else "-"
        extra = row["peak"] - row["base"] if "peak" in row else None
        cells = [str(row["W"]), row["optimizer"], row["phase"], mib(row, "state"), ratio]
        cells += [mib(row, "spare"), mib(row, "grads"), mib(row, "peak")]
        cells += ["n/a" if row["na"] else "-" if extra is None else f"{extra / MIB:.1f}"]
        lines.append("| " + " | ".join(cells + [target_status(row)]) + " |")
    return "\n".join(lines)


def merge_ranks(results: Sequence[dict]) -> dict:
    """Rank 0's bytes with the largest peak (and the base of that rank) of all ranks."""
    merged = {}
    for phase in PHASES:
        top = max(results, key=lambda r: r[phase]["peak"] - r[phase]["base"])
        merged[phase] = {**results[0][phase], "peak": top[phase]["peak"]}
        merged[phase]["base"] = top[phase]["base"]
    return merged


FSDP_TARGETS = {"float32": 0.5, "bfloat16": 0.4}  # x the replicated fp32-error total, W = 4
FSDP_FAMILIES = {"adam": "OnebitAdam", "lamb": "OnebitLamb"}  # by --fsdp-onebit


def _local_storages(tree: Any) -> int:
    """:func:`storages` of ``tree`` with every DTensor replaced by this rank's shard."""
    from torch.distributed.tensor import DTensor

    local = pytree.tree_map(lambda x: x.to_local() if isinstance(x, DTensor) else x, tree)
    return sum(storages(local).values())


def fsdp_onebit_worker(rank: int, world_size: int, send: Any, cfg: dict, dtype: str) -> dict:
    """One gloo rank: params, grads and optimizer-state bytes of FSDP2 + ``fn.fsdp.OnebitAdam``
    (or ``OnebitLamb``) and of replicated params + ``fn.optim``'s, after the compressed steps."""
    del send
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fn.fsdp

    generator = torch.Generator().manual_seed(rank)
    out = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "[a-z_.A-Z]+: the variance froze", RuntimeWarning)
        for setup in ("fsdp", "replicated"):
            model = build_mlp(cfg["width"], cfg["hidden"], "cpu")
            kwargs = dict(freeze_step=cfg["freeze"], error_dtype=_DTYPES[dtype])
            if setup == "fsdp":
                mesh = init_device_mesh("cpu", (world_size,))
                for layer in model:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
                opt = getattr(fn.fsdp, FSDP_FAMILIES[cfg["family"]])(model, **kwargs)
            else:
                opt = getattr(fn.optim, FSDP_FAMILIES[cfg["family"]])(model.parameters(), **kwargs)
            for _ in range(cfg["freeze"] - 1 + cfg["compressed_steps"]):
                opt.zero_grad()
                x = torch.randn(8, cfg["width"], generator=generator)
                model(x).square().mean().backward()
                opt.step()
            params = list(model.parameters())
            row = {
                "params": _local_storages(params),
                "grads": _local_storages([p.grad for p in params]),
            }
            if setup == "fsdp":  # its live state: the shards' moments, each module's packed
                held = [(x.signs, x.errors) for x in opt._modules]  # m and errors
                row.update(state=_local_storages([opt._state, held]), extra=0)
            else:
                measured = state_bytes(opt)
                row.update(state=measured["state"], extra=measured["spare"] + measured["grads"])
            out[setup] = row
    return out


def fsdp_formula(setup: str, numel: int, world_size: int, dtype: str, family: str) -> float:
    """Params + grads + optimizer state per rank, compressed phase (module docstring)."""
    e = _DTYPES[dtype].itemsize
    errors = e * numel + e * numel / world_size
    full = {"adam": 12, "lamb": 16}[family] * numel  # params, grads, v (and LAMB's v~)
    if setup == "fsdp":
        full += 4 * numel if family == "lamb" else 0  # the momentum's fp32 shard
        return full / world_size + numel / 8 + errors
    return full + numel / 8 + errors


def fsdp_onebit_rows(args: argparse.Namespace, cfg: dict, numel: int) -> list[dict[str, Any]]:
    """Runs :func:`fsdp_onebit_worker` at every world size and error dtype; the table's rows."""
    rows = []
    for world_size in args.world_sizes:
        measured = {}
        for dtype in ("float32", "bfloat16"):
            name = FSDP_FAMILIES[cfg["family"]]
            print(f"W={world_size} FSDP2 vs replicated {name}, {dtype} errors ...", flush=True)
            ranks = spawn_gloo(
                fsdp_onebit_worker,
                world_size,
                (cfg, dtype),
                timeout=args.timeout,
                on_message=lambda rank, message: None,
                threads=1,
            )
            measured[dtype] = ranks[0]
        baseline = measured["float32"]["replicated"]
        baseline_total = baseline["params"] + baseline["grads"] + baseline["state"]
        for dtype in ("float32", "bfloat16"):
            for setup in ("replicated", "fsdp"):
                row = dict(measured[dtype][setup], W=world_size, setup=setup, errors=dtype)
                row["total"] = row["params"] + row["grads"] + row["state"]
                row["formula"] = fsdp_formula(setup, numel, world_size, dtype, cfg["family"])
                row["ratio"] = row["total"] / baseline_total
                target = FSDP_TARGETS[dtype] if setup == "fsdp" else None
                row["target"] = target if world_size == TARGET_WORLD_SIZE else None
                rows.append(row)
    return rows


def format_fsdp_table(rows: Sequence[dict[str, Any]], family: str) -> str:
    """The ``--fsdp-onebit`` rows as a markdown table (MiB)."""
    name = FSDP_FAMILIES[family]
    names = {"fsdp": f"FSDP2 + fn.fsdp.{name}", "replicated": f"DDP + fn.optim.{name}"}
    header = (
        "| W | setup | errors | params MiB | grads MiB | state MiB | total MiB | formula MiB "
        "| x DDP fp32 errors | not in total MiB | target |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in rows:
        cells = [str(row["W"]), names[row["setup"]], row["errors"]]
        cells += [f"{row[k] / MIB:.1f}" for k in ("params", "grads", "state", "total", "formula")]
        cells += [f"{row['ratio']:.2f}x", f"{row['extra'] / MIB:.1f}" if row["extra"] else "-"]
        cells.append(target_status(row))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated, e.g. 2,4")
    parser.add_argument("--params", type=float, default=25e6, help="MLP parameters (about)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the params' dtype (bfloat16: the fn.optim adapters keep an fp32 master copy)",
    )
    parser.add_argument("--freeze", type=int, default=3, help="freeze_step (>= 2)")
    parser.add_argument("--compressed-steps", type=int, default=3)
    parser.add_argument(
        "--optimizers",
        nargs="+",
        default=list(DEFAULT_OPTIMIZERS),
        help=f"NAME[:KEY=VALUE,...], NAME one of {', '.join(OPTIMIZERS)}",
    )
    parser.add_argument(
        "--optimizer-kwargs", default="", help="KEY=VALUE,... for every fn.optim optimizer"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    parser.add_argument("--json", help="also write the rows (bytes) to this file")
    parser.add_argument(
        "--fsdp-onebit",
        nargs="?",
        const="adam",
        choices=list(FSDP_FAMILIES),
        help="params + grads + state of FSDP2 + fn.fsdp.OnebitAdam (or OnebitLamb) vs "
        "replicated (see above)",
    )
    args = parser.parse_args(argv)
    sizes = args.world_sizes.split(",")
    if not all(w.strip().isdigit() and int(w) >= 1 for w in sizes):
        parser.error(f"--world-sizes must be integers >= 1 separated by commas, got {sizes}")
    args.world_sizes = [int(w) for w in sizes]
    try:
        common = parse_kwargs(args.optimizer_kwargs)
        args.optimizers = [parse_optimizer(spec, common) for spec in args.optimizers]
    except ValueError as err:
        parser.error(str(err))
    if args.freeze < 2:
        parser.error("--freeze must be >= 2 (the warmup phase has freeze - 1 updates)")
    if args.compressed_steps < 1:
        parser.error("--compressed-steps must be >= 1")
    if not args.params >= 16:
        parser.error(f"--params must be >= 16, got {args.params}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    width, hidden = mlp_widths(args.params)
    numel = sum(p.numel() for p in build_mlp(width, hidden, "cpu").parameters())
    cfg = dict(width=width, hidden=hidden, dtype=args.dtype, freeze=args.freeze)
    cfg["compressed_steps"] = args.compressed_steps
    print(
        f"MLP {width}-{hidden}-{hidden}-{width}: {numel} {args.dtype} params "
        f"({numel * _DTYPES[args.dtype].itemsize / MIB:.1f} MiB), "
        f"freeze_step {args.freeze}, {args.compressed_steps} compressed steps; torch "
        f"{torch.__version__}; load average {os.getloadavg()[0]:.2f}"
    )
    if args.fsdp_onebit:
        cfg["family"] = args.fsdp_onebit
        rows = fsdp_onebit_rows(args, cfg, numel)
        print("\nCPU, gloo ranks, compressed phase, fp32 params, per rank (rank 0)\n")
        print(format_fsdp_table(rows, args.fsdp_onebit))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**cfg, "numel": numel, "fsdp_onebit": rows}, f, indent=1)
        return
    cpu_rows, cuda_rows = [], []
    for world_size in args.world_sizes:
        runs, cuda_runs = [], []
        for name, kwargs in args.optimizers:
            missing = missing_kwargs(name, kwargs)
            if missing:
                print(f"W={world_size} {label(name, kwargs)}: n/a ({name} takes no {missing})")
                runs.append((name, kwargs, None))
                cuda_runs.append((name, kwargs, None))
                continue
            print(f"W={world_size} {label(name, kwargs)} ...", flush=True)
            ranks = spawn_gloo(
                rank_worker,
                world_size,
                (name, kwargs, cfg),
                timeout=args.timeout,
                on_message=lambda rank, message: None,
                threads=1,
            )
            runs.append((name, kwargs, merge_ranks(ranks)))
            if torch.cuda.is_available():
                cuda = measure_in_process(name, kwargs, cfg, world_size, "cuda:0")
                cuda_runs.append((name, kwargs, cuda))
        cpu_rows += rows_of(runs, numel, world_size)
        cuda_rows += rows_of(cuda_runs, numel, world_size)
    print("\nCPU, gloo ranks (peak: ru_maxrss)\n")
    print(format_table(cpu_rows, "peak"))
    if torch.cuda.is_available():
        print(f"\nCUDA, {torch.cuda.get_device_name(0)} (peak: max_memory_allocated)\n")
        print(format_table(cuda_rows, "peak"))
    else:
        print("\nCUDA rows skipped: torch.cuda.is_available() is False")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**cfg, "numel": numel, "cpu": cpu_rows, "cuda": cuda_rows}, f, indent=1)


if __name__ == "__main__":
    main()
