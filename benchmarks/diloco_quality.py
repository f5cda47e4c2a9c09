"""DiLoCo's held-out loss with compressed outer steps on three tasks, at 4 and 16 workers.

Workers simulated in one process (``fn.collectives.Simulated``: a ``vmap`` over the workers,
the collectives' bytes counted as a gloo group would send and receive them) each take ``H``
inner AdamW steps (``--sync-every``, 30) on their own data, then one outer step
(``fn.diloco.outer_step``) moves the shared anchor and every worker continues from it. The
held-out loss is the anchor's after the outer steps ``--evals`` (20 and 100: one run of 100
outer steps evaluated after the 20th and the 100th, which equals a run of 20, as nothing
depends on the run's length). The tasks (``--tasks``):

- ``lm``: a 2-layer causal transformer (width 32, 2 heads, context 16; 29.1k params)
  predicting every next character of the standard library's source (``fn.app._data``, the
  demo's corpus, each worker a contiguous shard; held out: 256 windows of ``fractions.py``);
  cross-entropy in nats; inner lr 3e-3.
- ``mlp``: the demo's next-character MLP (:class:`fn.app.demo.CharMLP`, context 32, embedding
  16, hidden 64; 36.7k params) on the same text (1024 held-out windows); inner lr 1e-3.
- ``regress``: a 16-128-128-4 ReLU MLP (19.2k params) regressing a fixed random tanh teacher
  from samples with Gaussian noise 0.05, each worker its own stream; held out: 4096
  noiseless points; mean squared error; inner lr 1e-3.

Each task's inner lr is dense DiLoCo's better one of 1e-3, 3e-3 and 1e-2 here; ``--lr-scales``
multiplies it (several: every method runs at each, and the tables add each method at its better
one). Every run of a task and seed starts from the seed's params and every worker reads the same
batches: 16 windows (``lm``), 64 (``mlp``) or 128 samples (``regress``) per inner step over all
the workers (``1 / W`` of them each), so that the runs at every ``W`` train on as many samples.

The outer rules (``--methods``, each ``NAME[:OPTION=VALUE]...``):

- ``fp32``: dense DiLoCo, Nesterov (lr 0.7, momentum 0.9) on the exact mean; ``int8``,
  ``bf16``, ``loco4``: the same after ``fn.diloco.compression(NAME)``;
- ``sparseloco-1/D``: ``fn.diloco.sparseloco`` (its defaults), chunk-wise top-k at density
  ``1/D`` (``k = chunk / D``) in 2 bits with its error-feedback accumulator; option
  ``exchange=gather`` all-gathers every worker's message, ``exchange=owner`` reduces the
  chunks on their owners and re-compresses them (``auto``, fn's default, picks by bytes), and
  ``server=M`` has the owners keep ``M`` times as many values per chunk (``server_k = M k``);
- ``topk-1/D``: the same top-k compressor (error feedback, no decay) under Nesterov.

Options: ``lr``, ``momentum`` (Nesterov's), ``beta`` (SparseLoCo's), ``chunk`` (the top-k's
``chunk_size``, 4096), ``exchange``, ``server``; and two schedules: ``dense=N`` takes the first
``N`` outer steps as the exact fp32 mean (the rule's lr, no momentum; the accumulator stays
empty) and ``ramp=1`` keeps ``max(k, C / 2^(s - 1))`` values per chunk at sparse outer step ``s``.

Printed: a line per run (with, for the error-fed compressors, the norm of what their error
feedback holds after the last outer step, the workers' mean and the owners', in norms of that
step's mean pseudo-gradient), then per task and ``W`` a markdown table: each method's held-out
loss after each evaluated outer step (the mean over ``--seeds``), its change from dense
DiLoCo's at the same inner lr, each seed's change, and the bytes one worker sent and received
per outer step; last, each compressed method's change from dense DiLoCo on every task and
``W``, and whether it is within 1% after the last outer step everywhere (issue #63's target).
``--jobs N`` runs N runs at a time (processes); ``--json FILE`` saves every run and ``--reuse
FILE`` takes the runs of the same settings from such a file instead of running them again.

Results, and the settings they decided: docs/guides/diloco.md, "When sparse compression pays",
and benchmarks/README.md; the records and the commands that made them:
benchmarks/results/diloco_quality/.

Run: python3 benchmarks/diloco_quality.py [--tasks lm,mlp,regress] [--workers 4,16]
     [--seeds 0,1] [--evals 20,100] [--sync-every 30] [--lr-scales 1]
     [--methods fp32,int8,sparseloco-1/32:exchange=gather,...] [--jobs 1] [--json FILE]
     [--reuse FILE] [--quick]"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import fn  # noqa: E402
import fn.diloco  # noqa: E402
import fn.tree  # noqa: E402
from fn.app import _data, demo  # noqa: E402
from fn.collectives import Simulated, replicate, simulate  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import parse_with_quick  # noqa: E402

CHUNK = 4096
Batch = tuple[torch.Tensor, torch.Tensor]


class Block(torch.nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for t in self.qkv(self.norm1(x)).split(width, dim=-1)
        )
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(width // self.heads)
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        mixed = scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v
        x = x + self.proj(mixed.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class CharTransformer(torch.nn.Module):
    """A causal character language model: token and position embeddings, ``layers`` blocks, a
    final norm and a linear head; ``[B, T]`` ids to ``[B, T, vocab]`` logits."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position[: x.shape[-1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class CharTask:
    """Next-character prediction on the demo's corpus (the standard library's source; held
    out: ``fractions.py``): every worker reads windows of its own contiguous shard.

    ``every_position``: the model predicts each next character of its window (a language
    model, targets ``[B, T]``), else only the one after it (targets ``[B]``).
    """

    def __init__(self, name: str, make: Callable[[], torch.nn.Module], context: int,
                 every_position: bool, heldout: int, lr: float) -> None:  # fmt: skip
        self.name, self.lr, self._make, self._every = name, lr, make, every_position
        self.context = context
        self.corpus = _data.load_corpus()
        starts = _data.heldout_starts(self.corpus.heldout.numel(), self.context + 1, heldout)
        self.heldout = self._windows(self.corpus.heldout, starts)

    def _windows(self, ids: torch.Tensor, starts: torch.Tensor) -> Batch:
        chunk = ids[starts[:, None] + torch.arange(self.context + 1)]
        return chunk[:, :-1], chunk[:, 1:] if self._every else chunk[:, -1]

    def model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return self._make()

    def sampler(self, rank: int, workers: int, seed: int, batch: int) -> Callable[[], Batch]:
        ids = _data.shard(self.corpus.train, rank, workers)
        generator = torch.Generator().manual_seed(seed * 100_003 + rank)
        return lambda: self._windows(
            ids, _data.batch_starts(ids.numel(), self.context + 1, batch, generator)
        )

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


class RegressionTask:
    """A 16-128-128-4 ReLU MLP regressing a fixed random tanh teacher (16-32-4) from samples
    with Gaussian noise 0.05; held out: noiseless points; mean squared error."""

    name = "regress"

    def __init__(self, heldout: int, lr: float) -> None:
        teacher = torch.Generator().manual_seed(1234)
        self.w1 = torch.randn(16, 32, generator=teacher) / 4
        self.w2 = torch.randn(32, 4, generator=teacher) / 6
        x = torch.randn(heldout, 16, generator=torch.Generator().manual_seed(999))
        self.heldout, self.lr = (x, self.teacher(x)), lr

    def teacher(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1) @ self.w2

    def model(self, seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128)]
        return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(128, 4))

    def sampler(self, rank: int, workers: int, seed: int, batch: int) -> Callable[[], Batch]:
        del workers
        generator = torch.Generator().manual_seed(seed * 100_003 + rank)

        def sample() -> Batch:
            x = torch.randn(batch, 16, generator=generator)
            return x, self.teacher(x) + 0.05 * torch.randn(batch, 4, generator=generator)

        return sample

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, target)


def make_task(name: str, quick: bool) -> Any:
    """The task ``name`` (one of :data:`TASK_NAMES`), its held-out set 8x smaller under
    ``quick``. Each task's inner learning rate is dense DiLoCo's better one of 1e-3, 3e-3 and
    1e-2 (at H = 30, 100 outer steps, W = 4 and 16)."""
    vocab, heldout = _data.VOCAB_SIZE, 8 if quick else 1
    if name == "lm":
        make = functools.partial(CharTransformer, vocab, 16, width=32, layers=2, heads=2)
        return CharTask("lm", make, 16, True, 256 // heldout, lr=3e-3)
    if name == "mlp":
        make = functools.partial(demo.CharMLP, vocab, 32, 16, 64)
        return CharTask("mlp", make, 32, False, 1024 // heldout, lr=1e-3)
    if name == "regress":
        return RegressionTask(4096 // heldout, lr=1e-3)
    raise ValueError(f"unknown task {name!r}")


class Method(NamedTuple):
    """An outer rule as named on the command line: ``kind`` (one of :data:`KINDS`), its
    density ``1/D`` (top-k only) and its options."""

    label: str
    kind: str
    density: int | None
    options: dict[str, Any]


KINDS = ("fp32", "bf16", "int8", "loco4", "topk", "sparseloco")
OPTIONS = {"lr": float, "momentum": float, "beta": float, "chunk": int, "exchange": str,
           "server": int, "dense": int, "ramp": int}  # fmt: skip


def parse_method(label: str) -> Method:
    """``NAME[:OPTION=VALUE]...``: ``NAME`` one of :data:`KINDS`, ``topk`` and ``sparseloco``
    with ``-1/D``; the options of :data:`OPTIONS`.

    Raises:
        ValueError: an unknown name or option, or a value of the wrong type.
    """
    name, *items = label.split(":")
    kind, _, density = name.partition("-1/")
    sparse = kind in ("topk", "sparseloco")
    if kind not in KINDS or bool(density) != sparse or (density and not density.isdigit()):
        raise ValueError(f"unknown method {label!r} (e.g. fp32, int8, sparseloco-1/32)")
    options: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in OPTIONS:
            raise ValueError(f"{label!r}: unknown option {key!r} (options: {', '.join(OPTIONS)})")
        options[key] = OPTIONS[key](value)
    if not sparse and set(options) - {"lr", "momentum"}:
        raise ValueError(f"{label!r}: {kind} takes lr and momentum only")
    return Method(label, kind, int(density) if density else None, options)


def schedule(method: Method, comm: Simulated) -> Callable[[int], tuple[str, Any]]:
    """The outer rule of each outer step ``s`` (from 1), and the name of the state it uses
    (rules of one name share their state): ``dense=N`` takes the first ``N`` steps as the exact
    fp32 mean with the rule's learning rate and no momentum; ``ramp=1`` keeps ``max(k, C /
    2^(s - N - 1))`` values per chunk at sparse step ``s``."""
    opts = method.options
    nesterov = {"lr": opts.get("lr", 0.7), "momentum": opts.get("momentum", 0.9)}
    if method.kind not in ("topk", "sparseloco"):
        rule = fn.diloco.nesterov(fn.diloco.compression(method.kind, comm=comm), **nesterov)
        return lambda s: ("outer", rule)
    chunk, exchange = opts.get("chunk", CHUNK), opts.get("exchange", "auto")
    sparseloco = {"beta": opts.get("beta", 0.95), "exchange": exchange}
    if "lr" in opts:
        sparseloco["lr"] = opts["lr"]
    dense, ramp = opts.get("dense", 0), opts.get("ramp", 0)
    default_lr = inspect.signature(fn.diloco.sparseloco).parameters["lr"].default
    exact_lr = opts.get("lr", 0.7) if method.kind == "topk" else opts.get("lr", default_lr)
    exact = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=comm), exact_lr, 0.0)
    rules: dict[int, Any] = {}

    def sparse(k: int) -> Any:
        owners = {"server_k": min(chunk, opts["server"] * k)} if "server" in opts else {}
        if k not in rules and method.kind == "topk":
            top = fn.diloco.compression(
                "topk", comm=comm, k=k, chunk_size=chunk, exchange=exchange, **owners
            )
            rules[k] = fn.diloco.nesterov(top, **nesterov)
        elif k not in rules:
            rules[k] = fn.diloco.sparseloco(
                k=k, chunk_size=chunk, comm=comm, **sparseloco, **owners
            )
        return rules[k]

    def rule(s: int) -> tuple[str, Any]:
        if s <= dense:
            return "dense", exact
        k = chunk // method.density
        return "sparse", sparse(max(k, chunk >> (s - dense - 1)) if ramp else k)

    return rule


class Flat:
    """A model's parameters as one vector per worker, ``[W, n]``, and its views as the named
    tensors (``[W, *shape]``, or ``[*shape]`` from one worker's ``[n]``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = [name for name, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.sizes = [p.numel() for _, p in model.named_parameters()]

    def flatten(self, tree: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat(
            [tree[n].flatten(-len(s)) for n, s in zip(self.names, self.shapes, strict=True)], -1
        )

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = flat.split(self.sizes, dim=-1)
        lead = flat.shape[:-1]
        return {
            n: p.view(*lead, *s) for n, p, s in zip(self.names, parts, self.shapes, strict=True)
        }


def run(task: Any, method: Method, workers: int, seed: int, lr: float, args) -> dict:
    """One run of ``max(args.evals)`` outer steps: the held-out loss of the anchor after each
    outer step of ``args.evals``, and the bytes one worker sent and received per outer step."""
    model = task.model(seed)
    flat = Flat(model)
    params0 = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss_of(vector: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return task.loss(torch.func.functional_call(model, flat.views(vector), (x,)), y)

    grads_of = torch.func.vmap(torch.func.grad(loss_of))
    samplers = [task.sampler(r, workers, seed, args.batch[task.name] // workers)
                for r in range(workers)]  # fmt: skip
    comm = Simulated(workers)
    anchor = replicate(params0, comm)
    params = {"p": flat.flatten(anchor)}
    inner = fn.adamw(lr=lr)  # elementwise: the [W, n] leaf steps every worker's own AdamW
    inner_state = inner.init(params)
    rule_of, states, losses, held = schedule(method, comm), {}, {}, {}
    start = time.perf_counter()
    for s in range(1, max(args.evals) + 1):
        for _ in range(args.sync_every):
            pairs = [sample() for sample in samplers]
            x, y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
            grads = {"p": grads_of(params["p"], x, y)}
            params, inner_state = fn.update_and_apply(inner, grads, inner_state, params)
        name, rule = rule_of(s)
        if name not in states:
            states[name] = simulate(rule.init, comm)(anchor)
        step = simulate(lambda a, p, st, r=rule: fn.diloco.outer_step(r, a, p, st, comm=comm), comm)
        delta = flat.flatten(anchor) - params["p"]  # every worker's pseudo-gradient
        result = step(anchor, flat.views(params["p"]), states[name])
        anchor, states[name] = result.anchor, result.state
        params["p"].copy_(flat.flatten(anchor))  # every worker continues from the anchor
        if s in args.evals:
            losses[s] = heldout_loss(task, model, {n: a[0] for n, a in anchor.items()})
            held[s] = held_back(states[name], delta)
    outer_steps = max(args.evals)
    return {
        "losses": losses,
        "held": held,
        "sent": comm.bytes_sent / outer_steps,
        "received": comm.bytes_received / outer_steps,
        "seconds": time.perf_counter() - start,
    }


def held_back(state: Any, delta: torch.Tensor) -> dict[str, float]:
    """What the error feedback of ``state`` holds, in steps of the mean pseudo-gradient
    ``delta`` (``[W, n]``): ``||mean_r e_r|| / ||mean_r delta_r||`` for the workers'
    accumulators and, reduced on owners, ``||e_s|| / ||mean_r delta_r||`` for the owners' error
    feedback (``e_s`` all owners' pieces); empty without error feedback."""
    compressor, scale = state[0], float(delta.mean(0).norm())
    if not hasattr(compressor, "error"):
        return {}
    leaves = [e.reshape(e.shape[0], -1) for e in fn.tree.tree_leaves(compressor.error)]
    out = {"workers": float(torch.cat(leaves, 1).mean(0).norm()) / scale}
    if hasattr(compressor, "server_error"):
        out["owners"] = float(compressor.server_error.norm()) / scale
    return out


@torch.no_grad()
def heldout_loss(task: Any, model: torch.nn.Module, params: dict[str, torch.Tensor]) -> float:
    x, y = task.heldout
    return float(task.loss(torch.func.functional_call(model, params, (x,)), y))


TASK_NAMES = ("lm", "mlp", "regress")
METHODS = (
    "fp32,int8,sparseloco-1/32:exchange=gather:lr=1,sparseloco-1/32:exchange=gather,"
    "sparseloco-1/64:exchange=gather,sparseloco-1/32:exchange=owner"
)
BATCH = {"lm": 16, "mlp": 64, "regress": 128}  # samples per step over all the workers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASK_NAMES))
    p.add_argument("--workers", default="4,16", help="W values, comma-separated")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--evals", default="20,100", help="outer steps after which to evaluate")
    p.add_argument("--sync-every", type=int, default=30, help="H, inner steps per outer step")
    p.add_argument("--methods", default=METHODS, help="NAME[:OPTION=VALUE]..., comma-separated")
    p.add_argument("--lr-scales", default="1", help="factors of every task's inner lr")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (processes)")
    p.add_argument("--json", help="write every run's numbers to this file")
    p.add_argument("--reuse", help="a --json file: its runs of these settings are not run again")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: small tasks; W 4, seed 0, H 5, 2 outer steps where not given",
    )
    quick = {"workers": "4", "seeds": "0", "evals": "1,2", "sync_every": 5}
    args = parse_with_quick(p, argv, quick)
    try:
        args.methods = [parse_method(m) for m in args.methods.split(",") if m]
        args.tasks = [t for t in args.tasks.split(",") if t]
        args.workers, args.seeds, args.evals = (
            [int(v) for v in text.split(",")] for text in (args.workers, args.seeds, args.evals)
        )
        args.lr_scales = [float(v) for v in args.lr_scales.split(",")]
    except ValueError as err:
        p.error(str(err))
    if set(args.tasks) - set(TASK_NAMES):
        p.error(f"--tasks: one of {', '.join(TASK_NAMES)}")
    if any(BATCH[t] % w for t in args.tasks for w in args.workers):
        p.error(f"--workers: each must divide every task's batch ({BATCH})")
    args.batch = BATCH
    return args


_TASKS: dict[tuple[str, bool], Any] = {}


def one_run(job: tuple[str, int, int, str, float, argparse.Namespace]) -> dict:
    """The run of ``(task, W, seed, method, lr scale, args)``, as a record."""
    name, workers, seed, label, scale, args = job
    if (name, args.quick) not in _TASKS:  # one per process: the corpus is read once
        _TASKS[name, args.quick] = make_task(name, args.quick)
    task = _TASKS[name, args.quick]
    lr = task.lr * scale
    result = run(task, parse_method(label), workers, seed, lr, args)
    return {"task": name, "workers": workers, "seed": seed, "method": label, "scale": scale,
            "lr": lr, "sync_every": args.sync_every, **result}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(1)  # small runs: more threads only contend
    jobs = [
        (t, w, seed, m.label, scale, args)
        for t in args.tasks for w in args.workers for scale in args.lr_scales
        for m in args.methods for seed in args.seeds
    ]  # fmt: skip
    reused = _reused(args.reuse, jobs) if args.reuse else {}
    todo = [job for job in jobs if _key(job) not in reused]
    load = os.getloadavg()[0]
    more = f" ({len(jobs) - len(todo)} more from {args.reuse})" if args.reuse else ""
    print(f"{len(todo)} runs of {max(args.evals)} outer steps, H = {args.sync_every}{more}; "
          f"1-minute load average before: {load:.2f}", flush=True)  # fmt: skip
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            done = [_printed(record) for record in pool.imap(one_run, todo)]
    else:
        done = [_printed(one_run(job)) for job in todo]
    fresh = iter(done)
    records = [reused[_key(job)] if _key(job) in reused else next(fresh) for job in jobs]
    print(f"1-minute load average after: {os.getloadavg()[0]:.2f}\n")
    for t in args.tasks:
        for w in args.workers:
            print(f"### {t}, W = {w}\n\n" + table(records, t, w, args) + "\n")
    print(targets(records, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return records


def _key(job: tuple) -> tuple:
    """What makes two runs the same: task, ``W``, seed, method, inner lr and ``H``."""
    name, workers, seed, label, scale, args = job
    return name, workers, seed, label, scale, args.sync_every


def _reused(path: str, jobs: list[tuple]) -> dict[tuple, dict]:
    """The records of ``path`` (a ``--json`` file) of the same runs as ``jobs`` that were
    evaluated after every outer step of ``args.evals``, by :func:`_key`."""
    with open(path) as f:
        records = json.load(f)
    wanted = {_key(job) for job in jobs}
    evals = jobs[0][-1].evals if jobs else []
    out = {}
    for r in records:
        r["losses"] = {int(s): v for s, v in r["losses"].items()}
        key = (r["task"], r["workers"], r["seed"], r["method"], r["scale"], r["sync_every"])
        if key in wanted and all(e in r["losses"] for e in evals):
            out[key] = r
    return out


def _printed(record: dict) -> dict:
    losses = ", ".join(f"{s}: {v:.4f}" for s, v in record["losses"].items())
    held = " ".join(
        f"{where} {steps:.1f}" for where, steps in record["held"][max(record["held"])].items()
    )
    held = f"; error feedback holds (in mean pseudo-gradients) {held}" if held else ""
    print(f"{record['task']} W={record['workers']} seed={record['seed']} {record['method']} "
          f"lr={record['lr']:g}: held-out after outer step {losses}; {record['sent']:.0f} B "
          f"sent, {record['received']:.0f} B received per outer step{held}; "
          f"{record['seconds']:.0f} s", flush=True)  # fmt: skip
    return record


def _runs(records: list[dict], task: str, workers: int) -> dict[tuple[str, float], list[dict]]:
    """``(method, lr scale) -> its runs`` (one per seed, in seed order) of a task and ``W``."""
    out: dict[tuple[str, float], list[dict]] = {}
    for r in sorted(records, key=lambda r: r["seed"]):
        if r["task"] == task and r["workers"] == workers:
            out.setdefault((r["method"], r["scale"]), []).append(r)
    return out


def _mean(runs: list[dict], step: int) -> float:
    return statistics.fmean(r["losses"][step] for r in runs)


def _best(runs: dict, method: str, step: int) -> float:
    """The lr scale at which ``method``'s mean held-out loss after ``step`` is lowest."""
    scales = [scale for m, scale in runs if m == method]
    return min(scales, key=lambda scale: _mean(runs[method, scale], step))


def _pct(loss: float, dense: float) -> str:
    return f"{100 * (loss / dense - 1):+.2f}%"


def table(records: list[dict], task: str, workers: int, args: argparse.Namespace) -> str:
    """The markdown table of one task and ``W``: every method at every inner lr against dense
    DiLoCo (``fp32``) at the same one; with several inner lrs, each method at its better one
    (chosen after the last outer step) against dense DiLoCo at its better one."""
    runs = _runs(records, task, workers)
    dense_name = "fp32" if any(m == "fp32" for m, _ in runs) else next(iter(runs))[0]
    last = max(args.evals)
    rows = [(m, scale, runs[dense_name, scale]) for m, scale in runs]
    if len(args.lr_scales) > 1:
        best_dense = runs[dense_name, _best(runs, dense_name, last)]
        methods = dict.fromkeys(m for m, _ in runs)
        rows += [(m, _best(runs, m, last), best_dense) for m in methods]
    seeds = ", ".join(str(s) for s in args.seeds)
    at = " | ".join(f"after {e}: loss (vs dense)" for e in args.evals)
    lines = [
        f"| method | inner lr | {at} | per seed ({seeds}) vs dense | B sent / received per "
        "outer step | fewer bytes than dense |",
        "|---|---|" + "---|" * len(args.evals) + "---|---|---|",
    ]
    for i, (method, scale, dense) in enumerate(rows):
        mine = runs[method, scale]
        lr = f"{mine[0]['lr']:g}" + (" (better)" if i >= len(runs) else "")
        cells = " | ".join(
            f"{_mean(mine, e):.4f} ({_pct(_mean(mine, e), _mean(dense, e))})" for e in args.evals
        )
        each = "; ".join(
            f"{e}: " + " / ".join(_pct(r["losses"][e], d["losses"][e])
                                  for r, d in zip(mine, dense, strict=True))
            for e in args.evals
        )  # fmt: skip
        sent, received = mine[0]["sent"], mine[0]["received"]
        fewer = (dense[0]["sent"] + dense[0]["received"]) / (sent + received)
        lines.append(
            f"| {method} | {lr} | {cells} | {each} | {sent:,.0f} / {received:,.0f} | {fewer:.1f}x |"
        )
    return "\n".join(lines)


def targets(records: list[dict], args: argparse.Namespace) -> str:
    """Each compressed method's change from dense DiLoCo after every evaluated outer step, on
    every task and ``W`` (each at its better inner lr where there are several), and whether it is
    within 1% of dense DiLoCo after the last one everywhere (the issue's target)."""
    lines, last = [], max(args.evals)
    if not any(r["method"] == "fp32" for r in records):
        return "Within 1% of dense DiLoCo: not judged, fp32 (dense DiLoCo) is not among --methods"
    for method in dict.fromkeys(r["method"] for r in records):
        if parse_method(method).kind in ("fp32", "bf16"):
            continue
        gaps: dict[int, list[str]] = {e: [] for e in args.evals}
        worst = -math.inf
        for t in args.tasks:
            for w in args.workers:
                runs = _runs(records, t, w)
                mine = runs[method, _best(runs, method, last)]
                dense = runs["fp32", _best(runs, "fp32", last)]
                for e in args.evals:
                    gap = _mean(mine, e) / _mean(dense, e) - 1
                    gaps[e].append(f"{t} W={w} {100 * gap:+.2f}%")
                    worst = max(worst, gap) if e == last else worst
        met = "met" if worst <= 0.01 else "NOT met"
        lines.append(f"{method}: " + "; ".join(
            f"after {e} outer steps: {', '.join(g)}" for e, g in gaps.items()
        ) + f". Within 1% of dense DiLoCo after {last} outer steps everywhere: {met}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
