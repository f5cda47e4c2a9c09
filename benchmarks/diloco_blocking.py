"""Seconds the outer step of ``fn.diloco.DiLoCo`` blocks the training loop, with and without
Streaming DiLoCo's fragments and delay.

2 gloo ranks on this machine (one intra-op thread each) train the same MLP (``cluster.py``'s
shape ``w -> 4w -> 4w -> w``, about ``--params`` fp32 parameters in 3 ``Linear`` layers, 6
tensors) with SGD on random batches of ``--batch`` rows, under DiLoCo with the dense fp32 outer
compressor and ``sync_every=--sync-every``. Two post-step hooks on the inner optimizer, one
registered before DiLoCo's and one after, time DiLoCo's own hook at every inner step: the time
the training loop is blocked by it (taking a pseudo-gradient, an exchange on the loop's thread,
waiting for a background exchange, applying the result). Each setting runs one round of
``sync_every`` steps to warm up, then ``--rounds`` measured rounds; ``no outer step`` is the
inner steps alone (DiLoCo with an outer step beyond the run).

Columns (rank 0's; both ranks block alike): ``blocked / round``: seconds blocked per
``sync_every`` inner steps; ``longest``: the longest single block; ``round``: the wall-clock
seconds of a round; ``inner step``: the median inner step (forward, backward, SGD) without the
hook. On a machine whose cores the ranks share, a background exchange competes with the inner
steps for them: ``round`` shows what the overlap gains there; on hosts with a core to spare, or
a GPU, the exchange runs beside the steps.

Below the table, for each delayed row: the share of the exchange it hid, ``1 - blocked(tau) /
blocked(tau = 0)`` against the streaming row without a delay, and whether ``tau`` inner steps
cover one fragment's exchange (``tau`` times the median inner step against ``blocked(tau = 0) /
P``, the exchange as the loop pays it without a delay): where they do, the target is to hide
at least 80%; where they do not, the most that can hide is that cover, the bound printed.

Run: python3 benchmarks/diloco_blocking.py [--params 4e6] [--sync-every 16] [--fragments 4]
     [--delays 1,3] [--rounds 3] [--batch 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fn.diloco  # noqa: E402
from fn.app.examples import positive_int  # noqa: E402
from fn.app.launch import spawn_gloo  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import int_list  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--params", type=float, default=4e6, help="about this many parameters")
    p.add_argument("--sync-every", type=positive_int, default=16, help="H, inner steps per round")
    p.add_argument("--fragments", type=positive_int, default=4, help="P of the streaming rows")
    p.add_argument(
        "--delays", type=int_list(), default="1,3", help="tau of the delayed rows, comma-separated"
    )
    p.add_argument(
        "--rounds", type=positive_int, default=3, help="measured rounds of H inner steps"
    )
    p.add_argument("--batch", type=positive_int, default=32, help="rows per inner step")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    args = p.parse_args(argv)
    if args.params < 1:
        p.error(f"--params must be at least 1, got {args.params:g}")
    if max(args.delays) >= args.sync_every // args.fragments:
        p.error("--delays must be below --sync-every / --fragments (DiLoCo's bound on tau)")
    if args.timeout <= 0:
        p.error(f"--timeout must be positive, got {args.timeout:g}")
    return args


def settings(args: argparse.Namespace) -> list[tuple[str, dict]]:
    h, p = args.sync_every, args.fragments
    rows = [
        ("no outer step", {"sync_every": h * (args.rounds + 2)}),
        ("DiLoCo (P=1, tau=0)", {"sync_every": h}),
        (f"streaming (P={p}, tau=0)", {"sync_every": h, "fragments": p}),
    ]
    for tau in args.delays:
        rows.append(
            (f"streaming (P={p}, tau={tau})", {"sync_every": h, "fragments": p, "delay": tau})
        )
    return rows


def _measure(rank: int, args: argparse.Namespace, kwargs: dict) -> dict:
    width = max(1, round((args.params / 24) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(4 * width, 4 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(4 * width, width),
    )
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    marks: list[float] = []
    before = inner.register_step_post_hook(lambda *a: marks.append(time.perf_counter()))
    diloco = fn.diloco.DiLoCo(model, inner, timeout=300, **kwargs)
    after = inner.register_step_post_hook(lambda *a: marks.append(time.perf_counter()))
    g = torch.Generator().manual_seed(rank)
    h = args.sync_every
    blocked, compute, rounds = [], [], []
    for step in range((args.rounds + 1) * h):
        if step % h == 0:
            round_start = time.perf_counter()
        x = torch.randn(args.batch, width, generator=g)
        started = time.perf_counter()
        model(x).square().mean().backward()
        inner.step()
        inner.zero_grad()
        if step >= h:  # the first round warms up
            blocked.append(marks[-1] - marks[-2])
            compute.append(marks[-2] - started)
            if step % h == h - 1:
                rounds.append(time.perf_counter() - round_start)
    before.remove()
    after.remove()
    diloco.sync()  # ends any exchange in flight
    diloco.remove()
    n = sum(p.numel() for p in model.parameters())
    return {
        "params": n,
        "blocked": sum(blocked) / args.rounds,
        "longest": max(blocked),
        "round": statistics.median(rounds),
        "step": statistics.median(compute),
    }


def _worker(rank: int, world_size: int, send, args: argparse.Namespace) -> dict:
    del world_size, send
    return {name: _measure(rank, args, kwargs) for name, kwargs in settings(args)}


def main(argv=None) -> None:
    args = parse_args(argv)
    ranks = spawn_gloo(
        _worker, 2, (args,), timeout=args.timeout, on_message=lambda r, m: None, threads=1
    )
    first = ranks[0]
    n = next(iter(first.values()))["params"]
    print(
        f"{n / 1e6:.2f}M fp32 params, 2 gloo ranks, dense fp32 outer step, H = {args.sync_every}, "
        f"{args.rounds} rounds; rank 0's seconds"
    )
    print("| setting | blocked / round | longest | round | inner step |")
    print("|---|---|---|---|---|")
    for name, r in first.items():
        print(
            f"| {name} | {r['blocked']:.3f} | {r['longest']:.3f} | {r['round']:.3f} | "
            f"{r['step']:.4f} |"
        )
    print(hidden(first, args))


def hidden(first: dict, args: argparse.Namespace) -> str:
    """What each delayed row hid of the exchange, against the bound its compute sets."""
    p = args.fragments
    undelayed = first[f"streaming (P={p}, tau=0)"]["blocked"]
    lines = []
    for tau in args.delays:
        r = first[f"streaming (P={p}, tau={tau})"]
        share = 1 - r["blocked"] / undelayed
        cover = tau * r["step"] / (undelayed / p)
        if cover >= 1:
            verdict = f"covered ({cover:.1f}x): target 80%, {'met' if share >= 0.8 else 'not met'}"
        else:
            verdict = f"not covered: at most {cover:.0%} can hide"
        lines.append(f"tau={tau}: hid {share:.0%} of the exchange; {verdict}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
