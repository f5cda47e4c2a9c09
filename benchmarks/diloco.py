"""DiLoCo's held-out loss at equal tokens, and the outer bytes each worker sends per token.

Four workers simulated in one process (``fn.collectives.Simulated``: one ``vmap`` over the
workers, the collectives' bytes counted as a gloo group would send them) train the demo's
next-character model (:class:`fn.app.demo.CharMLP`, 144k params, on the standard library's
source; held out: ``fractions.py``; :mod:`fn.app._data`). Every worker reads its own shard with
its own generator, so every run of a seed sees the same batches. The runs:

- ``ddp-adamw``: AdamW on the gradients averaged over the workers at every step (a dense fp32
  allreduce, ``fn.diloco.compression("fp32")``), as DDP does;
- DiLoCo, each worker's inner AdamW with the same learning rate, an outer step every ``H``
  steps (``--sync-every``), Nesterov (lr 0.7, momentum 0.9) after the compressor: ``fp32``
  (dense DiLoCo), ``int8`` (no error feedback, torchft's baseline), ``loco4`` (4-bit LoCo with
  error feedback) and ``onebit`` (the error-compensated 1-bit allreduce);
- ``sparseloco-1/D``: SparseLoCo's rule (lr 1, beta 0.95), chunk-wise top-k of 4096 values in
  2 bits at density 1/D (``--densities``) with its error-feedback accumulator.

The held-out loss (cross-entropy in nats over 1024 windows of the held-out text) is that of
the anchor after the last outer step, where every worker holds the same params (DDP: the
params), the mean over ``--seeds`` (model init and data). Bytes per worker per token: what one
worker sent over the run (``comm.bytes_sent``, outer steps and their agreement record
included) over the characters it trained on (steps x batch). Printed: a line per run, then a
markdown table with each run's loss relative to dense DiLoCo's at the same ``H`` and its bytes
relative to dense DiLoCo's.

Run: python3 benchmarks/diloco.py [--sync-every 15,30] [--seeds 0] [--steps 900]
     [--densities 32,64,128] [--lr 3e-3] [--batch 32] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import fn  # noqa: E402
import fn.diloco  # noqa: E402
from fn.app import _data, demo  # noqa: E402
from fn.app.examples import positive_int  # noqa: E402
from fn.collectives import Simulated, replicate, simulate  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import int_list, parse_with_quick  # noqa: E402

WORKERS = 4
CHUNK = 4096
DILOCO = ("fp32", "int8", "loco4", "onebit")
CONTEXT, EMBED, HIDDEN = 32, 16, 256  # the demo's model
HELDOUT_WINDOWS = 1024


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sync-every", type=int_list(), default="15,30", help="H values (15,30)")
    p.add_argument("--seeds", type=int_list(0), default="0", help="comma-separated (0)")
    p.add_argument(
        "--steps", type=positive_int, default=900, help="inner steps, a multiple of every H (900)"
    )
    p.add_argument(
        "--densities", type=int_list(), default="32,64,128", help="top-k densities 1/D (32,64,128)"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's lr (inner and DDP)")
    p.add_argument("--batch", type=positive_int, default=32, help="windows per worker per step")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: 30 steps, H 15, D 64, seed 0 (where those four flags are not given)",
    )
    quick = {"steps": 30, "sync_every": [15], "seeds": [0], "densities": [64]}
    args = parse_with_quick(p, argv, quick)
    bad = [h for h in args.sync_every if args.steps % h]
    if bad:
        p.error(f"--steps {args.steps} is not a multiple of --sync-every {bad}")
    return args


def make_model(seed: int) -> torch.nn.Module:
    """The demo's next-character model, initialized from ``seed``."""
    torch.manual_seed(seed)
    return demo.CharMLP(_data.VOCAB_SIZE, CONTEXT, EMBED, HIDDEN)


def worker_batches(
    corpus, rank: int, seed: int, batch: int, workers: int = WORKERS
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Worker ``rank``'s batches of ``batch`` windows ``(x, y)`` from its ``1 / workers`` shard of
    the training text, drawn by its own generator (the same sequence in every run of ``seed``)."""
    if not 0 <= rank < workers:
        raise ValueError(f"rank {rank} is not one of {workers} workers")
    ids = _data.shard(corpus.train, rank, workers)
    generator = torch.Generator().manual_seed(seed * 100_003 + rank)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = _data.batch_starts(ids.numel(), CONTEXT, batch, generator)
        return _data.windows(ids, starts, CONTEXT)

    return next_batch


def heldout_windows(corpus) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out windows ``(x, y)``: ``HELDOUT_WINDOWS`` evenly spaced over the held-out
    text."""
    starts = _data.heldout_starts(corpus.heldout.numel(), CONTEXT, HELDOUT_WINDOWS)
    return _data.windows(corpus.heldout, starts, CONTEXT)


def _outer(name: str, comm: Simulated):
    """The outer rule of run ``name`` on ``comm``."""
    if name.startswith("sparseloco-1/"):
        k = CHUNK // int(name.split("/")[1])
        return fn.diloco.sparseloco(lr=1.0, k=k, chunk_size=CHUNK, comm=comm)  # the paper's lr
    return fn.diloco.nesterov(fn.diloco.compression(name, comm=comm))


def run(name: str, sync_every: int, seed: int, args: argparse.Namespace, corpus) -> dict:
    """One run: its held-out loss and the bytes one worker sent."""
    model = make_model(seed)
    params0 = {k: v.detach().clone() for k, v in model.named_parameters()}

    def loss_fn(params, x, y):
        logits = torch.func.functional_call(model, params, (x,))
        return torch.nn.functional.cross_entropy(logits, y)

    grads_fn = torch.func.vmap(torch.func.grad(loss_fn))
    batches = [worker_batches(corpus, r, seed, args.batch) for r in range(WORKERS)]

    def next_batch():
        pairs = [batch() for batch in batches]
        return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])

    comm = Simulated(WORKERS)
    inner = fn.adamw(lr=args.lr, implementation="chain")
    if name == "ddp-adamw":  # AdamW on the mean gradient, an fp32 allreduce at every step
        inner = fn.chain(fn.diloco.compression("fp32", comm=comm), inner)
    params = replicate(params0, comm)
    inner_state = simulate(inner.init, comm)(params)
    inner_step = simulate(inner.update, comm)
    if name != "ddp-adamw":
        outer = _outer(name, comm)
        anchor = replicate(params0, comm)
        outer_state = simulate(outer.init, comm)(anchor)
        step = simulate(lambda *a: fn.diloco.outer_step(outer, *a, comm=comm), comm)
    start = time.perf_counter()
    for t in range(1, args.steps + 1):
        x, y = next_batch()
        updates, inner_state = inner_step(grads_fn(params, x, y), inner_state, params)
        params = fn.apply_updates(params, updates)
        if name != "ddp-adamw" and t % sync_every == 0:
            result = step(anchor, params, outer_state)
            anchor, outer_state = result.anchor, result.state
            params = {k: v.clone() for k, v in anchor.items()}
    with torch.no_grad():
        evaluate = torch.func.vmap(loss_fn, in_dims=(0, None, None))
        heldout = evaluate(params, *heldout_windows(corpus))
    tokens = args.steps * args.batch
    return {
        "loss": float(heldout.mean()),
        "bytes": comm.bytes_sent,
        "per_token": comm.bytes_sent / tokens,
        "seconds": time.perf_counter() - start,
    }


def names(args: argparse.Namespace) -> list[str]:
    """The DiLoCo runs, in table order."""
    return [*DILOCO, *(f"sparseloco-1/{d}" for d in args.densities)]


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the runs are small: more threads only contend
    corpus = _data.load_corpus()
    results: dict[tuple[str, int | None], list[dict]] = {}
    plan = [("ddp-adamw", None)] + [(n, h) for h in args.sync_every for n in names(args)]
    for name, h in plan:
        for seed in args.seeds:
            r = run(name, h or args.steps, seed, args, corpus)
            results.setdefault((name, h), []).append(r)
            print(
                f"{name} H={h or 1} seed={seed}: held-out {r['loss']:.4f}, "
                f"{r['per_token']:.4g} B/token/worker, {r['seconds']:.1f} s",
                flush=True,
            )
    print()
    print(table(results, args))


def table(results: dict, args: argparse.Namespace) -> str:
    """The markdown table of ``results``, by H, each run against dense DiLoCo at that H (the
    mean over the seeds, then each seed's own)."""
    seeds = len(args.seeds)
    lines = [
        f"| run | H | held-out loss (mean of {seeds} seed{'s' * (seeds > 1)}) | vs dense DiLoCo "
        "| outer bytes / worker / token | fewer bytes than dense DiLoCo "
        f"| per seed ({', '.join(map(str, args.seeds))}): loss, vs dense DiLoCo |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, h), runs in results.items():
        loss = statistics.fmean(r["loss"] for r in runs)
        per_token = runs[0]["per_token"]
        dense = results.get(("fp32", h)) or results.get(("fp32", args.sync_every[0]))
        dense_loss = statistics.fmean(r["loss"] for r in dense)
        ratio = f"{100 * (loss / dense_loss - 1):+.2f}%"
        fewer = f"{dense[0]['per_token'] / per_token:.1f}x"
        each = " / ".join(
            f"{r['loss']:.4f} ({100 * (r['loss'] / d['loss'] - 1):+.2f}%)"
            for r, d in zip(runs, dense, strict=True)
        )
        lines.append(
            f"| {name} | {h or 1} | {loss:.4f} | {ratio} | {per_token:.4g} | {fewer} | {each} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
