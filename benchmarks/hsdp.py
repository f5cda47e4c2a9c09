"""HSDP with 1-bit Adam or 1-bit LAMB across nodes: benchmarks/fsdp.py's HSDP part.

``python3 benchmarks/fsdp.py --nodes N --ranks-per-node L`` (or ``python3 benchmarks/hsdp.py``,
the same with ``--nodes 2 --ranks-per-node 2`` unless given) trains the transformer of
``examples/fsdp_loco.py`` on ``N L`` gloo ranks, rank ``k L + l`` being rank ``l`` of node ``k``
(torchrun's layout), the same model, data (each rank its global rank's stream) and steps in each
mode:

- ``hsdp+adamw``: native HSDP, every module ``fully_shard`` on the 2-D mesh ``(N, L)`` (FSDP2's
  dense all-reduce of the gradient shards across nodes) + ``torch.optim.AdamW`` (the baseline);
- ``hsdp+onebit``: every module ``fully_shard`` on ``mesh["shard"]`` +
  ``fn.fsdp.OnebitAdam(model, ..., replicate=mesh["replicate"])`` (``--onebit lamb``:
  ``OnebitLamb``): the only traffic across nodes is each shard's 1-bit momentum allreduce;
- ``fsdp1d+onebit``: 1-D FSDP2 over all ``N L`` ranks + ``fn.fsdp.OnebitAdam``, fsdp.py's
  ``onebit`` (the held-out loss's reference);
- ``fsdp1d+onebit+qwz``: the same with 8-bit parameter all-gathers
  (``fn.fsdp.quantized_all_gather``), fsdp.py's ``onebit+qwz``;
- ``fsdp1d+adamw`` (only with ``--modes``): 1-D FSDP2 over all ``N L`` ranks + AdamW, the 1-D
  memory baseline;
- ``hsdp+onebit+whole`` (only with ``--modes``): ``hsdp+onebit`` with each update's
  ``--accumulate`` micro-batches taken as one batch, one backward (the accumulation's loss
  reference).

Gradient accumulation (``--accumulate K``): each update draws ``K --batch`` sequences per rank
and runs them as K micro-batches, each its own forward and backward with the loss divided by K,
then one ``step()``. Every micro-batch reduce-scatters (as trainers do). fn's modes take no flag
(``--accumulate-dtype bf16``: the 1-D modes' ``accumulate_dtype=torch.bfloat16``);
``hsdp+adamw`` follows FSDP2's own practice, ``set_requires_all_reduce(False)`` on all but the
last micro-batch, so it all-reduces across nodes once per update too.

Per mode, over the compressed steps (after ``--freeze-step``; the same steps for AdamW):

- bytes per rank and step across nodes: on the two-level cluster (``--rate``) read from the
  nodes' uplinks (``cluster.uplink_tx_bytes``: the wire, TCP/IP headers included, less the
  barriers' own traffic); everywhere counted at torch's ProcessGroup interface
  (fsdp.py's ``ByteCounter``) by the kind of group: ``intra`` (one node's ranks), ``inter``
  (one rank per node: the replicate group) and ``world`` (ranks of several nodes, more than one
  per node), and fn's own count of its communicators by the same kinds. The counted figure
  across nodes is ``inter`` plus ``(W - L) / (W - 1)`` of ``world`` (the share of a rank's
  peers on other nodes: an estimate);
- the median step time and ``hsdp+adamw``'s over it, beside the bound: ``hsdp+adamw``'s step
  over forward + backward alone (an unsharded copy, no communication, timed alongside), the most
  any method's ratio can be in that run (all ranks share this machine's CPUs);
- the held-out loss (``hsdp+onebit`` against ``fsdp1d+onebit``);
- params + grads + optimizer state + gradient accumulator per rank, measured right before the
  last update's ``step()``, after its backwards (this rank's local tensors' storages: FSDP2's
  shards, their grads, AdamW's state or fn's: its moments, packed momentum and errors; the
  accumulator: fn's ``OnebitModule.local_gradient`` on a 1-D mesh in the compressed phase,
  FSDP2's partial reduce output under ``set_requires_all_reduce(False)``), beside
  docs/algorithms.md's formula (``--error-dtype fp32|bf16``), and ``hsdp+onebit``'s over
  ``hsdp+adamw``'s (the target: 1.15 with fp32 errors, 1.0 with bf16 ones).

A summary gives the targets of issues #45 and #52 with "met", "NOT met" or "not measured"
(a mode not run, or not at 100 Mbit/s) and the load average before the run. Without
``--rate`` the ranks talk over loopback (bytes counted at the interface only; step times say
nothing about links). ``--rate 100mbit`` (root, ``ip``, ``tc``)
builds cluster.py's two-level cluster: each node's ranks on an unlimited bridge, the nodes
joined by one uplink at that rate; ``--dry-run`` prints that plan.

Run:  python3 benchmarks/fsdp.py --nodes 2 --ranks-per-node 2 [--onebit lamb] [--error-dtype bf16]
      python3 benchmarks/fsdp.py --nodes 2 --ranks-per-node 2 --steps 3 --layers 1 --d-model 32
      python3 benchmarks/fsdp.py --nodes 2 --ranks-per-node 2 --rate 100mbit --dry-run
      sudo python3 benchmarks/fsdp.py --nodes 2 --ranks-per-node 2 --rate 100mbit \\
          --d-model 512 --layers 4 --batch 2 --context 16 --steps 30 --warmup 3
      python3 benchmarks/hsdp.py [fsdp.py's flags]   (--nodes 2 --ranks-per-node 2 by default)
      python3 benchmarks/hsdp.py --accumulate 4 --steps 20 --modes hsdp+adamw hsdp+onebit \
          fsdp1d+adamw fsdp1d+onebit [--accumulate-dtype bf16]   (memory with accumulation)
      sudo python3 benchmarks/hsdp.py --accumulate 4 --rate 100mbit --d-model 512 --layers 4 \
          --batch 2 --context 16 --steps 20 --warmup 3 --modes hsdp+adamw hsdp+onebit
      python3 benchmarks/hsdp.py --accumulate 4 --steps 200 --seed S \
          --modes hsdp+onebit hsdp+onebit+whole   (the held-out loss against one batch)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import time
import warnings
from collections import defaultdict
from types import SimpleNamespace

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP_SCRIPT = os.path.join(REPO, "benchmarks", "fsdp.py")
MODES = ("hsdp+adamw", "hsdp+onebit", "fsdp1d+onebit", "fsdp1d+onebit+qwz")  # the default
ALL_MODES = (*MODES, "fsdp1d+adamw", "hsdp+onebit+whole")
KINDS = ("intra", "inter", "world")  # groups inside a node, one rank per node, the rest
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGET_BYTES, TARGET_SPEEDUP, TARGET_LOSS = 1 / 12, 2.5, 0.01
TARGET_MEMORY = {"fp32": 1.15, "bf16": 1.0}  # hsdp+onebit over hsdp+adamw, by error dtype


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fsdp = _load("fn_bench_fsdp", FSDP_SCRIPT)  # puts this checkout first on the path
cluster = fsdp.cluster

from fn.app import examples  # noqa: E402  (examples/fsdp_loco.py's model, data and loss)


def group_kind(ranks: list[int], local: int) -> str:
    """``intra``, ``inter`` or ``world`` for a group of these global ranks, ``local`` a node."""
    nodes = {r // local for r in ranks}
    if len(nodes) == 1:
        return "intra"
    return "inter" if len(nodes) == len(ranks) else "world"


def kind_of_group(local: int):
    """``group -> kind`` (:func:`group_kind`), cached by group."""
    cache: dict[int, tuple[object, str]] = {}

    def kind(group) -> str:
        if id(group) not in cache:
            try:
                ranks = dist.get_process_group_ranks(group)
            except (KeyError, RuntimeError, ValueError):  # not a registered group: say world
                ranks = list(range(dist.get_world_size()))
            cache[id(group)] = (group, group_kind(ranks, local))
        return cache[id(group)][1]

    return kind


def across_estimate(by_kind: dict[str, float], world: int, local: int) -> float:
    """Counted bytes across nodes: ``inter`` and the other-node share of ``world``."""
    return by_kind.get("inter", 0) + by_kind.get("world", 0) * (world - local) / (world - 1)


def worker(rank: int, world_size: int, config: dict) -> dict:
    """One rank: the bound, then every mode (:data:`MODES`); rank 0's results are printed."""
    example = fsdp._load("fsdp_loco_example", os.path.join("examples", "fsdp_loco.py"))
    args = example.parse_args(config["example_args"])
    kind = kind_of_group(config["ranks_per_node"])
    table = examples.bigram_table(args.vocab)
    ctx = SimpleNamespace(args=args, table=table, config=config, kind=kind)
    ctx.counter = fsdp.ByteCounter(kind)
    results = {"bound_s": _forward_backward(args, table, rank, config)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "[a-z_.A-Z]+: the variance froze", RuntimeWarning)
        for mode in config["modes"]:
            model, optimizer = _build(mode, args, config)
            results[mode] = _train(mode, model, optimizer, ctx)
            if rank == 0:
                r = results[mode]
                print(
                    f"{mode}: median step {r['step_s']:.3f} s, held-out loss "
                    f"{r['held_out_loss']:.4f}",
                    flush=True,
                )
    return results


def _forward_backward(args, table, rank: int, config: dict) -> float:
    """Median seconds of an update's forwards + backwards (its ``--accumulate`` micro-batches)
    on an unsharded copy, no communication (the bound), over the steps that the modes' medians
    take."""
    torch.manual_seed(args.seed)
    model = examples.Transformer(args.vocab, args.d_model, args.heads, args.layers, args.context)
    k = config["accumulate"]
    times = []
    for step in range(config["steps"]):
        batch = update_batch(table, args, step, rank, k)
        dist.barrier()
        start = time.perf_counter()
        model.zero_grad()
        for part in batch.chunk(k):
            (examples.lm_loss(model, part) / k).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[_first_timed(config) :])


def _first_timed(config: dict) -> int:
    return max(config["warmup"], config["freeze_step"])


def update_batch(table, args, step: int, rank: int, k: int) -> torch.Tensor:
    """The ``k --batch`` sequences of an update on ``rank`` (with ``k`` 1: the example's batch)."""
    update_args = argparse.Namespace(**{**vars(args), "batch": k * args.batch})
    return examples.train_batch(table, update_args, step, rank)


def _build(mode: str, args, config: dict):
    """The model (the same random weights in every mode) and optimizer of ``mode``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    nodes, local = config["nodes"], config["ranks_per_node"]
    torch.manual_seed(args.seed)
    model = examples.Transformer(args.vocab, args.d_model, args.heads, args.layers, args.context)
    if mode.startswith("fsdp1d"):
        mesh = init_device_mesh("cpu", (nodes * local,))
    else:
        mesh = init_device_mesh("cpu", (nodes, local), mesh_dim_names=("replicate", "shard"))
    hsdp_onebit = mode.startswith("hsdp+onebit")
    shard = mesh["shard"] if hsdp_onebit else mesh
    for block in model.blocks:
        fully_shard(block, mesh=shard)
    fully_shard(model, mesh=shard)
    if mode.endswith("+adamw"):
        return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    onebit = getattr(fsdp.fn.fsdp, fsdp.ONEBIT_OPTIMIZERS[config["onebit"]])
    hyper = dict(lr=args.lr, weight_decay=0.01, freeze_step=config["freeze_step"])
    hyper["error_dtype"] = DTYPES[config["error_dtype"]]
    if config["accumulate_dtype"] != "fp32":
        hyper["accumulate_dtype"] = DTYPES[config["accumulate_dtype"]]
    if hsdp_onebit:
        return model, onebit(model, **hyper, replicate=mesh["replicate"])
    optimizer = onebit(model, **hyper)
    if mode.endswith("+qwz"):
        fsdp.fn.fsdp.quantized_all_gather(model, bits=8, group_size=args.group_size)
    return model, optimizer


def _uplinks(config: dict) -> int:
    """Rank 0 on the two-level cluster: bytes sent so far out of all uplinks; else 0."""
    if config.get("master_addr") is None or dist.get_rank() != 0:
        return 0
    return cluster.uplink_tx_bytes(config["prefix"], config["nodes"])


def _fn_by_kind(optimizer, kind) -> dict[str, float] | None:
    """fn's own count of the bytes this rank sent, by kind of group (``None``: not fn's)."""
    comms = getattr(getattr(optimizer, "_comms", None), "comms", None)
    if comms is None:
        return None
    out: dict[str, float] = defaultdict(float)
    for group, comm in comms.items():
        out[kind(group)] += comm.bytes_sent
    return out


def _fn_by_hop(optimizer) -> dict[str, int] | None:
    """fn's ``bytes_sent_by_hop`` (``None``: not fn's optimizer)."""
    return getattr(optimizer, "bytes_sent_by_hop", None)


def _train(mode: str, model, optimizer, ctx: SimpleNamespace) -> dict:
    """``--steps`` updates; the bytes of the updates after the freeze, by kind and on the
    uplinks; the memory right before the last update's ``step()``."""
    args, config, counter, kind = ctx.args, ctx.config, ctx.counter, ctx.kind
    steps, first = config["steps"], config["freeze_step"]
    k = config["accumulate"]
    micro = 1 if mode.endswith("+whole") else k  # +whole: the update's batch in one backward
    memory = {}

    def measure():
        memory.update(_memory(model, optimizer))

    times = []
    for step in range(steps):
        if step == first:  # from here on: compressed steps (1-bit), the same steps for AdamW
            dist.barrier()
            wire = [_uplinks(config)]
            dist.barrier()
            wire.append(_uplinks(config))  # the two readings bracket one barrier's traffic
            counter.reset()
            fn_before, hop_before = _fn_by_kind(optimizer, kind), _fn_by_hop(optimizer)
        batch = update_batch(ctx.table, args, step, dist.get_rank(), k)
        times.append(
            fsdp._timed_step(
                model, optimizer, batch, counter, accumulate=micro,
                all_reduce_once=mode == "hsdp+adamw" and micro > 1,
                before_step=measure if step == steps - 1 else None,
            )
        )  # fmt: skip
    dist.barrier()
    wire.append(_uplinks(config))
    compressed, world = steps - first, dist.get_world_size()
    barriers = (compressed + 1) * max(0, wire[1] - wire[0])  # one before each step, one after
    fn_after, hop_after = _fn_by_kind(optimizer, kind), _fn_by_hop(optimizer)
    return {
        "by_kind": {k: v / compressed for k, v in counter.by_kind.items()},
        "fn_by_kind": None
        if fn_after is None
        else {k: (v - fn_before.get(k, 0)) / compressed for k, v in fn_after.items()},
        "fn_by_hop": None
        if hop_after is None
        else {k: (v - hop_before[k]) / compressed for k, v in hop_after.items()},
        "uplinks": max(0, wire[2] - wire[1] - barriers) / world / compressed,
        "step_s": statistics.median(times[_first_timed(config) :]),
        "memory": memory,
        "held_out_loss": examples.held_out_loss(model, ctx.table, args),
        "params": sum(p.numel() for p in model.parameters()),
    }


def _local_bytes(tree) -> int:
    """Bytes of the distinct storages of the tensors in ``tree`` (DTensors: this rank's)."""
    from torch.distributed.tensor import DTensor
    from torch.utils import _pytree as pytree

    seen = {}
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, DTensor):
            leaf = leaf.to_local()
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _memory(model, optimizer) -> dict[str, int]:
    """This rank's params, grads, optimizer state and gradient accumulator bytes (fn: its
    moments, the modules' packed momenta and errors, their local gradients; AdamW: its state,
    FSDP2's partial reduce outputs)."""
    from torch.distributed.fsdp import FSDPModule

    params = list(model.parameters())
    if isinstance(optimizer, torch.optim.AdamW):
        state = _local_bytes(list(optimizer.state.values()))
        groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules()
                  if isinstance(m, FSDPModule)]  # fmt: skip
        accumulator = _local_bytes([g._partial_reduce_output for g in groups if g is not None])
    else:
        modules = list(optimizer._modules)  # fn.fsdp's OnebitModule, one per module
        state = _local_bytes([optimizer._state, [(x.signs, x.errors) for x in modules]])
        accumulator = _local_bytes([(x.local_gradient, x._written) for x in modules])
    grads = _local_bytes([p.grad for p in params if p.grad is not None])
    return {
        "params": _local_bytes(params),
        "grads": grads,
        "state": state,
        "accumulator": accumulator,
    }


def memory_formula(mode: str, n: int, config: dict) -> float:
    """docs/algorithms.md's params + grads + state + accumulator per rank right before a
    compressed ``step()``, fp32 params (1-bit LAMB: ``8 n`` more before dividing, its ``v~``
    and fp32 momentum, as benchmarks/memory.py's formula). On a 1-D mesh fn accumulates the
    whole local gradient, ``a n`` bytes (``a``: ``--accumulate-dtype``'s; with bf16 also the
    fp32 sum of this rank's row, ``4 n / W``), whatever ``--accumulate``."""
    nodes, local = config["nodes"], config["ranks_per_node"]
    world = nodes * local
    e = DTYPES[config["error_dtype"]].itemsize
    dense = (12 if config["onebit"] == "adam" else 20) * n  # params, grads, v (LAMB: v~, m)
    if mode == "hsdp+adamw":
        return 16 * n / local
    if mode == "fsdp1d+adamw":
        return 16 * n / world
    if mode.startswith("hsdp+onebit"):
        return dense / local + n / (8 * local) + e * n / local + e * n / (local * nodes)
    a = DTYPES[config["accumulate_dtype"]].itemsize
    accumulator = a * n + (4 * n / world if a != 4 else 0)
    return dense / world + n / 8 + e * n + e * n / world + accumulator  # full packed m and e_w


# ----------------------------------------------------------------------------------------------
# Report (rank 0's results).

LABELS = {
    "hsdp+adamw": "HSDP + AdamW",
    "hsdp+onebit": "HSDP + fn {name}",
    "fsdp1d+onebit": "1-D FSDP2 + fn {name}",
    "fsdp1d+onebit+qwz": "1-D FSDP2 + fn {name} + 8-bit all-gathers",
    "fsdp1d+adamw": "1-D FSDP2 + AdamW",
    "hsdp+onebit+whole": "HSDP + fn {name}, one batch of K",
}
MEMORY_BASE = {  # each mode's memory against this baseline's
    "hsdp+onebit": "hsdp+adamw",
    "hsdp+onebit+whole": "hsdp+adamw",
    "fsdp1d+onebit": "fsdp1d+adamw",
    "fsdp1d+onebit+qwz": "fsdp1d+adamw",
}


def _label(mode: str, config: dict) -> str:
    return LABELS[mode].format(name=fsdp.ONEBIT_OPTIMIZERS[config["onebit"]])


def _across(r: dict, config: dict) -> float:
    """The bytes across nodes per rank and compressed step: the uplinks' on the two-level
    cluster, else the counted estimate (:func:`across_estimate`)."""
    if config["rate"] is not None:
        return r["uplinks"]
    return across_estimate(
        r["by_kind"], config["nodes"] * config["ranks_per_node"], config["ranks_per_node"]
    )


def _ratio(numerator: float, denominator: float | None, width: int, digits: int) -> str:
    """``numerator / denominator`` right-aligned in ``width``, ``-`` without a baseline."""
    if not denominator:
        return "-".rjust(width)
    return f"{numerator / denominator:>{width}.{digits}f}"


def print_results(rank0: dict, config: dict) -> None:
    """The bytes, times, losses and memory of every mode, then the summary."""
    nodes, local, modes = config["nodes"], config["ranks_per_node"], config["modes"]
    links = f"uplinks at {config['rate']}" if config["rate"] else "loopback (no --rate)"
    compressed = config["steps"] - config["freeze_step"]
    print(
        f"\nHSDP benchmark, {nodes} nodes x {local} ranks, {links}, "
        f"{rank0[modes[0]]['params']} parameters, {config['steps']} updates of "
        f"{config['accumulate']} micro-batch(es) of {config['batch']} sequences per rank, "
        f"freeze_step {config['freeze_step']}, {config['error_dtype']} errors, "
        f"{datetime.date.today()}"
    )
    print(f"bytes per rank per compressed update ({compressed} updates), rank 0:")
    wire = "across (uplinks)" if config["rate"] else "across (counted)"
    print(
        f"{'mode':<44} {wire:>16} {'ratio':>7} {'counted: intra':>14} {'inter':>10} "
        f"{'world':>10} {'fn: intra':>10} {'inter':>10} {'world':>8}"
    )
    base = _across(rank0["hsdp+adamw"], config) if "hsdp+adamw" in rank0 else None
    for mode in modes:
        r = rank0[mode]
        across = _across(r, config)
        fn_count = r["fn_by_hop"] or {}
        counted = " ".join(f"{r['by_kind'].get(k, 0):>10.0f}" for k in KINDS)
        own = " ".join(
            "-".rjust(10) if not fn_count else f"{fn_count.get(k, 0):>10.0f}" for k in KINDS
        )
        print(
            f"{_label(mode, config):<44} {across:>16.0f} {_ratio(across, base, 7, 4)}     "
            f"{counted} {own}"
        )
    print(
        "counted: at torch's ProcessGroup interface, ideal ring/pairwise volume, by group: intra "
        "(one node), inter (one rank per node), world (the rest); fn: the optimizer's "
        "bytes_sent_by_hop"
    )
    if config["rate"] is None:
        print(
            "across (counted): inter + (W - L) / (W - 1) of world, an estimate; --rate reads "
            "the uplinks"
        )
    _print_steps(rank0, config)
    _print_memory(rank0, config)


def _print_steps(rank0: dict, config: dict) -> None:
    """Median update times against HSDP + AdamW's, the bound, and the held-out losses."""
    base = rank0["hsdp+adamw"]["step_s"] if "hsdp+adamw" in rank0 else None
    print(f"\n{'mode':<44} {'update s':>8} {'adamw/this':>10} {'held-out loss':>14}")
    for mode in config["modes"]:
        r = rank0[mode]
        speedup = "-".rjust(10) if base is None else f"{base / r['step_s']:>10.2f}"
        print(
            f"{_label(mode, config):<44} {r['step_s']:>8.3f} {speedup} {r['held_out_loss']:>14.4f}"
        )
    bound = rank0["bound_s"]
    speedup = "-".rjust(10) if base is None else f"{base / bound:>10.2f}"
    print(f"{'bound: forwards + backwards alone':<44} {bound:>8.3f} {speedup}")
    print(
        f"update s: median of updates {_first_timed(config) + 1}..{config['steps']}, its "
        f"{config['accumulate']} forward + backward and step(); adamw/this: HSDP + AdamW's "
        "update over this one's (bound: the most any update's ratio can be here: no update "
        "that computes the gradient is faster than its forwards + backwards alone)"
    )


def _print_memory(rank0: dict, config: dict) -> None:
    """Params + grads + state + accumulator per rank, measured, beside the formula."""
    n = rank0[config["modes"][0]]["params"]
    print(
        f"\nparams + grads + optimizer state + accumulator per rank (bytes, rank 0, right "
        f"before the last step(), after its {config['accumulate']} backward(s); n = {n}, "
        f"{config['error_dtype']} errors, {config['accumulate_dtype']} 1-D accumulator)"
    )
    print(
        f"{'mode':<44} {'params':>10} {'grads':>10} {'state':>10} {'accum.':>10} "
        f"{'total':>10} {'formula':>10} {'/formula':>8} {'/AdamW':>7}"
    )
    for mode in config["modes"]:
        m = rank0[mode]["memory"]
        total, formula = sum(m.values()), memory_formula(mode, n, config)
        base = MEMORY_BASE.get(mode)
        base = sum(rank0[base]["memory"].values()) if base in rank0 else None
        print(
            f"{_label(mode, config):<44} {m['params']:>10} {m['grads']:>10} {m['state']:>10} "
            f"{m['accumulator']:>10} {total:>10} {formula:>10.0f} {total / formula:>8.3f} "
            f"{_ratio(total, base, 7, 3)}"
        )
    print(
        "formula (docs/algorithms.md): AdamW 16n/L (HSDP), 16n/W (1-D); HSDP + fn 4n/L + 4n/L + "
        "4n/L + n/(8L) + e n/L + e n/(L N) (e: the errors' bytes; 1-bit LAMB 8n/L more); 1-D "
        "FSDP2 + fn 12n/W + n/8 + e n + e n/W + a n (a: the accumulator's bytes; bf16: + 4n/W); "
        "/AdamW: over the same mesh's AdamW"
    )


def targets(rank0: dict, config: dict) -> list[tuple[str, float | None, str, float | None]]:
    """Issues #45 and #52's targets: ``(text, ratio, verdict, bound)``; ``ratio`` ``None``
    where the run did not measure it."""
    name = fsdp.ONEBIT_OPTIMIZERS[config["onebit"]]
    k = config["accumulate"]
    per = "update" if k == 1 else f"update of {k} micro-batches"
    base, onebit = rank0.get("hsdp+adamw"), rank0.get("hsdp+onebit")
    both = base is not None and onebit is not None
    source = "uplinks" if config["rate"] else "counted, loopback"
    rows = [(f"HSDP + {name} bytes across nodes per {per} <= 1/12 of HSDP + AdamW ({source})",
             _across(onebit, config) / _across(base, config) if both else None,
             TARGET_BYTES, None)]  # fmt: skip
    at_rate = config["rate"] is not None and cluster.parse_rate(config["rate"]) == 1e8
    rows.append(
        (
            f"HSDP + {name} compressed {per} >= 2.5x HSDP + AdamW, 100 Mbit/s",
            base["step_s"] / onebit["step_s"] if both and at_rate else None,
            TARGET_SPEEDUP,
            base["step_s"] / rank0["bound_s"] if both and at_rate else None,
        )
    )
    reference = "1-D FSDP2 + " + name if k == 1 else f"one backward on the {k} micro-batches"
    other = rank0.get("fsdp1d+onebit" if k == 1 else "hsdp+onebit+whole")
    loss = None
    if onebit is not None and other is not None:
        loss = onebit["held_out_loss"] / other["held_out_loss"] - 1
    rows.append((f"held-out loss, HSDP + {name} within 1% of {reference}", loss, TARGET_LOSS,
                 None))  # fmt: skip
    dtype = config["error_dtype"]
    memory = None
    if both:
        memory = sum(onebit["memory"].values()) / sum(base["memory"].values())
    rows.append((f"HSDP + {name} memory per rank at step() <= {TARGET_MEMORY[dtype]}x HSDP + "
                 f"AdamW ({dtype} errors, {k} micro-batches)", memory, TARGET_MEMORY[dtype],
                 None))  # fmt: skip
    out = []
    for text, ratio, target, bound in rows:
        if ratio is None:
            verdict = "not measured"
        elif target == TARGET_SPEEDUP:
            verdict = "met" if ratio >= target else "NOT met"
        elif target == TARGET_LOSS:
            verdict = "met" if abs(ratio) <= target else "NOT met"
        else:
            verdict = "met" if ratio <= target else "NOT met"
        out.append((text, ratio, verdict, bound))
    return out


def print_summary(rank0: dict, config: dict, load: float) -> None:
    print(
        f"\nissue #45 and #52 targets ({config['nodes']} nodes x {config['ranks_per_node']} "
        f"ranks, 1 thread per rank, {config['accumulate']} micro-batch(es) per update; load "
        "average before the run "
        f"{load:.2f}; bound: HSDP + AdamW's update over forwards + backwards alone)"
    )
    rows = targets(rank0, config)
    width = max(len(text) for text, *_ in rows)
    for text, ratio, verdict, bound in rows:
        measured = "-" if ratio is None else f"{ratio:.4f}"
        extra = "" if bound is None else f"   (bound {bound:.2f}x)"
        print(f"  {text:{width}s} {measured:>8s}   {verdict}{extra}")


# ----------------------------------------------------------------------------------------------
# Host side.


def print_plan(config: dict, args, modes: tuple[str, ...] = MODES) -> None:
    """What a fsdp.py run does, changing nothing: its namespaces at ``--rate`` (two-level with
    ``--nodes``, flat without), or loopback."""
    world, local = args.ranks, args.ranks_per_node
    print(f"# modes, in this order on the same {world} ranks: {', '.join(modes)}")
    if args.rate is None:
        print(f"# no --rate: {world} gloo ranks on this machine's loopback; nothing to set up")
        return
    layout = "one flat bridge" if local is None else f"{args.nodes} nodes x {local} ranks"
    print(f"# set up ({layout})")
    for cmd in cluster.setup_commands(args.prefix, world, args.subnet, local):
        print(" ".join(cmd))
    links = "every link" if local is None else "every node's uplink"
    print(f"# rate {args.rate}: shape {links}, then one rank per namespace")
    for cmd in cluster.shaping_commands(args.prefix, world, args.rate, local):
        print(" ".join(cmd))
    worker_config = {**links_config(config, args), "master_addr": cluster.address(args.subnet, 0)}
    for rank in range(world):
        cmd = cluster.worker_command(args.prefix, rank, worker_config, FSDP_SCRIPT)
        print(" ".join(cmd[:-1]), f"'{cmd[-1]}'")
    nodes = [] if local is None else cluster.node_namespaces(args.prefix, args.nodes)
    if nodes:
        print(
            "# rank 0 reads the bytes across nodes before and after each mode's compressed steps:"
        )
        for ns in nodes:
            print(f"#   ip -n {ns} -s -j link show dev {cluster.UPLINK}")
    print("# clean up")
    bridge, rank_ns = cluster.namespaces(args.prefix, world)
    for ns in (*rank_ns, *nodes, bridge):
        print(f"ip netns delete {ns}")


def run(config: dict, args, worker_fn) -> dict:
    """Rank 0's results: on loopback (``worker_fn``, fsdp.py's module-level worker, spawned) or
    on the two-level cluster at ``--rate``."""
    world = config["nodes"] * config["ranks_per_node"]
    if args.rate is None:
        return fsdp.spawn_gloo(
            worker_fn, world, (config,), timeout=args.timeout, on_message=lambda r, m: None,
            threads=1,
        )[0]  # fmt: skip
    cluster.check_host("benchmarks/fsdp.py --rate", hint="; run without --rate for local gloo")
    (rank0,) = cluster.run_on_links(
        args.prefix, args.subnet, [links_config(config, args)], args.timeout, FSDP_SCRIPT, echo=True
    )
    return rank0


def links_config(config: dict, args) -> dict:
    """``config`` as the ranks on the namespace cluster get it (cluster.run_on_links); the
    two-level cluster's ranks also get the prefix, to read the uplinks."""
    config = {**config, "world_size": args.ranks}
    return config if args.nodes is None else {**config, "prefix": args.prefix}


def main(argv: list[str] | None = None) -> None:
    """fsdp.py with ``--nodes 2 --ranks-per-node 2`` unless given (this process becomes it)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--nodes" not in argv:
        argv = ["--nodes", "2", "--ranks-per-node", "2", *argv]
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, FSDP_SCRIPT, *argv])


if __name__ == "__main__":
    main()
