"""Held-out loss of the 1-bit optimizers in low precision, against torch.optim.AdamW.

Two gloo ranks (one process each, CPU) train two small tasks with ``fn.optim.OnebitAdam``,
``fn.optim.ZeroOneAdam``, ``fn.optim.OnebitLamb`` and ``torch.optim.AdamW``, in each precision:

- ``fp32``: fp32 params;
- ``bf16``: bf16 params; the fn adapters keep their fp32 master copy, AdamW steps fp32 master
  copies kept by this script and casts them back into the params (the same recipe);
- ``autocast-bf16``: fp32 params, forward and backward under
  ``torch.autocast("cpu", dtype=torch.bfloat16)``;
- ``autocast-fp16``: fp32 params under ``torch.autocast("cpu", dtype=torch.float16)``, the loss
  scaled by ``torch.amp.GradScaler("cpu")`` (``scaler.step(opt)``; the fn adapters unscale and
  skip overflow steps themselves).

Tasks: ``demo``, the next-character model and stdlib text of ``python -m fn demo``
(:mod:`fn.app.demo`, :mod:`fn.app._data`; held out: ``fractions.py``); ``gpt2``, the examples'
tiny GPT-2 on their synthetic tokens (``fn.app.examples``; held out: 512 sequences of another
seed; needs transformers). AdamW averages the gradients over the ranks as DDP does (one fp32
allreduce per step); the fn optimizers communicate themselves (dense warmup over the first 15 %
of the updates, as the demo, then compressed). Every optimizer gets the same lr (per task:
``--demo-lr``, the demo's 3e-3; ``--gpt2-lr``, 1e-2, where 1-bit LAMB's trust ratios still
learn within the run), betas and eps (the demo's) and weight decay (decoupled in all four).
The held-out loss (cross-entropy in nats, computed in fp32 from the logits of the model as
trained, in its precision) is taken after the last update, averaged over the two ranks and then
over ``--seeds`` (model init and data order; every run of a seed sees the same batches).

Printed: a line per run, then a markdown table: task, precision, optimizer, held-out loss
(``mean ± std`` over seeds when there are several), its ratio to AdamW's in the same precision
and to the same optimizer's fp32 run. ``--json FILE`` writes every run's numbers.
``--optimizer-kwargs JSON`` passes keyword arguments to the three fn optimizers (a string naming
a torch dtype, e.g. ``"bfloat16"``, is that dtype); their rows are labelled with them.

Run: python3 benchmarks/precision.py [--tasks demo,gpt2] [--precisions fp32,bf16,...]
     [--optimizers adamw,onebit_adam,...] [--seeds 0,1] [--demo-steps 400] [--gpt2-steps 200]
     [--demo-lr 3e-3] [--gpt2-lr 1e-2] [--weight-decay 0.01]
     [--optimizer-kwargs '{"error_dtype": "bfloat16"}'] [--json FILE] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import fn.optim  # noqa: E402
from fn.app import _data, demo  # noqa: E402
from fn.app.examples import SyntheticTokens, tiny_gpt2  # noqa: E402  (transformers: when called)
from fn.app.launch import spawn_gloo  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import parse_with_quick  # noqa: E402

WORLD_SIZE = 2
TASKS = ("demo", "gpt2")
PRECISIONS = {
    "fp32": "fp32",
    "bf16": "bf16 params, fp32 masters",
    "autocast-bf16": "autocast bf16",
    "autocast-fp16": "autocast fp16 + GradScaler",
}
ONEBIT = {
    "onebit_adam": fn.optim.OnebitAdam,
    "zero_one_adam": fn.optim.ZeroOneAdam,
    "onebit_lamb": fn.optim.OnebitLamb,
}
OPTIMIZERS = ("adamw", *ONEBIT)
DEMO_BATCH = 64  # windows per rank per update, as the demo
GPT2_BATCH = 16  # sequences per rank per update


class DemoTask:
    """The demo's next-character model (its default size) on this rank's shard of the
    standard-library text; ``heldout`` windows of the held-out module."""

    def __init__(self, rank: int, world_size: int, seed: int, heldout: int) -> None:
        corpus = _data.load_corpus()
        self.context, self.seed = 32, seed
        self.shard = _data.shard(corpus.train, rank, world_size)
        starts = _data.heldout_starts(corpus.heldout.numel(), self.context, heldout)
        self.heldout = _data.windows(corpus.heldout, starts, self.context)
        self.data_seed = seed * 100_003 + rank

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return demo.CharMLP(_data.VOCAB_SIZE, self.context, embed=16, hidden=256)

    def batches(self) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """A function returning the next batch: the same sequence in every run."""
        gen = torch.Generator().manual_seed(self.data_seed)

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            starts = _data.batch_starts(self.shard.numel(), self.context, DEMO_BATCH, gen)
            return _data.windows(self.shard, starts, self.context)

        return batch

    def loss(
        self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x).float(), y)


class Gpt2Task:
    """The examples' tiny GPT-2 on this rank's share of the synthetic token sequences; up to
    ``heldout`` sequences of another seed held out."""

    def __init__(self, rank: int, world_size: int, seed: int, heldout: int) -> None:
        self.seed = seed
        self.shard = SyntheticTokens().tokens[rank::world_size]
        self.heldout = SyntheticTokens(seed=2).tokens[:heldout]
        self.data_seed = seed * 100_003 + rank

    def model(self) -> torch.nn.Module:
        return tiny_gpt2(self.seed)

    def batches(self) -> Callable[[], torch.Tensor]:
        """A function returning the next batch: the same sequence in every run."""
        gen = torch.Generator().manual_seed(self.data_seed)
        return lambda: self.shard[torch.randint(0, len(self.shard), (GPT2_BATCH,), generator=gen)]

    def loss(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens).logits.float()
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )


TASK_TYPES = {"demo": DemoTask, "gpt2": Gpt2Task}


class DenseAdamW:
    """``torch.optim.AdamW`` on two ranks: the gradients averaged in one fp32 allreduce (as DDP),
    and for low-precision params an fp32 master copy stepped by AdamW and cast back."""

    def __init__(self, model: torch.nn.Module, **hyper: Any) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_()
            for p in self.params
        ]
        self.opt = torch.optim.AdamW(self.masters, **hyper)

    def step(self, scaler: torch.amp.GradScaler | None) -> None:
        flat = torch.cat([p.grad.reshape(-1).float() for p in self.params])
        torch.distributed.all_reduce(flat)
        flat /= torch.distributed.get_world_size()
        sizes = [p.numel() for p in self.params]
        for master, grad in zip(self.masters, flat.split(sizes), strict=True):
            master.grad = grad.view_as(master)
        if scaler is None:
            self.opt.step()
        else:
            scaler.step(self.opt)
        with torch.no_grad():
            for p, master in zip(self.params, self.masters, strict=True):
                if p is not master:
                    p.copy_(master)
        for p in {*self.params, *self.masters}:
            p.grad = None


def make_optimizer(
    name: str, model: torch.nn.Module, steps: int, hyper: dict, onebit_kwargs: dict
) -> Any:
    """The optimizer ``name`` of :data:`OPTIMIZERS` for a run of ``steps`` updates.

    Returns:
        A :class:`DenseAdamW` or an ``fn.optim`` 1-bit optimizer (its default comm: the gloo
        group).
    """
    if name == "adamw":
        return DenseAdamW(model, **hyper)
    warm = demo.warmup_steps(steps)
    if name == "zero_one_adam":
        schedule = dict(
            var_freeze_step=warm,
            local_step_scaler=max(1, (steps - warm) // 8),
            local_step_clipper=demo.ZERO_ONE_MAX_LOCAL,
        )
    else:
        schedule = dict(freeze_step=warm + 1)
    return ONEBIT[name](model.parameters(), **hyper, **schedule, **onebit_kwargs)


def _autocast(precision: str) -> contextlib.AbstractContextManager:
    if precision == "autocast-bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if precision == "autocast-fp16":
        return torch.autocast("cpu", dtype=torch.float16)
    return contextlib.nullcontext()


def train(task: Any, precision: str, name: str, steps: int, lr: float, config: dict) -> dict:
    """One run on this rank: ``steps`` updates of ``name`` in ``precision`` at ``lr``.

    Returns:
        ``{"heldout", "train", "skipped", "seconds"}``: the held-out and last training loss
        (means over the ranks; ``inf`` once an fn optimizer met a non-finite gradient), the
        steps a GradScaler skipped and the wall time.
    """
    model = task.model()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    hyper = dict(lr=lr, betas=demo.BETAS, eps=demo.EPS, weight_decay=config["wd"])
    opt = make_optimizer(name, model, steps, hyper, config["onebit_kwargs"])
    scaler = torch.amp.GradScaler("cpu") if precision == "autocast-fp16" else None
    next_batch = task.batches()
    skipped, start, diverged = 0, time.perf_counter(), False
    for _ in range(steps):
        with _autocast(precision):
            loss = task.loss(model, next_batch())
        (loss if scaler is None else scaler.scale(loss)).backward()
        try:
            if name == "adamw":
                opt.step(scaler)
            elif scaler is None:
                opt.step()
            else:
                scaler.step(opt)
        except fn.NonFiniteError:  # raised on every rank alike
            diverged = True
            break
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.update()
            skipped += scaler.get_scale() < scale
        model.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    with torch.no_grad(), _autocast(precision):
        heldout = task.loss(model, task.heldout)
    losses = torch.stack([heldout.float(), loss.detach().float()])
    torch.distributed.all_reduce(losses)
    losses /= torch.distributed.get_world_size()
    inf = float("inf")
    return {
        "heldout": inf if diverged else losses[0].item(),
        "train": inf if diverged else losses[1].item(),
        "skipped": int(skipped),
        "seconds": seconds,
    }


def worker(rank: int, world_size: int, send: Callable[[Any], None], config: dict) -> list[dict]:
    """One gloo rank: every (task, seed, precision, optimizer) of ``config`` in turn."""
    if rank:  # the ranks warn alike (e.g. of a frozen variance near zero): rank 0 speaks for all
        warnings.simplefilter("ignore")
    runs = []
    for task_name in config["tasks"]:
        steps, lr = config["steps"][task_name], config["lr"][task_name]
        for seed in config["seeds"]:
            task = TASK_TYPES[task_name](rank, world_size, seed, config["heldout"])
            for precision in config["precisions"]:
                for name in config["optimizers"]:
                    key = dict(task=task_name, seed=seed, precision=precision, optimizer=name)
                    run = {**key, "steps": steps, **train(task, precision, name, steps, lr, config)}
                    runs.append(run)
                    if rank == 0:
                        send(run)
    return runs


def _ratio(num: float, den: float | None) -> str:
    if den is None or not math.isfinite(num) or not math.isfinite(den):
        return "-"
    return f"{num / den:.3f}"


def table(runs: list[dict], labels: dict[str, str]) -> list[str]:
    """The markdown table of ``runs`` (one row per task, precision and optimizer, over seeds)."""
    means: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        means.setdefault((run["task"], run["precision"], run["optimizer"]), []).append(
            run["heldout"]
        )
    lines = [
        "| task | precision | optimizer | held-out loss | vs AdamW (same precision) | "
        "vs own fp32 |",
        "|---|---|---|---:|---:|---:|",
    ]
    for (task, precision, name), losses in means.items():
        mean = statistics.fmean(losses)
        shown = f"{mean:.4f}" if math.isfinite(mean) else "diverged"
        if len(losses) > 1 and math.isfinite(mean):
            shown += f" ± {statistics.stdev(losses):.4f}"
        adamw = means.get((task, precision, "adamw"))
        fp32 = means.get((task, "fp32", name))
        lines.append(
            f"| {task} | {PRECISIONS[precision]} | {labels[name]} | {shown} | "
            f"{_ratio(mean, adamw and statistics.fmean(adamw))} | "
            f"{_ratio(mean, fp32 and statistics.fmean(fp32))} |"
        )
    return lines


def _names(choices: tuple[str, ...] | dict) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"{','.join(unknown) or 'nothing'}: choose from {','.join(choices)}"
            )
        return names

    return parse


def _seeds(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from err


def _kwargs(text: str) -> dict[str, Any]:
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from err
    if not isinstance(kwargs, dict):
        raise argparse.ArgumentTypeError("a JSON object is expected")
    return {
        k: getattr(torch, v) if isinstance(getattr(torch, str(v), None), torch.dtype) else v
        for k, v in kwargs.items()
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--tasks", type=_names(TASKS), default=list(TASKS))
    parser.add_argument("--precisions", type=_names(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--optimizers", type=_names(OPTIMIZERS), default=list(OPTIMIZERS))
    parser.add_argument("--seeds", type=_seeds, default=[0], help="comma-separated")
    parser.add_argument("--demo-steps", type=int, default=400)
    parser.add_argument("--gpt2-steps", type=int, default=200)
    parser.add_argument("--demo-lr", type=float, default=3e-3, help="every optimizer's, demo")
    parser.add_argument("--gpt2-lr", type=float, default=1e-2, help="every optimizer's, gpt2")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="every optimizer's")
    parser.add_argument(
        "--heldout", type=int, default=1024, help="held-out windows (demo) / sequences (gpt2)"
    )
    parser.add_argument(
        "--optimizer-kwargs",
        type=_kwargs,
        default={},
        metavar="JSON",
        help='extra keyword arguments of the fn optimizers, e.g. \'{"error_dtype": "bfloat16"}\'',
    )
    parser.add_argument("--json", metavar="FILE", help="write every run's numbers here")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for all runs")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short check: 60 demo / 40 gpt2 updates, 256 held-out windows (where "
        "--demo-steps, --gpt2-steps, --heldout are not given)",
    )
    args = parse_with_quick(parser, argv, {"demo_steps": 60, "gpt2_steps": 40, "heldout": 256})
    if min(args.demo_steps, args.gpt2_steps) < 10:
        parser.error("--demo-steps and --gpt2-steps must be at least 10")
    if min(args.demo_lr, args.gpt2_lr, args.heldout, args.timeout) <= 0 or args.weight_decay < 0:
        parser.error(
            "--demo-lr, --gpt2-lr, --heldout and --timeout must be positive, --weight-decay >= 0"
        )
    if "gpt2" in args.tasks and importlib.util.find_spec("transformers") is None:
        parser.error("the gpt2 task needs transformers (pip install transformers); or --tasks demo")
    for cls in ONEBIT.values():
        accepted = inspect.signature(cls).parameters
        if absent := [k for k in args.optimizer_kwargs if k not in accepted]:
            parser.error(f"--optimizer-kwargs: fn.optim.{cls.__name__} has no {', '.join(absent)}")
    extra = ", ".join(
        f"{k}={str(v).removeprefix('torch.')}" for k, v in args.optimizer_kwargs.items()
    )
    labels = {n: n if n == "adamw" or not extra else f"{n} ({extra})" for n in OPTIMIZERS}
    config = {
        "tasks": args.tasks,
        "precisions": args.precisions,
        "optimizers": args.optimizers,
        "seeds": args.seeds,
        "steps": {"demo": args.demo_steps, "gpt2": args.gpt2_steps},
        "heldout": args.heldout,
        "lr": {"demo": args.demo_lr, "gpt2": args.gpt2_lr},
        "wd": args.weight_decay,
        "onebit_kwargs": args.optimizer_kwargs,
    }
    total = len(args.tasks) * len(args.seeds) * len(args.precisions) * len(args.optimizers)
    print(
        f"{WORLD_SIZE} gloo ranks (CPU), {total} runs; betas {demo.BETAS}, eps {demo.EPS:g}, "
        f"weight decay {args.weight_decay:g}; "
        + ", ".join(
            f"{t}: {config['steps'][t]} updates, lr {config['lr'][t]:g}" for t in args.tasks
        ),
        flush=True,
    )
    done = []

    def progress(rank: int, run: dict) -> None:
        done.append(run)
        print(
            f"[{len(done)}/{total}] {run['task']} seed {run['seed']} {run['precision']} "
            f"{labels[run['optimizer']]}: held-out {run['heldout']:.4f}, train {run['train']:.4f}"
            + (f", {run['skipped']} steps skipped" if run["skipped"] else "")
            + f" ({run['seconds']:.1f} s)",
            flush=True,
        )

    ranks = spawn_gloo(worker, WORLD_SIZE, (config,), timeout=args.timeout, on_message=progress)
    runs = ranks[0]
    print("\n".join(["", *table(runs, labels)]))
    if args.json:
        with open(args.json, "w") as out:
            settings = {**config, "onebit_kwargs": extra}
            json.dump({"config": settings, "labels": labels, "runs": runs}, out, indent=1)
    return runs


if __name__ == "__main__":
    main()
