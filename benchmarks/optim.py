"""Step time of the torch.optim adapter against torch.optim and the functional loop it wraps.

One process (Local), an MLP of many small tensors (where per-tensor work dominates). Times are
the median of ``--repeats`` runs of ``--steps`` optimizer steps each (gradients are fixed, so
only the optimizer is timed). Ratios are against ``torch.optim.Adam(foreach=True)``. Last, for
the same model in bf16 (fp32 master copy): the share of a compressed ``OnebitAdam`` step spent
in the master sync that catches writes to the params between steps (``FlatGroup.sync_master``).

Run: python3 benchmarks/optim.py [--layers 32] [--width 256] [--steps 50] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fn  # noqa: E402
import fn.optim  # noqa: E402
from fn.collectives import Local  # noqa: E402


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    return model


def time_steps(step, steps: int, repeats: int) -> float:
    """Median seconds per step."""
    step()  # warm up (allocations)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    results = {}
    model = make_model(args.layers, args.width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    results["torch.optim.Adam(foreach)"] = time_steps(opt.step, args.steps, args.repeats)

    model = make_model(args.layers, args.width)
    opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.adam(1e-3))
    results["fn.optim.FunctionalOptimizer(fn.adam)"] = time_steps(
        opt.step, args.steps, args.repeats
    )

    model = make_model(args.layers, args.width)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    grads = {k: p.grad for k, p in model.named_parameters()}
    tx = fn.adam(1e-3)
    box = {"p": params, "s": tx.init(params)}

    def functional_step() -> None:
        updates, box["s"] = tx.update(grads, box["s"], box["p"])
        box["p"] = fn.apply_updates(box["p"], updates)

    results["fn.adam functional loop (per-tensor leaves)"] = time_steps(
        functional_step, args.steps, args.repeats
    )

    for name, make in (
        ("fn.optim.OnebitAdam (warmup)", lambda ps: fn.optim.OnebitAdam(ps, freeze_step=10**9)),
        # update 1 (the untimed warm-up call of time_steps) warms up, every timed one compresses
        ("fn.optim.OnebitAdam (compressed)", lambda ps: fn.optim.OnebitAdam(ps, freeze_step=2)),
    ):
        model = make_model(args.layers, args.width)
        opt = make(model.parameters())
        assert isinstance(opt.comm, Local)
        results[name] = time_steps(opt.step, args.steps, args.repeats)

    model = make_model(args.layers, args.width).to(torch.bfloat16)
    for p in model.parameters():
        p.grad = p.grad.to(torch.bfloat16)
    opt = fn.optim.OnebitAdam(model.parameters(), freeze_step=2)
    bf16_step = time_steps(opt.step, args.steps, args.repeats)
    sync = time_steps(opt._groups[0].flat.sync_master, args.steps, args.repeats)

    numel = sum(p.numel() for p in model.parameters())
    print(
        f"{args.layers} layers x Linear({args.width}, {args.width}): {2 * args.layers} tensors, "
        f"{numel} params, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    base = results["torch.optim.Adam(foreach)"]
    for name, seconds in results.items():
        print(f"{name:48s} {seconds * 1e3:8.3f} ms/step   {seconds / base:5.2f}x")
    print(
        f"bf16 OnebitAdam (compressed) {bf16_step * 1e3:.3f} ms/step, of which the master sync "
        f"{sync * 1e3:.3f} ms ({sync / bf16_step:.1%})"
    )


if __name__ == "__main__":
    main()
