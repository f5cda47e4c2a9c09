"""``freeze_step="auto"`` against fixed freeze steps: held-out loss, bytes sent, the switch.

Two gloo ranks (one process each, CPU) train three tasks with ``fn.optim.OnebitAdam``, once
with ``freeze_step="auto"`` (the default ``fn.AutoFreeze()``) and once per fixed
``freeze_step`` at 5, 10, 15, 25 and 40 % of the run:

- ``demo``: the next-character model and stdlib text of ``python -m fn demo`` (as
  ``benchmarks/precision.py``'s task);
- ``gpt2``: the examples' tiny GPT-2 on their synthetic tokens (``fn.app.examples``; needs
  transformers);
- ``mlp``: a 16-64-64-4 ReLU MLP regressing a fixed random teacher network (MSE).

Every run of a seed sees the same batches and initial params. The held-out loss of a run is the
mean over the ranks and over the last 10 % of its updates (evaluated every ``steps // 100``
updates there: 10 evaluations at 300 updates), so that the noise of the last iterate does not
decide; then it is averaged over ``--seeds`` (four by default: a seed's own ratio to the best
fixed setting spreads by up to 1 % on the demo and the GPT-2 and by several % on the MLP, see
docs/algorithms.md). Bytes are what one rank sent (``comm.bytes_sent``, the largest over the
ranks), averaged over the seeds; the switch is the first compressed update
(``opt.next_update_compressed()`` before each step).

Printed: a line per run, then a markdown table per task and setting: held-out loss (mean and
standard deviation over the seeds), its ratio to the best fixed setting's (the ratio of the
means, and the standard deviation over the seeds of each seed's own ratio), bytes and their
ratio to the 25 % setting's, the switch. The targets of ``"auto"``: loss within 1 % of the best
fixed setting, bytes at most the 25 % setting's.

``--lr mlp=3e-3`` (repeatable) changes a task's learning rate and ``--fractions`` the fixed
settings (in %; 100 never compresses within the run): docs/algorithms.md uses both to show how
the MLP's best fixed setting moves with its learning rate. ``--schedule cosine`` decays every
run's learning rate to 0 over the run (``constant`` by default), and ``--tolerance`` sets
``"auto"``'s ``fn.AutoFreeze(tolerance=...)`` (0.5 by default).

Run: python3 benchmarks/freeze.py [--tasks demo,gpt2,mlp] [--seeds 0,1,2,3] [--demo-steps 300]
     [--gpt2-steps 200] [--mlp-steps 300] [--lr TASK=LR ...] [--fractions 5,10,15,25,40]
     [--schedule constant|cosine] [--tolerance 0.5] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import precision  # noqa: E402  (puts the repository on the path)
from cluster import int_list, parse_with_quick  # noqa: E402

import fn  # noqa: E402
import fn.optim  # noqa: E402
from fn.app import demo  # noqa: E402
from fn.app.examples import positive_int  # noqa: E402
from fn.app.launch import spawn_gloo  # noqa: E402

PERCENTS = (5, 10, 15, 25, 40)
LR = {"demo": 3e-3, "gpt2": 1e-2, "mlp": 1e-2}


class MlpTask:
    """A 16-64-64-4 ReLU MLP regressing a fixed random teacher (a 16-32-4 tanh network)."""

    def __init__(self, rank: int, world_size: int, seed: int, heldout: int) -> None:
        teacher = torch.Generator().manual_seed(1234)
        self.w1 = torch.randn(16, 32, generator=teacher) / 4
        self.w2 = torch.randn(32, 4, generator=teacher) / 6
        self.seed, self.data_seed = seed, seed * 100_003 + rank
        x = torch.randn(heldout, 16, generator=torch.Generator().manual_seed(999))
        self.heldout = (x, self.target(x))

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1) @ self.w2

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return torch.nn.Sequential(
            torch.nn.Linear(16, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 4),
        )

    def batches(self) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.data_seed)

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randn(32, 16, generator=gen)
            return x, self.target(x) + 0.05 * torch.randn(32, 4, generator=gen)

        return batch

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)


TASK_TYPES = {"demo": precision.DemoTask, "gpt2": precision.Gpt2Task, "mlp": MlpTask}


def settings(percents: list[float]) -> list[str]:
    """The settings a run compares: ``"auto"``, then a fixed one per percentage."""
    return ["auto", *(f"{p:g}%" for p in percents)]


def freeze_step(setting: str, steps: int, tolerance: float) -> Any:
    """The ``freeze_step`` of a setting: ``fn.AutoFreeze(tolerance=tolerance)`` for ``"auto"``,
    or the update at that fraction of the run."""
    if setting == "auto":
        return fn.AutoFreeze(tolerance=tolerance)
    return max(2, round(float(setting.rstrip("%")) / 100 * steps) + 1)


def train(task: Any, setting: str, steps: int, lr: float, config: dict) -> dict:
    """One run on this rank: the held-out loss (mean over the ranks and the last 10 % of the
    updates), bytes sent, the switch."""
    model = task.model()
    opt = fn.optim.OnebitAdam(
        model.parameters(),
        lr=lr,
        freeze_step=freeze_step(setting, steps, config["tolerance"]),
        betas=demo.BETAS,
        eps=demo.EPS,
    )
    if config["schedule"] == "cosine":
        decay = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: 0.5 * (1 + math.cos(math.pi * t / steps))
        )
    next_batch, switch, heldout = task.batches(), None, []
    every = max(1, steps // 100)
    for t in range(1, steps + 1):
        if switch is None and opt.next_update_compressed()[0]:
            switch = t
        task.loss(model, next_batch()).backward()
        opt.step()
        if config["schedule"] == "cosine":
            decay.step()
        model.zero_grad(set_to_none=True)
        if t > steps - max(1, steps // 10) and (steps - t) % every == 0:
            with torch.no_grad():
                heldout.append(task.loss(model, task.heldout).reshape(1))
    heldout = torch.cat(heldout).mean().reshape(1)
    torch.distributed.all_reduce(heldout)
    sent = torch.tensor([opt.comm.bytes_sent])
    torch.distributed.all_reduce(sent, op=torch.distributed.ReduceOp.MAX)
    world = torch.distributed.get_world_size()
    return {"heldout": heldout.item() / world, "bytes": int(sent), "switch": switch}


def worker(rank: int, world_size: int, send: Callable[[Any], None], config: dict) -> list[dict]:
    """One gloo rank: every (task, seed, setting) of ``config`` in turn."""
    if rank:  # the ranks warn alike: rank 0 speaks for all
        warnings.simplefilter("ignore")
    runs = []
    for task_name in config["tasks"]:
        steps = config["steps"][task_name]
        for seed in config["seeds"]:
            task = TASK_TYPES[task_name](rank, world_size, seed, 512)
            for setting in settings(config["percents"]):
                run = {"task": task_name, "seed": seed, "setting": setting, "steps": steps}
                run.update(train(task, setting, steps, config["lr"][task_name], config))
                runs.append(run)
                if rank == 0:
                    send(run)
    return runs


def table(runs: list[dict]) -> list[str]:
    """The markdown table: per task and setting, means over the seeds ("vs 25 %": ``-`` when
    the 25 % setting did not run)."""
    lines = [
        "| task | freeze_step | held-out loss | vs best fixed | bytes/rank | vs 25 % | switch |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in dict.fromkeys(r["task"] for r in runs):
        mine = [r for r in runs if r["task"] == task]
        seeds = list(dict.fromkeys(r["seed"] for r in mine))
        names = list(dict.fromkeys(r["setting"] for r in mine))
        losses = {(r["setting"], r["seed"]): r["heldout"] for r in mine}
        mean = {
            s: {
                k: statistics.mean(r[k] for r in mine if r["setting"] == s)
                for k in ("heldout", "bytes")
            }
            for s in names
        }
        best = min((s for s in names if s != "auto"), key=lambda s: mean[s]["heldout"])
        for s in names:
            switches = [r["switch"] for r in mine if r["setting"] == s]
            spread = _stdev([losses[s, seed] for seed in seeds])
            ratios = [losses[s, seed] / losses[best, seed] for seed in seeds]
            vs_25 = f"{mean[s]['bytes'] / mean['25%']['bytes']:.2f}" if "25%" in mean else "-"
            lines.append(
                f"| {task} | {s} | {mean[s]['heldout']:.4f} ± {spread:.4f} | "
                f"{mean[s]['heldout'] / mean[best]['heldout']:.3f} ± {_stdev(ratios):.3f} | "
                f"{mean[s]['bytes']:,.0f} | {vs_25} | {', '.join(map(str, switches))} |"
            )
    return lines


def _stdev(values: list[float]) -> float:
    """The sample standard deviation, 0 for a single value."""
    return statistics.stdev(values) if len(values) > 1 else 0.0


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="demo,gpt2,mlp")
    parser.add_argument("--seeds", type=int_list(0), default="0,1,2,3", help="comma-separated")
    parser.add_argument("--demo-steps", type=positive_int, default=300)
    parser.add_argument("--gpt2-steps", type=positive_int, default=200)
    parser.add_argument("--mlp-steps", type=positive_int, default=300)
    parser.add_argument(
        "--lr",
        action="append",
        default=[],
        metavar="TASK=LR",
        help="a task's learning rate (repeatable), e.g. mlp=3e-3",
    )
    parser.add_argument(
        "--fractions",
        default=",".join(map(str, PERCENTS)),
        help="the fixed settings, in %% of the run (100: never compressed within it)",
    )
    parser.add_argument("--schedule", choices=("constant", "cosine"), default="constant")
    parser.add_argument(
        "--tolerance", type=float, default=fn.AutoFreeze().tolerance, help='"auto"\'s tolerance'
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny run: 24 updates, seed 0 (where not given)"
    )
    quick = {"demo_steps": 24, "gpt2_steps": 24, "mlp_steps": 24, "seeds": [0]}
    args = parse_with_quick(parser, argv, quick)
    lr = dict(LR)
    for item in args.lr:
        task, _, value = item.partition("=")
        if task not in LR or not value:
            parser.error(f"--lr takes TASK=LR with TASK one of {sorted(LR)}, got {item!r}")
        lr[task] = float(value)
    percents = [float(p) for p in args.fractions.split(",") if p]
    if not percents or any(not 0 < p <= 100 for p in percents):
        parser.error(f"--fractions takes percentages in (0, 100], got {args.fractions!r}")
    tasks = [t for t in args.tasks.split(",") if t]
    if "gpt2" in tasks and importlib.util.find_spec("transformers") is None:
        print("gpt2: skipped (transformers is not installed)")
        tasks.remove("gpt2")
    steps = {"demo": args.demo_steps, "gpt2": args.gpt2_steps, "mlp": args.mlp_steps}
    seeds = args.seeds
    if not 0 < args.tolerance < 1:
        parser.error(f"--tolerance takes a number in (0, 1), got {args.tolerance!r}")
    config = {
        "tasks": tasks,
        "seeds": seeds,
        "steps": steps,
        "lr": lr,
        "percents": percents,
        "schedule": args.schedule,
        "tolerance": args.tolerance,
    }
    results = spawn_gloo(
        worker,
        precision.WORLD_SIZE,
        (config,),
        timeout=3600,
        on_message=lambda rank, run: print(run, flush=True),
        threads=1,
    )
    runs = results[0]
    print("\n".join(table(runs)))
    return runs


if __name__ == "__main__":
    main()
