"""torchtitan's Trainer on HSDP across two nodes joined by a slow link: torchtitan + AdamW against
torchtitan + fn's 1-bit Adam (``--module fn.integrations.torchtitan``), tokens per second and
the loss after the last step.

Each run is torchtitan's own trainer (its ``ConfigManager``, ``Trainer``, data loader and LR
schedule) training ``llama3_debugmodel`` (6.2M params) on ``--nodes`` x ``--ranks-per-node``
gloo ranks, HSDP (``--parallelism.data_parallel_replicate_degree`` the nodes,
``data_parallel_shard_degree`` the ranks per node), from the same seed on the same data (the
tests' tokenizer and made-up text), in one mode:

- ``adamw``: ``--module llama3``, torchtitan's AdamW; FSDP2 all-reduces every step's gradient
  shards densely across the nodes;
- ``onebit``: ``--module fn.integrations.torchtitan`` with ``--optimizer.freeze_step``: the
  same settings, 1-bit Adam, whose only traffic across the nodes after the freeze is each
  shard's 1-bit momentum allreduce.

torchtitan targets CUDA; the ranks run on CPU through the tests' shim
(tests/integrations/_torchtitan_cpu.py, with its flags: fp32 matmuls, the ``partial_dtensor``
backend, AdamW's reductions summed). A run reports the median step time over the steps after
``--warmup`` (for ``onebit``, after the freeze too), the tokens per second it gives (the
global batch's tokens over that time), the loss of the last step and the mean of the last 10,
and for ``onebit`` the bytes fn sent across the nodes. The modes alternate, ``--runs`` times
each; the summary gives each mode's median over the runs, the speedup, and the load average
before and after.

With ``--rate`` (root, ``ip``, ``tc``) the ranks run on benchmarks/cluster.py's two-level
cluster: each node's ranks on an unlimited bridge, the nodes joined by one uplink at that rate.
Without it they talk over loopback (a smoke run: the times say nothing about links). All ranks
share this machine's CPUs.

Run:  sudo python3 benchmarks/torchtitan.py --rate 100mbit [--steps 200] [--runs 3]
      python3 benchmarks/torchtitan.py --rate 100mbit --dry-run   (the plan; needs nothing)
      python3 benchmarks/torchtitan.py --steps 4 --freeze-step 2 --runs 1   (loopback)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Python puts this script's folder first on the path, where "import torchtitan" finds this file
# (named as the package it measures): the package is meant
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
MODES = ("adamw", "onebit")
LAST = 10  # the loss reported beside the last step's: the mean of the last LAST steps


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cluster = _load("fn_bench_cluster", os.path.join("benchmarks", "cluster.py"))


def torchtitan_args(config: dict) -> list[str]:
    """The torchtitan command line of a run (without the CPU shim's flags)."""
    world = config["nodes"] * config["ranks_per_node"]
    args = ["--config", "llama3_debugmodel"]
    if config["mode"] == "adamw":
        args = ["--module", "llama3", *args, "--training.disable_cuda_graphs"]
    else:
        args = ["--module", "fn.integrations.torchtitan", *args]
        args += ["--optimizer.freeze_step", str(config["freeze_step"])]
    return args + [
        "--parallelism.data_parallel_replicate_degree",
        str(config["nodes"]),
        "--parallelism.data_parallel_shard_degree",
        str(config["ranks_per_node"]),
        "--hf_assets_path",
        os.path.join(config["assets"], "tokenizer"),
        "--dataloader.dataset_path",
        os.path.join(config["assets"], "data"),
        "--training.seq_len",
        str(config["seq_len"]),
        "--training.local_batch_size",
        str(config["batch"]),
        "--training.global_batch_size",
        str(config["batch"] * world),
        "--training.steps",
        str(config["steps"]),
        "--debug.seed",
        "0",
        "--metrics.log_freq",
        "1",
        "--checkpoint.no-enable",
    ]


def worker(config: dict) -> dict:
    """One rank's run (inside its namespace, its process group joined): the time and loss of
    every step, and fn's bytes across the nodes."""
    sys.path.insert(0, REPO)
    from tests.integrations._torchtitan_cpu import CPU_ARGS, install

    install()
    import logging

    import torch.distributed as dist
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    logger.setLevel(logging.WARNING)
    rank, per_node = dist.get_rank(), config["ranks_per_node"]
    os.environ.update(
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
    )
    args = [*torchtitan_args(config), *CPU_ARGS, "--dump_folder", config["dump"]]
    trainer = ConfigManager().parse_args(args).build()
    times, losses = [], []
    log = trainer.metrics_processor.log

    def logged(step: int, loss: float, *rest: Any, **kwargs: Any) -> None:
        times.append(time.perf_counter())
        losses.append(loss)
        log(step, loss, *rest, **kwargs)

    trainer.metrics_processor.log = logged
    try:
        trainer.train()
        across = None
        if config["mode"] == "onebit":
            across = trainer.optimizers.optimizer.bytes_sent_by_hop["inter"]
    finally:
        trainer.close()
    return {"times": times, "losses": losses, "inter_bytes": across}


def summarize(config: dict, rank0: dict) -> dict:
    """A run's figures: the median step time after the warmup (and the freeze), tokens per
    second, the losses."""
    first = config["warmup"] + 1  # the first timed step (steps count from 1)
    if config["mode"] == "onebit":
        first = max(first, config["freeze_step"] + 1)
    times = rank0["times"]
    steps = [b - a for a, b in zip(times, times[1:], strict=False)][first - 2 :]
    world = config["nodes"] * config["ranks_per_node"]
    tokens = world * config["batch"] * config["seq_len"]
    step = statistics.median(steps)
    losses = rank0["losses"]
    return {
        "mode": config["mode"],
        "step_s": step,
        "tokens_per_s": tokens / step,
        "timed_steps": len(steps),
        "loss": losses[-1],
        "loss_last": statistics.fmean(losses[-LAST:]),
        "inter_bytes": rank0["inter_bytes"],
    }


def print_summary(runs: list[dict], load: tuple[float, float]) -> None:
    print(
        f"\n{'run':>3}  {'mode':<6}  {'step s':>7}  {'tokens/s':>9}  {'loss':>7}  "
        f"{'last ' + str(LAST):>7}  {'fn bytes across':>15}"
    )
    for i, run in enumerate(runs):
        across = "" if run["inter_bytes"] is None else f"{run['inter_bytes']:,}"
        print(
            f"{i // len(MODES) + 1:>3}  {run['mode']:<6}  {run['step_s']:>7.3f}  "
            f"{run['tokens_per_s']:>9.1f}  {run['loss']:>7.4f}  {run['loss_last']:>7.4f}  "
            f"{across:>15}"
        )
    medians = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if mine:
            medians[mode] = {
                k: statistics.median(r[k] for r in mine)
                for k in ("tokens_per_s", "loss", "loss_last")
            }
            m = medians[mode]
            print(
                f"median {mode}: {m['tokens_per_s']:.1f} tokens/s, loss {m['loss']:.4f} "
                f"(last {LAST}: {m['loss_last']:.4f}) over {len(mine)} run(s)"
            )
    if len(medians) == 2:
        speedup = medians["onebit"]["tokens_per_s"] / medians["adamw"]["tokens_per_s"]
        print(f"1-bit Adam / AdamW tokens per second: {speedup:.2f}x")
    print(f"load average (1 min) before {load[0]:.2f}, after {load[1]:.2f}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--freeze-step", type=int, default=20, help="1-bit Adam's first compressed")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="--training.local_batch_size")
    p.add_argument("--runs", type=int, default=3, help="runs of each mode, alternating")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--documents", type=int, default=4000, help="documents of made-up text")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--json", default=None, help="also write every run's figures here")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    cluster.add_link_arguments(p, prefix="fntitan", subnet="10.215.0")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.nodes < 2 or args.ranks_per_node < 1:
        p.error("--nodes must be at least 2 and --ranks-per-node at least 1")
    if not 2 <= args.freeze_step < args.steps:
        p.error("--freeze-step must be within 2..--steps - 1")
    if not 0 <= args.warmup < args.steps - 1 or args.runs < 1:
        p.error("--warmup must be within 0..--steps - 2, --runs at least 1")
    cluster.check_link_arguments(p, args)
    return args


def configs(args: argparse.Namespace, assets: str, dump: str) -> list[dict]:
    """The runs, modes alternating."""
    base = {
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "world_size": args.nodes * args.ranks_per_node,
        "steps": args.steps,
        "freeze_step": args.freeze_step,
        "warmup": args.warmup,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "assets": assets,
        "dump": dump,
        "rate": args.rate or "loopback",
        "timeout": args.timeout,
    }
    return [{**base, "mode": mode} for _ in range(args.runs) for mode in args.modes]


def _loopback_rank(rank: int, world_size: int, send: Any, config: dict) -> dict:
    del rank, world_size, send
    return worker(config)


def _loopback(config: dict) -> dict:
    """Rank 0's result of a run on loopback gloo (no namespaces)."""
    from fn.app.launch import spawn_gloo

    results = spawn_gloo(
        _loopback_rank,
        config["world_size"],
        (config,),
        timeout=config["timeout"],
        on_message=lambda rank, message: None,
    )
    return results[0]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        config = json.loads(args.worker)
        cluster.serve_rank(config, lambda: worker(config), threads=1)
        return
    world = args.nodes * args.ranks_per_node
    if args.dry_run:
        print(
            f"{args.runs} run(s) of {', '.join(args.modes)}, alternating, on {args.nodes} "
            f"nodes x {args.ranks_per_node} ranks, {args.steps} steps each; per run:"
        )
        for mode in args.modes:
            print(
                "  torchtitan",
                " ".join(torchtitan_args({**vars(args), "mode": mode, "assets": "ASSETS"})),
            )
        if args.rate is not None:
            for cmd in cluster.setup_commands(args.prefix, world, args.subnet, args.ranks_per_node):
                print(" ".join(cmd))
            for cmd in cluster.shaping_commands(args.prefix, world, args.rate, args.ranks_per_node):
                print(" ".join(cmd))
        return
    if args.rate is not None:
        cluster.check_host(
            "benchmarks/torchtitan.py --rate", hint="; run without --rate on loopback"
        )
    sys.path.insert(0, REPO)
    from tests.integrations._torchtitan_cpu import write_assets

    before = os.getloadavg()[0]
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} CPUs, load average {before:.2f}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="fn-torchtitan-") as work:
        assets = os.path.join(work, "assets")
        write_assets(Path(assets), documents=args.documents)
        runs = []
        for config in configs(args, assets, os.path.join(work, "dump")):
            started = time.monotonic()
            if args.rate is None:
                rank0 = _loopback(config)
            else:
                (rank0,) = cluster.run_on_links(
                    args.prefix, args.subnet, [config], args.timeout, __file__
                )
            runs.append(summarize(config, rank0))
            print(
                f"{config['mode']}: {runs[-1]['tokens_per_s']:.1f} tokens/s, loss "
                f"{runs[-1]['loss']:.4f} ({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    load = (before, os.getloadavg()[0])
    print_summary(runs, load)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load": load, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
