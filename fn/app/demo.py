"""The ``python -m fn demo`` job: the 1-bit optimizers on a real model, on real data, on N workers.

A small character-level model (an embedding of a context window followed by an MLP) learns to
predict the next character of Python source text read from the standard library's own files
(:mod:`fn.app._data`). Every worker trains on its own shard of the text and the optimizers do all
gradient communication themselves, through a ``fn.collectives`` comm: real gloo processes
(``ProcessGroup``) or ``Simulated`` ranks batched under ``torch.func.vmap`` in one process.

The training loop is written with the functional API only::

    grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
    updates, state = opt.update(grads, state, params, step=t)
    params = fn.apply_updates(params, updates)

Optimizers compared (:data:`OPTIMIZERS`):

- ``adam``: ``fn.chain(fn.collectives.dense_allreduce(comm=...), fn.adam(...))``, a dense fp32
  mean allreduce of the gradients, then Adam;
- ``onebit_adam``, ``onebit_lamb``: dense warmup, then 1-bit momentum allreduce (Tang et al.
  2021; Li et al. 2021);
- ``zero_one_adam``: variance refreshes on a doubling interval, 1-bit gradient allreduce in
  between, then local steps synchronized by 1-bit allreduce (Lu et al. 2022);
- ``loco_adam``: ``fn.chain(fn.collectives.loco_allreduce(comm=...), fn.adam(...))``, a 4-bit
  quantized allreduce with LoCo error feedback (Xie et al. 2024) in front of Adam.

The warmup (full-precision) phase is the first :func:`warmup_steps` updates (15 %), so every
compressed phase runs within the demo.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import fn
from fn import collectives
from fn.app import _data, launch
from fn.collectives import dense_allreduce
from fn.tree import PyTree, tree_leaves

__all__ = [
    "OPTIMIZERS",
    "DemoConfig",
    "OptimizerResult",
    "CharMLP",
    "warmup_steps",
    "make_optimizer",
    "describe_schedule",
    "describe",
    "notes",
    "title",
    "run_simulated",
    "run_workers",
]

OPTIMIZERS = ("adam", "onebit_adam", "zero_one_adam", "onebit_lamb", "loco_adam")

WARMUP_FRACTION = 0.15
MIN_WARMUP = 10
HELDOUT_WINDOWS = 1024
LAST_STEPS = 5  # the reported loss is the held-out loss averaged over the last LAST_STEPS updates
CURVE_POINTS = 25  # held-out evaluations spread over the run (besides the last steps)
ZERO_ONE_MAX_LOCAL = 8  # 0/1 Adam's largest local-step interval (local_step_clipper)
# Shared by every optimizer. A short run needs a variance that follows the recent gradients
# (beta2 = 0.99), and a frozen variance near zero (characters rare in the warmup) must not turn
# the 1-bit compression error into huge steps: with eps = 1e-8 1-bit Adam and 0/1 Adam diverge
# here, Adam itself is unchanged by eps = 1e-6.
BETAS = (0.9, 0.99)
EPS = 1e-6


class DemoConfig(NamedTuple):
    steps: int
    world_size: int
    simulate: bool  # Simulated ranks in this process instead of gloo processes
    optimizers: tuple[str, ...]
    lr: float
    seed: int
    timeout: float  # seconds for the gloo workers (all optimizers together)
    batch_size: int = 64  # windows per worker per step
    context: int = 32  # characters the model sees
    embed: int = 16
    hidden: int = 256
    ranks_per_node: int | None = None  # the 1-bit and LoCo collectives' local_world_size


class OptimizerResult(NamedTuple):
    name: str
    train_loss: list[float]  # [steps] training loss per update, mean over ranks
    heldout: list[tuple[int, float]]  # (update, held-out loss, mean over ranks)
    final_loss: float  # mean held-out loss over the last LAST_STEPS updates
    bytes_sent: int  # per rank (the largest over ranks)
    wall_s: float  # seconds spent in the training steps (evaluation excluded)
    identical: bool  # every rank ended with bit-identical params
    max_param_diff: float  # the largest |p_rank - p_0| over ranks and elements
    # bytes sent per rank (the largest over ranks) up to each point of ``heldout``
    heldout_bytes: tuple[int, ...] = ()


class CharMLP(torch.nn.Module):
    """Next-character model: embed ``context`` characters, concatenate, two-layer MLP.

    Input ``[B, context]`` int64 ids, output ``[B, vocab_size]`` logits.
    """

    def __init__(self, vocab_size: int, context: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, embed)
        self.hidden = torch.nn.Linear(context * embed, hidden)
        self.out = torch.nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(start_dim=-2)
        return self.out(torch.nn.functional.gelu(self.hidden(h)))


def warmup_steps(steps: int) -> int:
    """The number of full-precision (warmup) updates: 15 % of ``steps``, and in short runs at
    least ``min(MIN_WARMUP, steps // 2)`` (a variance frozen after a few updates is too noisy)."""
    return max(1, math.ceil(WARMUP_FRACTION * steps), min(MIN_WARMUP, steps // 2))


def _zero_one_local_scaler(steps: int) -> int:
    # Frozen updates per local interval: 1, 2, 4, 8 steps between syncs, each over ~1/8 of the
    # frozen phase, so the largest interval covers its second half.
    return max(1, (steps - warmup_steps(steps)) // 8)


def make_optimizer(
    name: str, comm: Any, lr: float, steps: int, local_world_size: int | None = None
) -> Any:
    """The optimizer ``name`` of :data:`OPTIMIZERS` for a run of ``steps`` updates over ``comm``.

    ``local_world_size``: ranks per node of the compressed collectives (hierarchical 1-bit,
    two-hop LoCo), or ``None`` (flat). Adam's dense allreduce ignores it.

    Returns:
        A ``GradientTransformation`` (``adam``, ``loco_adam``) or a ``CompressedOptimizer``;
        both are called as ``opt.update(grads, state, params, step=t)`` with LOCAL gradients.
    """
    warm = warmup_steps(steps)
    settings = dict(lr=lr, betas=BETAS, eps=EPS)
    level = dict(comm=comm, local_world_size=local_world_size)
    if name == "adam":
        return fn.chain(dense_allreduce(comm=comm), fn.adam(**settings))
    if name == "onebit_adam":
        return fn.onebit_adam(freeze_step=warm + 1, **settings, **level)
    if name == "zero_one_adam":
        return fn.zero_one_adam(
            var_freeze_step=warm,
            local_step_scaler=_zero_one_local_scaler(steps),
            local_step_clipper=ZERO_ONE_MAX_LOCAL,
            **settings,
            **level,
        )
    if name == "onebit_lamb":
        return fn.onebit_lamb(freeze_step=warm + 1, **settings, **level)
    if name == "loco_adam":
        return fn.chain(collectives.loco_allreduce(bits=4, **level), fn.adam(**settings))
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")


def describe_schedule(name: str, steps: int) -> str:
    """One line on what ``name`` communicates, and when, in a run of ``steps`` updates."""
    warm = warmup_steps(steps)
    if name == "adam":
        return "dense fp32 gradient allreduce at every update"
    if name in ("onebit_adam", "onebit_lamb"):
        return (
            f"updates 1-{warm} warm up (dense allreduce), updates {warm + 1}-{steps} send "
            f"1-bit momenta (freeze_step={warm + 1})"
        )
    if name == "zero_one_adam":
        return (
            f"updates 1-{warm}: dense variance refreshes on a doubling interval, 1-bit gradients "
            f"in between (var_freeze_step={warm}); then local steps, synchronized by a 1-bit "
            f"allreduce every 1, 2, 4, then {ZERO_ONE_MAX_LOCAL} updates "
            f"(local_step_scaler={_zero_one_local_scaler(steps)})"
        )
    if name == "loco_adam":
        return "4-bit quantized gradient allreduce with LoCo error feedback at every update"
    raise ValueError(f"unknown optimizer {name!r}")


def _mode(cfg: DemoConfig) -> str:
    if cfg.simulate:
        mode = f"{cfg.world_size} simulated ranks (fn.collectives.Simulated) in this process"
    else:
        mode = f"{cfg.world_size} gloo worker processes (fn.collectives.ProcessGroup)"
    if cfg.ranks_per_node is None:
        return mode
    nodes = cfg.world_size // cfg.ranks_per_node
    return (
        f"{mode}, as {nodes} nodes of {cfg.ranks_per_node} (hierarchical: dense inside a node, "
        "compressed across nodes)"
    )


def describe(cfg: DemoConfig) -> list[str]:
    """The lines printed before training: model, data, run settings and compression schedule.

    Raises:
        RuntimeError: the standard library's source files cannot be read.
    """
    corpus = _data.load_corpus()
    n_train = len(_data.TRAIN_MODULES)
    warm = warmup_steps(cfg.steps)
    params = sum(p.numel() for p in _build_model(cfg, _data.VOCAB_SIZE)[1].values())
    lines = [
        f"fn demo: next-character model, {params:,} params "
        f"(embedding {cfg.embed} x {cfg.context} chars -> {cfg.hidden} GELU -> "
        f"{_data.VOCAB_SIZE} logits: the {_data.VOCAB_CHARS} most frequent characters and "
        f"'other')",
        f"data: {corpus.train.numel():,} characters of {n_train} standard-library modules "
        f"({', '.join(m + '.py' for m in _data.TRAIN_MODULES)}), one contiguous shard per rank; "
        f"held out: {', '.join(m + '.py' for m in _data.HELDOUT_MODULES)} "
        f"({corpus.heldout.numel():,} chars)",
        f"run: {_mode(cfg)}; {cfg.steps} updates per optimizer, {cfg.batch_size} windows per rank "
        f"per update, lr {cfg.lr:g}, betas {BETAS}, eps {EPS:g}, seed {cfg.seed}",
        f"schedule: updates 1-{warm} ({warm / cfg.steps:.0%}) are the full-precision warmup, "
        f"the compressed phases run after it:",
    ]
    lines += [f"  {name:<14} {describe_schedule(name, cfg.steps)}" for name in cfg.optimizers]
    return lines


def notes(cfg: DemoConfig, results: list[OptimizerResult]) -> list[str]:
    """The lines printed under the results table: what the columns mean, and the checks."""
    lines = [
        f"held-out loss: cross-entropy in nats per character on the held-out module, mean over "
        f"the last {LAST_STEPS} updates and over ranks (a uniform guess scores "
        f"{math.log(_data.VOCAB_SIZE):.2f})",
        "bytes/rank: what each rank sent, counted by the comm (comm.bytes_sent; the largest over "
        "ranks); vs adam: adam's bytes divided by the optimizer's",
        "wall s: seconds spent in the training updates (held-out evaluation excluded)",
        f"ranks identical: the final params of all {cfg.world_size} ranks compared bit for bit",
    ]
    for r in results:
        if r.identical:
            continue
        if r.name == "zero_one_adam":
            lines.append(
                f"  zero_one_adam: ranks take local steps between the 1-bit syncs, so their "
                f"params differ by design until the next sync (as in DeepSpeed); they ended "
                f"{r.max_param_diff:.1e} apart at most"
            )
        else:
            lines.append(f"  WARNING: the {r.name} ranks drifted apart ({r.max_param_diff:.1e})")
    return lines


def title(cfg: DemoConfig) -> str:
    """The plot's title."""
    return (
        f"fn demo: {_mode(cfg).split(' (')[0]}, {cfg.steps} updates "
        f"(warmup 1-{warmup_steps(cfg.steps)}), lr {cfg.lr:g}"
    )


def _loss(model: torch.nn.Module, params: PyTree, x: torch.Tensor, y: torch.Tensor):
    logits = torch.func.functional_call(model, params, (x,))
    return torch.nn.functional.cross_entropy(logits, y)


def _train_step(model, opt, params, state, x, y, t):
    """One update on one rank: LOCAL gradients in, the optimizer communicates."""
    grads, loss = torch.func.grad_and_value(functools.partial(_loss, model))(params, x, y)
    updates, state = opt.update(grads, state, params, step=t)
    return fn.apply_updates(params, updates), state, loss


def _build_model(cfg: DemoConfig, vocab_size: int) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(cfg.seed)  # the same initial params on every rank: no broadcast needed
    model = CharMLP(vocab_size, cfg.context, cfg.embed, cfg.hidden)
    return model, {k: v.detach().clone() for k, v in model.named_parameters()}


class _Data(NamedTuple):
    shards: list[torch.Tensor]  # per rank [n_shard] int64
    heldout_x: torch.Tensor  # [HELDOUT_WINDOWS, context]
    heldout_y: torch.Tensor  # [HELDOUT_WINDOWS]


def _prepare_data(cfg: DemoConfig, ranks: range) -> _Data:
    corpus = _data.load_corpus()
    shards = [_data.shard(corpus.train, r, cfg.world_size) for r in ranks]
    starts = _data.heldout_starts(corpus.heldout.numel(), cfg.context, HELDOUT_WINDOWS)
    return _Data(shards, *_data.windows(corpus.heldout, starts, cfg.context))


def _batches(cfg: DemoConfig, data: _Data, ranks: range) -> Callable[[], tuple[torch.Tensor, ...]]:
    """A function returning the next ``([R, B, context], [R, B])`` batch of the ranks ``ranks``.

    Each rank draws from its own shard with its own generator, seeded from ``(seed, rank)``, so
    every optimizer sees the same batches, in simulated and in real runs alike.
    """
    gens = [torch.Generator().manual_seed(cfg.seed * 100_003 + r) for r in ranks]

    def next_batch():
        pairs = []
        for shard, gen in zip(data.shards, gens, strict=True):
            starts = _data.batch_starts(shard.numel(), cfg.context, cfg.batch_size, gen)
            pairs.append(_data.windows(shard, starts, cfg.context))
        xs, ys = zip(*pairs, strict=True)
        return torch.stack(xs), torch.stack(ys)

    return next_batch


class _Trace(NamedTuple):
    train_loss: list[torch.Tensor]  # per update: [R] losses of the local ranks
    heldout: list[tuple[int, torch.Tensor]]  # (update, [R] held-out losses)
    heldout_bytes: list[int]  # bytes this process's comm had sent at each held-out point
    bytes_sent: int
    wall_s: float
    flat_params: torch.Tensor  # [R, P] final params of the local ranks


def _fit(
    cfg: DemoConfig,
    step_fn: Callable[..., Any],
    eval_fn: Callable[[PyTree], torch.Tensor],
    next_batch: Callable[[], tuple[torch.Tensor, ...]],
    params: PyTree,
    state: Any,
    comm: Any,
    on_step: Callable[[int], None],
) -> _Trace:
    """The training loop shared by both modes (the ranks axis ``R`` is W or 1)."""
    every = max(1, cfg.steps // CURVE_POINTS)
    last = range(max(1, cfg.steps - LAST_STEPS + 1), cfg.steps + 1)
    evals = {1, *range(every, cfg.steps + 1, every), *last}
    train, heldout, heldout_bytes, wall = [], [], [], 0.0
    for t in range(1, cfg.steps + 1):
        x, y = next_batch()
        start = time.perf_counter()
        params, state, loss = step_fn(params, state, x, y, t)
        wall += time.perf_counter() - start
        train.append(loss.detach().reshape(-1))
        if t in evals:
            with torch.no_grad():
                heldout.append((t, eval_fn(params).reshape(-1)))
                heldout_bytes.append(comm.bytes_sent)
        on_step(t)
    leaves = tree_leaves(params) if cfg.simulate else [p[None] for p in tree_leaves(params)]
    flat = torch.cat([p.reshape(p.shape[0], -1) for p in leaves], dim=1)  # [R, P]
    return _Trace(train, heldout, heldout_bytes, comm.bytes_sent, wall, flat)


def run_simulated(
    cfg: DemoConfig, on_step: Callable[[int, str, int], None]
) -> list[OptimizerResult]:
    """Trains with every optimizer of ``cfg`` on ``Simulated(cfg.world_size)`` ranks.

    Args:
        cfg: the demo's settings (``cfg.simulate`` must be true).
        on_step: called as ``on_step(index, name, t)`` after update ``t`` of optimizer ``index``.

    Returns:
        One :class:`OptimizerResult` per optimizer.
    """
    ranks = range(cfg.world_size)
    data = _prepare_data(cfg, ranks)
    model, params0 = _build_model(cfg, _data.VOCAB_SIZE)
    # The first gradient in a process pays one-time setup costs (torch.func, kernels); pay them
    # here so that they do not count in the first optimizer's wall time.
    grad_fn = torch.func.vmap(torch.func.grad(functools.partial(_loss, model)))
    replicas = collectives.replicate(params0, collectives.Simulated(cfg.world_size))
    grad_fn(replicas, *_batches(cfg, data, ranks)())
    evaluate = torch.func.vmap(functools.partial(_loss, model), in_dims=(0, None, None))
    results = []
    for i, name in enumerate(cfg.optimizers):
        comm = collectives.Simulated(cfg.world_size)
        opt = make_optimizer(name, comm, cfg.lr, cfg.steps, cfg.ranks_per_node)
        step = collectives.simulate(functools.partial(_train_step, model, opt), comm)
        trace = _fit(
            cfg,
            step,
            lambda p: evaluate(p, data.heldout_x, data.heldout_y),
            _batches(cfg, data, ranks),
            collectives.replicate(params0, comm),
            collectives.replicate(opt.init(params0), comm),
            comm,
            functools.partial(on_step, i, name),
        )
        results.append(_summarize(name, [trace]))
    return results


def _worker(rank: int, world_size: int, send: Callable[[Any], None], cfg: DemoConfig):
    """One gloo process: trains with every optimizer, returns its :class:`_Trace` per optimizer."""
    ranks = range(rank, rank + 1)
    data = _prepare_data(cfg, ranks)
    model, params0 = _build_model(cfg, _data.VOCAB_SIZE)
    x, y = _batches(cfg, data, ranks)()
    # untimed, as in run_simulated
    torch.func.grad(functools.partial(_loss, model))(params0, x[0], y[0])
    traces = []
    for i, name in enumerate(cfg.optimizers):
        comm = collectives.ProcessGroup()
        opt = make_optimizer(name, comm, cfg.lr, cfg.steps, cfg.ranks_per_node)
        next_batch = _batches(cfg, data, ranks)

        def local_batch(next_batch=next_batch):
            x, y = next_batch()
            return x[0], y[0]

        def on_step(t, i=i, name=name):
            if rank == 0:
                send((i, name, t))

        traces.append(
            _fit(
                cfg,
                functools.partial(_train_step, model, opt),
                lambda p: _loss(model, p, data.heldout_x, data.heldout_y),
                local_batch,
                params0,
                opt.init(params0),
                comm,
                on_step,
            )
        )
    return traces


def run_workers(cfg: DemoConfig, on_step: Callable[[int, str, int], None]) -> list[OptimizerResult]:
    """Trains with every optimizer of ``cfg`` on ``cfg.world_size`` gloo processes.

    Args:
        cfg: the demo's settings (``cfg.simulate`` must be false).
        on_step: called in this process as ``on_step(index, name, t)`` as rank 0 progresses.

    Returns:
        One :class:`OptimizerResult` per optimizer.

    Raises:
        fn.app.launch.WorkerError: a worker failed, died or ran past ``cfg.timeout``.
    """
    per_rank = launch.spawn_gloo(
        _worker,
        cfg.world_size,
        (cfg,),
        timeout=cfg.timeout,
        on_message=lambda rank, message: on_step(*message),
    )
    return [
        _summarize(name, [traces[i] for traces in per_rank])
        for i, name in enumerate(cfg.optimizers)
    ]


def _summarize(name: str, traces: list[_Trace]) -> OptimizerResult:
    """Merges the traces of all ranks (one per process, or one of all simulated ranks)."""
    train = [
        torch.cat(per_step).mean().item()
        for per_step in zip(*(tr.train_loss for tr in traces), strict=True)
    ]
    heldout = [
        (points[0][0], torch.cat([loss for _, loss in points]).mean().item())
        for points in zip(*(tr.heldout for tr in traces), strict=True)
    ]
    last = heldout[-min(LAST_STEPS, len(heldout)) :]
    flat = torch.cat([tr.flat_params for tr in traces])
    return OptimizerResult(
        name=name,
        train_loss=train,
        heldout=heldout,
        final_loss=sum(loss for _, loss in last) / len(last),
        bytes_sent=max(tr.bytes_sent for tr in traces),
        wall_s=max(tr.wall_s for tr in traces),
        identical=all(torch.equal(flat[0], row) for row in flat[1:]),
        max_param_diff=(flat - flat[0]).abs().max().item(),
        heldout_bytes=tuple(map(max, zip(*(tr.heldout_bytes for tr in traces), strict=True))),
    )
