"""Gradient clipping under gradient spikes: fn.fsdp's 1-bit Adam with ``max_grad_norm`` against
FSDP2 + dense AdamW with ``torch.nn.utils.clip_grad_norm_``.

Two gloo ranks (one process each, CPU) train freeze.py's MLP task (a 16-64-64-4 ReLU MLP
regressing a fixed teacher) sharded by FSDP2 on a 1-D mesh, ``--accumulate`` micro-batches per
update (each its own backward, the loss divided by it). Every ``--spike-every`` updates one
rank's first micro-batch has its inputs scaled by ``--spike`` (a gradient spike on one rank).
Four runs per seed, the same params, batches and spikes:

- ``adamw``: ``torch.optim.AdamW``, no clipping;
- ``adamw+clip``: the same, ``clip_grad_norm_(model.parameters(), --max-norm)`` before each
  step (the norm of the averaged gradient);
- ``onebit``: ``fn.fsdp.OnebitAdam`` (``freeze_step`` at ``--freeze`` of the run), no clipping;
- ``onebit+clip``: the same with ``max_grad_norm=--max-norm`` (the averaged gradient's norm in
  the warmup, the root mean square of the ranks' norms once compressed).

Printed: the held-out MSE after the last update per run and seed, its mean over the seeds,
each clipped run's ratio to its unclipped one (below 1: the clip helps), and ``onebit+clip``
against ``adamw+clip``.

Run: python3 benchmarks/clipping.py [--seeds 0,1] [--steps 200] [--accumulate 2]
     [--spike-every 20] [--spike 100] [--max-norm 1.0] [--freeze 0.15] [--lr 3e-3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import freeze  # noqa: E402  (puts the repository on the path)
from cluster import int_list, parse_with_quick  # noqa: E402

import fn.fsdp  # noqa: E402
from fn.app.examples import positive_int  # noqa: E402
from fn.app.launch import spawn_gloo  # noqa: E402

MODES = ("adamw", "adamw+clip", "onebit", "onebit+clip")
WORLD_SIZE = 2


def train(rank: int, world_size: int, mode: str, seed: int, config: dict) -> float:
    """One run of ``mode``: the held-out MSE after the last update."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    task = freeze.MlpTask(rank, world_size, seed, heldout=512)
    model = task.model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    clip = mode.endswith("+clip")
    if mode.startswith("onebit"):
        optimizer = fn.fsdp.OnebitAdam(
            model,
            lr=config["lr"],
            freeze_step=max(2, int(config["freeze"] * config["steps"])),
            max_grad_norm=config["max_norm"] if clip else None,
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.0)
    batch = task.batches()
    k = config["accumulate"]
    for t in range(1, config["steps"] + 1):
        optimizer.zero_grad()
        for i in range(k):
            x, y = batch()
            if t % config["spike_every"] == 0 and rank == 1 and i == 0:
                x = x * config["spike"]
            (torch.nn.functional.mse_loss(model(x), y) / k).backward()
        if clip and mode.startswith("adamw"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), config["max_norm"])
        optimizer.step()
    with torch.no_grad():
        x, y = task.heldout
        loss = torch.nn.functional.mse_loss(model(x), y)
    return float(loss)


def worker(rank: int, world_size: int, send: Any, config: dict) -> dict:
    results = {}
    for seed in config["seeds"]:
        for mode in MODES:
            results[mode, seed] = train(rank, world_size, mode, seed, config)
            if rank == 0:
                send(f"{mode:12s} seed {seed}: held-out MSE {results[mode, seed]:.5f}")
            dist.barrier()
    return results


def table(results: dict, seeds: list[int]) -> list[str]:
    mean = {m: statistics.fmean(results[m, s] for s in seeds) for m in MODES}
    lines = ["| run | held-out MSE (mean over seeds) | against |", "|---|---|---|"]
    against = {
        "adamw": "",
        "adamw+clip": f"{mean['adamw+clip'] / mean['adamw']:.3f}x adamw",
        "onebit": f"{mean['onebit'] / mean['adamw']:.3f}x adamw",
        "onebit+clip": (
            f"{mean['onebit+clip'] / mean['onebit']:.3f}x onebit, "
            f"{mean['onebit+clip'] / mean['adamw+clip']:.3f}x adamw+clip"
        ),
    }
    lines += [f"| {m} | {mean[m]:.5f} | {against[m]} |" for m in MODES]
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int_list(0), default="0,1", help="comma-separated")
    parser.add_argument("--steps", type=positive_int, default=200)
    parser.add_argument("--accumulate", type=positive_int, default=2)
    parser.add_argument("--spike-every", type=positive_int, default=20)
    parser.add_argument("--spike", type=float, default=100.0)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--freeze", type=float, default=0.15, help="freeze_step / steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: --steps 12 --spike-every 5 unless given"
    )
    args = parse_with_quick(parser, argv, {"steps": 12, "spike_every": 5})
    seeds = args.seeds
    config = {
        "seeds": seeds,
        "steps": args.steps,
        "accumulate": args.accumulate,
        "spike_every": args.spike_every,
        "spike": args.spike,
        "max_norm": args.max_norm,
        "freeze": args.freeze,
        "lr": args.lr,
    }
    print(f"load average before the run: {os.getloadavg()[0]:.2f}")
    results = spawn_gloo(
        worker,
        WORLD_SIZE,
        (config,),
        timeout=3600,
        on_message=lambda rank, line: print(line, flush=True),
        threads=1,
    )[0]
    print("\n".join(table(results, seeds)))
    return results


if __name__ == "__main__":
    main()
