"""FSDP2 with dense, LoCo 4-bit and qgZ (4-bit, no feedback) gradient reduce-scatters.

W gloo ranks on this machine train the transformer of ``examples/fsdp_loco.py`` (same random
weights, same synthetic token streams, AdamW) for ``--steps`` steps in each mode:

- ``dense``: FSDP2's own reduce-scatter;
- ``loco``: ``fn.fsdp.loco_reduce_scatter(bits=4, err_beta=0.8)``;
- ``qgz``: the same with ``err_beta=None`` (ZeRO++ qgZ, no error feedback);
- ``loco+qwz``: LoCo, and the parameter all-gathers in 8 bits too (``quantized_all_gather``).

Bytes are counted independently of fn, at torch's process-group interface: every collective of
``torch.distributed.ProcessGroup`` (FSDP2's, fn's, anyone's) is wrapped in each rank and counted
by what it hands to the backend, with the per-rank volume of a ring / pairwise algorithm:
all-reduce ``2 (W-1)/W`` of the tensor, all-gather ``(W-1)/W`` of the output, reduce-scatter and
all-to-all ``(W-1)/W`` of the input. gloo runs a reduce-scatter as an all-reduce, so its real
traffic for dense FSDP2's gradients is twice the ideal figure: both are printed. The counts cover
the training steps only (not the held-out evaluation). Then the held-out loss of every mode
(LoCo should be within about 1% of dense) and the median step time (the first ``--warmup`` steps
left out), with dense's step time over each mode's.

Then 1-bit Adam (``--onebit adam``) or 1-bit LAMB (``--onebit lamb``), with the same model,
data and steps (``freeze_step`` ``--freeze-step``):

- ``onebit``: FSDP2 + ``fn.fsdp.OnebitAdam`` (or ``OnebitLamb``: 1-bit momentum inside each
  module's reduce-scatter);
- ``onebit+qwz``: the same, with FSDP2's parameter all-gathers in 8-bit groups
  (``fn.fsdp.quantized_all_gather``, ZeRO++ qwZ: forward and backward on the dequantized
  weights, the shards and their updates exact);
- ``ddp+onebit``: the unsharded model in ``DistributedDataParallel`` + ``fn.optim.OnebitAdam``
  (or ``OnebitLamb``; ``fn.ddp.register``), the same rule on replicated params.

Their bytes are counted per compressed step after the freeze (the freeze's one all-gather of the
momentum left out). FSDP2's parameter all-gathers are the same as dense's (same model), so the
1-bit gradient traffic of ``onebit`` is its total less dense's all-gathers; its ratio to dense
FSDP2 + AdamW's reduce-scatter (target <= 0.1) is printed, and its held-out loss against
``ddp+onebit``'s (target within 1%).

Without ``--rate`` the ranks talk over this machine's loopback, so the step times mean little.
``--rate 1gbit`` (root, ``ip`` and ``tc``) runs each rank in its own network namespace, linked
through a bridge at that rate in both directions, as ``benchmarks/cluster.py`` builds them (its
functions, its cleanup: the namespaces go also on errors, timeouts and Ctrl-C; ``sudo python3
benchmarks/cluster.py --cleanup --prefix fnfsdp`` removes what a killed run left). All ranks share
this machine's CPUs, so compute-bound steps are pessimistic. ``--dry-run`` prints the plan.

HSDP (``--nodes N --ranks-per-node L``, ``N L`` ranks): 1-bit Adam or LAMB across nodes
(``fn.fsdp.OnebitAdam(..., replicate=mesh["replicate"])``) against native HSDP + AdamW and 1-D
FSDP2 + 1-bit with 8-bit all-gathers, with ``--rate`` on cluster.py's two-level cluster (each
node's ranks on a fast bridge, the nodes joined by one uplink at the rate), its bytes across
nodes read from the uplinks; its modes, rows and targets are in benchmarks/hsdp.py.
``--error-dtype bf16`` stores the 1-bit errors in bf16 (every 1-bit mode). ``--accumulate K``
(HSDP) makes each update K micro-batches of ``--batch`` sequences, each its own forward and
backward; ``--modes`` picks HSDP's modes (benchmarks/hsdp.py lists them).

Run:  python3 benchmarks/fsdp.py [--ranks 2] [--steps 200] [--onebit adam|lamb] [--json out.json]
      python3 benchmarks/fsdp.py --steps 3 --layers 1 --d-model 32   (a smoke run)
      sudo python3 benchmarks/fsdp.py --rate 1gbit --ranks 4 --d-model 512 --layers 4 \\
          --batch 2 --context 16 --steps 30 --warmup 3   (1 Gbit/s links, 12.6M params: few
          tokens per step, so that the gradients' and parameters' traffic dominates the step)
      python3 benchmarks/fsdp.py --nodes 2 --ranks-per-node 2 [--onebit lamb] [--error-dtype bf16]
      python3 benchmarks/fsdp.py --nodes 2 --ranks-per-node 2 --steps 3 --layers 1 --d-model 32
      sudo python3 benchmarks/fsdp.py --nodes 2 --ranks-per-node 2 --rate 100mbit \\
          --d-model 512 --layers 4 --batch 2 --context 16 --steps 30 --warmup 3   (HSDP)
      python3 benchmarks/fsdp.py --nodes 2 --ranks-per-node 2 --rate 100mbit --dry-run
      python3 benchmarks/fsdp.py --nodes 2 --ranks-per-node 2 --accumulate 4 --steps 200 \\
          --modes hsdp+onebit hsdp+onebit+whole   (accumulation: benchmarks/hsdp.py)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import fn.ddp  # noqa: E402
import fn.fsdp  # noqa: E402
import fn.optim  # noqa: E402
from fn.app import examples  # noqa: E402  (examples/fsdp_loco.py's model, data and loss)
from fn.app.launch import spawn_gloo  # noqa: E402

MODES = ("dense", "loco", "qgz", "loco+qwz")
ONEBIT_MODES = ("onebit", "onebit+qwz", "ddp+onebit")
ONEBIT_OPTIMIZERS = {"adam": "OnebitAdam", "lamb": "OnebitLamb"}  # by --onebit
ERROR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # by --error-dtype


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cluster = _load("fn_bench_cluster", os.path.join("benchmarks", "cluster.py"))


class ByteCounter:
    """Wraps ``torch.distributed.ProcessGroup``'s collectives to count each one's bytes.

    ``counts[kind]`` is this rank's ideal per-rank volume; ``gloo_counts`` counts a
    reduce-scatter as the all-reduce gloo runs for it; with ``kind`` (``group -> str``),
    ``by_kind`` sums the ideal volume by ``kind(group)`` (benchmarks/hsdp.py).
    """

    def __init__(self, kind=None) -> None:
        self.counts: dict[str, float] = defaultdict(float)
        self.gloo_counts: dict[str, float] = defaultdict(float)
        self.by_kind: dict[str, float] = defaultdict(float)  # ideal volume by kind(group)
        self.active = False
        group_kind = kind
        pg = dist.ProcessGroup

        def wrap(name: str, kind: str, tensor_of, fraction):
            original = getattr(pg, name)

            def counted(group, *args, **kwargs):
                if self.active:
                    w = group.size()
                    nbytes = _nbytes(tensor_of(args))
                    self.counts[kind] += fraction(w) * nbytes
                    gloo = 2 * (w - 1) / w if kind == "reduce_scatter" else fraction(w)
                    self.gloo_counts[kind] += gloo * nbytes
                    if group_kind is not None:
                        self.by_kind[group_kind(group)] += fraction(w) * nbytes
                return original(group, *args, **kwargs)

            setattr(pg, name, counted)

        def ring(w):
            return (w - 1) / w

        wrap("allreduce", "all_reduce", lambda a: a[0], lambda w: 2 * (w - 1) / w)
        wrap("all_gather_single", "all_gather", lambda a: a[0], ring)  # (output, input, ...)
        wrap("reduce_scatter_single", "reduce_scatter", lambda a: a[1], ring)
        wrap("all_to_all_single", "all_to_all", lambda a: a[1], ring)

    def reset(self) -> None:
        self.counts.clear()
        self.gloo_counts.clear()
        self.by_kind.clear()


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


def _worker(rank: int, world_size: int, send, config: dict) -> dict:
    del send
    example = _load("fsdp_loco_example", os.path.join("examples", "fsdp_loco.py"))
    args = example.parse_args(config["example_args"])
    counter = ByteCounter()
    table = examples.bigram_table(args.vocab)
    results = {}
    steps, warmup = config["steps"], config["warmup"]
    every = max(1, steps // 4)
    for mode in MODES:
        args.mode, args.qwz = mode.split("+")[0], mode.endswith("+qwz")
        model, handle = example.build(args, world_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        counter.reset()
        times = []
        for step in range(steps):
            batch = examples.train_batch(table, args, step, rank)
            times.append(_timed_step(model, optimizer, batch, counter))
            if rank == 0 and (step + 1) % every == 0 and step + 1 < steps:
                print(f"{mode}: step {step + 1}/{steps}, {times[-1]:.3f} s", flush=True)
        results[mode] = {
            "bytes_per_step": {k: v / steps for k, v in counter.counts.items()},
            "gloo_bytes_per_step": {k: v / steps for k, v in counter.gloo_counts.items()},
            "fn_bytes_per_step": handle.bytes_sent / steps if handle else None,
            "held_out_loss": examples.held_out_loss(model, table, args),
            "step_s": statistics.median(times[warmup:]),
            "params": sum(p.numel() for p in model.parameters()),
        }
        if rank == 0:
            r = results[mode]
            print(
                f"{mode}: median step {r['step_s']:.3f} s, held-out loss {r['held_out_loss']:.4f}",
                flush=True,
            )
    for mode in ONEBIT_MODES:
        results[mode] = _train_onebit(mode, args, table, counter, rank, world_size, config)
    return results


def _timed_step(
    model,
    optimizer,
    batch,
    counter: ByteCounter,
    accumulate: int = 1,
    all_reduce_once: bool = False,
    before_step=None,
) -> float:
    """One update after a barrier, its collectives counted; its seconds.

    ``batch`` is split into ``accumulate`` micro-batches, each its own forward and backward
    (the loss divided by ``accumulate``), then one ``optimizer.step()``. ``all_reduce_once``:
    native HSDP's ``set_requires_all_reduce`` off on all but the last micro-batch (the
    all-reduce across nodes once per update). ``before_step()`` runs after the last backward,
    untimed and uncounted."""
    dist.barrier()
    start = time.perf_counter()
    counter.active = True
    optimizer.zero_grad()
    micro = batch.chunk(accumulate) if accumulate > 1 else (batch,)
    for j, part in enumerate(micro):
        if all_reduce_once:
            model.set_requires_all_reduce(j == len(micro) - 1)
        loss = examples.lm_loss(model, part)
        (loss / accumulate if accumulate > 1 else loss).backward()
    paused = 0.0
    if before_step is not None:
        counter.active = False
        mark = time.perf_counter()
        before_step()
        paused = time.perf_counter() - mark
        counter.active = True
    optimizer.step()
    counter.active = False
    return time.perf_counter() - start - paused


def _train_onebit(mode, args, table, counter, rank, world_size, config) -> dict:
    """Trains with 1-bit Adam or LAMB (``onebit``: FSDP2; ``ddp+onebit``: DDP), counting the
    bytes of the compressed steps after the freeze."""
    steps, warmup, freeze = config["steps"], config["warmup"], config["freeze_step"]
    hyper = dict(lr=args.lr, freeze_step=freeze, weight_decay=0.01)
    hyper["error_dtype"] = ERROR_DTYPES[config.get("error_dtype", "fp32")]
    name = ONEBIT_OPTIMIZERS[config["onebit"]]
    if mode.startswith("onebit"):
        model = examples.sharded_transformer(args, init_device_mesh("cpu", (world_size,)))
        optimizer = getattr(fn.fsdp, name)(model, **hyper)
        if mode.endswith("+qwz"):
            fn.fsdp.quantized_all_gather(model, bits=8, group_size=args.group_size)
    else:
        torch.manual_seed(args.seed)
        model = DistributedDataParallel(
            examples.Transformer(args.vocab, args.d_model, args.heads, args.layers, args.context)
        )
        optimizer = getattr(fn.optim, name)(model.parameters(), **hyper)
        fn.ddp.register(model, optimizer)
    counter.reset()
    times, fn_before = [], 0
    for step in range(steps):
        if step + 1 == freeze + 1:  # from here on: compressed steps after the freeze
            counter.reset()
            fn_before = getattr(optimizer, "bytes_sent", 0)
        batch = examples.train_batch(table, args, step, rank)
        times.append(_timed_step(model, optimizer, batch, counter))
    compressed = max(1, steps - freeze)
    fn_sent = getattr(optimizer, "bytes_sent", None)
    result = {
        "bytes_per_step": {k: v / compressed for k, v in counter.counts.items()},
        "gloo_bytes_per_step": {k: v / compressed for k, v in counter.gloo_counts.items()},
        "fn_bytes_per_step": None if fn_sent is None else (fn_sent - fn_before) / compressed,
        "held_out_loss": examples.held_out_loss(model, table, args),
        "step_s": statistics.median(times[max(warmup, freeze) :] or times),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if rank == 0:
        print(
            f"{mode}: median step {result['step_s']:.3f} s, "
            f"held-out loss {result['held_out_loss']:.4f}",
            flush=True,
        )
    return result


GRADIENT_KINDS = ("reduce_scatter", "all_to_all")


def print_results(rank0: dict, config: dict) -> None:
    dense = rank0["dense"]
    links = f"links at {config['rate']}" if config["rate"] else "local gloo"
    print(
        f"FSDP2, {config['ranks']} gloo ranks, {links}, {dense['params']} parameters, "
        f"{config['steps']} steps (step time: median of the last "
        f"{config['steps'] - config['warmup']}), "
        f"{datetime.date.today()}"
    )
    print("bytes per rank per step (counted at the ProcessGroup interface, rank 0):")
    header = f"{'mode':<8} {'gradients':>12} {'(gloo)':>12} {'params':>12} {'total':>12}"
    print(
        header + f" {'grad ratio':>10} {'held-out loss':>14} {'vs dense':>9} {'step s':>8} "
        f"{'dense/this':>10}"
    )
    dense_grad = sum(dense["bytes_per_step"].get(k, 0) for k in GRADIENT_KINDS)
    for mode in MODES:
        r = rank0[mode]
        grad = sum(r["bytes_per_step"].get(k, 0) for k in GRADIENT_KINDS)
        gloo = sum(r["gloo_bytes_per_step"].get(k, 0) for k in GRADIENT_KINDS)
        gather = r["bytes_per_step"].get("all_gather", 0)
        total = sum(r["bytes_per_step"].values())
        loss_vs = r["held_out_loss"] / dense["held_out_loss"] - 1
        print(
            f"{mode:<8} {grad:>12.0f} {gloo:>12.0f} {gather:>12.0f} {total:>12.0f} "
            f"{grad / dense_grad:>10.3f} {r['held_out_loss']:>14.4f} {loss_vs:>+9.2%} "
            f"{r['step_s']:>8.3f} {dense['step_s'] / r['step_s']:>10.2f}"
        )
    fn_counts = ", ".join(f"{m} {rank0[m]['fn_bytes_per_step']:.0f}" for m in MODES[1:])
    print(f"fn's own count of its reduce-scatter bytes (rank 0): {fn_counts}")
    print("gradients: reduce-scatter + all-to-all; (gloo): a reduce-scatter sent as gloo's")
    print("all-reduce; params: FSDP2's all-gathers; dense/this: dense's step time over this mode's")
    if config["rate"]:
        print(f"(same run). Step times: every rank's link at {config['rate']} both ways")
        print("(unlimited: no tc limit), all ranks on this machine's CPUs (compute-bound steps")
        print("are pessimistic).")
    else:
        print("(same run). Step times are meaningful only on a quiet machine and say nothing")
        print("about slow links (see --rate).")
    print_onebit(rank0, config)


def print_onebit(rank0: dict, config: dict) -> None:
    """The 1-bit rows: bytes per compressed step and held-out loss (module docstring)."""
    name = ONEBIT_OPTIMIZERS[config["onebit"]]
    family = {"adam": "1-bit Adam", "lamb": "1-bit LAMB"}[config["onebit"]]
    dense, onebit, ddp = rank0["dense"], rank0["onebit"], rank0["ddp+onebit"]
    dense_grad = dense["bytes_per_step"].get("reduce_scatter", 0)
    dense_gather = dense["bytes_per_step"].get("all_gather", 0)
    onebit_total = sum(onebit["bytes_per_step"].values())
    onebit_grad = onebit_total - dense_gather
    ratio = onebit_grad / dense_grad
    gloo_ratio = onebit_grad / dense["gloo_bytes_per_step"].get("reduce_scatter", 0)
    loss_vs = onebit["held_out_loss"] / ddp["held_out_loss"] - 1
    print(
        f"\n{family}, freeze_step {config['freeze_step']}: bytes per rank per compressed step "
        f"after the freeze ({config['steps'] - config['freeze_step']} steps), rank 0"
    )
    print(f"{'mode':<22} {'gradients':>12} {'params':>12} {'total':>12} {'fn count':>12}")
    dense_row = f"{'FSDP2 + AdamW (dense)':<22} {dense_grad:>12.0f} {dense_gather:>12.0f}"
    print(dense_row + f" {sum(dense['bytes_per_step'].values()):>12.0f} {'-':>12}")
    print(
        f"{'FSDP2 + fn ' + name:<22} {onebit_grad:>12.0f} {dense_gather:>12.0f} "
        f"{onebit_total:>12.0f} {onebit['fn_bytes_per_step']:>12.0f}"
    )
    qwz = rank0["onebit+qwz"]
    qwz_total = sum(qwz["bytes_per_step"].values())
    print(  # the same optimizer: its gradient bytes are the row above's
        f"{'  + 8-bit all-gathers':<22} {onebit_grad:>12.0f} {qwz_total - onebit_grad:>12.0f} "
        f"{qwz_total:>12.0f} {qwz['fn_bytes_per_step']:>12.0f}"
    )
    ddp_total = sum(ddp["bytes_per_step"].values())
    print(f"{'DDP + fn.optim (1-bit)':<22} {ddp_total:>12.0f} {0:>12} {ddp_total:>12.0f} {'-':>12}")
    print(
        f"gradient bytes, FSDP2 + fn {name} / FSDP2 + AdamW reduce-scatter: {ratio:.4f} "
        f"(1/{1 / ratio:.1f}; target <= 0.1: {'met' if ratio <= 0.1 else 'NOT met'}; against "
        f"gloo's real reduce-scatter traffic {gloo_ratio:.4f})"
    )
    print(
        f"held-out loss after {config['steps']} steps: FSDP2 + fn {name} "
        f"{onebit['held_out_loss']:.4f}, DDP + fn.optim.{name} {ddp['held_out_loss']:.4f}, "
        f"FSDP2 + AdamW {dense['held_out_loss']:.4f}; FSDP2/DDP {loss_vs:+.2%} "
        f"(target within 1%: {'met' if abs(loss_vs) <= 0.01 else 'NOT met'}); with 8-bit "
        f"all-gathers {qwz['held_out_loss']:.4f}"
    )
    print(
        f"median compressed step: FSDP2 + fn {name} {onebit['step_s']:.3f} s "
        f"({dense['step_s'] / onebit['step_s']:.2f}x FSDP2 + AdamW), with 8-bit all-gathers "
        f"{qwz['step_s']:.3f} s ({dense['step_s'] / qwz['step_s']:.2f}x), DDP + "
        f"fn.optim.{name} {ddp['step_s']:.3f} s, FSDP2 + AdamW {dense['step_s']:.3f} s"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="default 2 (not with --nodes)")
    p.add_argument("--nodes", type=int, help="HSDP: N nodes (>= 2) of --ranks-per-node ranks")
    p.add_argument("--ranks-per-node", type=int, help="HSDP: L ranks per node (>= 2)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the step time")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=32, help="tokens per sequence")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="the model's initialization")
    p.add_argument(
        "--freeze-step", type=int, default=None, help="1-bit Adam's (default: steps // 4, >= 2)"
    )
    p.add_argument(
        "--onebit", choices=list(ONEBIT_OPTIMIZERS), default="adam", help="the 1-bit rows' family"
    )
    p.add_argument(
        "--error-dtype", choices=list(ERROR_DTYPES), default="fp32", help="the 1-bit errors'"
    )
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="HSDP: micro-batches per update (each --batch sequences, its own backward)",
    )
    p.add_argument(
        "--accumulate-dtype",
        choices=list(ERROR_DTYPES),
        default="fp32",
        help="HSDP: the 1-D 1-bit modes' local gradient accumulator (accumulate_dtype=)",
    )
    p.add_argument(
        "--modes", nargs="+", default=None, help="HSDP: the modes to run (benchmarks/hsdp.py)"
    )
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default=None, help="also write rank 0's results here")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    cluster.add_link_arguments(p, prefix="fnfsdp", subnet="10.214.0")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _check_layout(p, args)
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be within 0..--steps - 1")
    if args.freeze_step is None:
        args.freeze_step = max(2, args.steps // 4)
    if not 2 <= args.freeze_step < args.steps:
        p.error("--freeze-step must be within 2..--steps - 1 (a compressed step after it)")
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    cluster.check_link_arguments(p, args)
    return args


def _check_layout(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--ranks``, or HSDP's ``--nodes`` and ``--ranks-per-node`` (then ``args.ranks`` is
    their product)."""
    if (args.nodes is None) != (args.ranks_per_node is None):
        p.error("--nodes and --ranks-per-node go together")
    if args.nodes is None:
        args.ranks = 2 if args.ranks is None else args.ranks
        if args.ranks < 2:
            p.error("--ranks must be at least 2")
        if args.accumulate != 1 or args.accumulate_dtype != "fp32" or args.modes is not None:
            p.error("--accumulate, --accumulate-dtype and --modes go with --nodes (HSDP's modes)")
        return
    if args.accumulate < 1:
        p.error("--accumulate must be at least 1")
    hsdp = _hsdp()
    args.modes = list(hsdp.MODES) if args.modes is None else args.modes
    unknown = sorted(set(args.modes) - set(hsdp.ALL_MODES))
    if unknown or len(set(args.modes)) != len(args.modes):
        p.error(f"--modes: each of {', '.join(hsdp.ALL_MODES)} at most once, got {args.modes}")
    if args.ranks is not None:
        p.error("--ranks: leave it out with --nodes (ranks = nodes x ranks per node)")
    if args.nodes < 2 or args.ranks_per_node < 2:
        p.error(
            "--nodes and --ranks-per-node must be >= 2 (one rank per node is DDP: fn.fsdp "
            "refuses it; one node is plain FSDP2: run without --nodes)"
        )
    args.ranks = args.nodes * args.ranks_per_node
    if args.ranks > 16:
        p.error("--nodes x --ranks-per-node must be at most 16")


def _config(args: argparse.Namespace) -> dict:
    config = {
        "ranks": args.ranks,
        "steps": args.steps,
        "warmup": args.warmup,
        "freeze_step": args.freeze_step,
        "onebit": args.onebit,
        "error_dtype": args.error_dtype,
        "rate": args.rate,
        "timeout": args.timeout,
        "example_args": [
            "--layers", str(args.layers), "--d-model", str(args.d_model),
            "--group-size", str(args.group_size), "--bits", "4", "--err-beta", "0.8",
            "--batch", str(args.batch), "--context", str(args.context),
            "--seed", str(args.seed),
        ],
    }  # fmt: skip
    if args.nodes is not None:
        config |= {
            "nodes": args.nodes,
            "ranks_per_node": args.ranks_per_node,
            "batch": args.batch,
            "accumulate": args.accumulate,
            "accumulate_dtype": args.accumulate_dtype,
            "modes": args.modes,
        }
    return config


def _hsdp():
    """benchmarks/hsdp.py, the HSDP part (``--nodes``), loaded on first use."""
    return _load("fn_bench_hsdp", os.path.join("benchmarks", "hsdp.py"))


def _hsdp_worker(rank: int, world_size: int, send, config: dict) -> dict:
    del send
    return _hsdp().worker(rank, world_size, config)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        config = json.loads(args.worker)
        rank, world_size = config["rank"], config["world_size"]
        work = _hsdp_worker if config.get("nodes") else _worker
        cluster.serve_rank(config, lambda: work(rank, world_size, None, config), threads=1)
        return
    config = _config(args)
    if args.nodes is not None:
        _main_hsdp(args, config)
        return
    if args.dry_run:
        _hsdp().print_plan(config, args, MODES + ONEBIT_MODES)
        return
    if args.rate is None:
        results = spawn_gloo(
            _worker, args.ranks, (config,), timeout=args.timeout, on_message=lambda r, m: None
        )
        rank0 = results[0]
    else:
        cluster.check_host("benchmarks/fsdp.py --rate", hint="; run without --rate for local gloo")
        links = _hsdp().links_config(config, args)
        (rank0,) = cluster.run_on_links(
            args.prefix, args.subnet, [links], args.timeout, __file__, echo=True
        )
    print_results(rank0, config)
    _write_json(args, config, rank0)


def _main_hsdp(args: argparse.Namespace, config: dict) -> None:
    hsdp = _hsdp()
    if args.dry_run:
        hsdp.print_plan(config, args, tuple(config["modes"]))
        return
    load = os.getloadavg()[0]
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} CPUs, load average {load:.2f}",
        flush=True,
    )
    rank0 = hsdp.run(config, args, _hsdp_worker)
    hsdp.print_results(rank0, config)
    hsdp.print_summary(rank0, config, load)
    _write_json(args, {**config, "load": load}, rank0)


def _write_json(args: argparse.Namespace, config: dict, rank0: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, "rank0": rank0}, f, indent=1)


if __name__ == "__main__":
    main()
