"""Step time of the torch.optim adapter against torch.optim and the functional loop it wraps.

One process (Local), an MLP of many small tensors (where per-tensor work dominates). Times are
the median of ``--repeats`` runs of ``--steps`` optimizer steps each, the methods taking turns
in every repeat (gradients are fixed, so only the optimizer is timed). Ratios are against
``torch.optim.Adam(foreach=True)``. The adapter rows donate the optimizer's own buffers, as the
adapter always does (double buffering; docs/guides/memory.md, "Buffer donation"). Two rows run
the compressed 1-bit Adam step as on two ranks (``tests/_mirror.py``'s ``Mirror``: a comm of two
ranks holding this process's tensors, so the donated, fused path of the 1-bit allreduce runs):
the ``OnebitAdam`` adapter and the functional donated step it wraps (``fn.update_and_apply`` of
``fn.onebit_adam`` on one flat leaf), which first copies the fixed gradients into its gradient
buffer (the step writes into it), as the adapter copies the params' ``.grad`` into its own.
Last, for the same model in bf16 (fp32 master copy): the share of a compressed ``OnebitAdam``
step spent in the master sync that catches writes to the params between steps
(``FlatGroup.sync_master``).

Run: python3 benchmarks/optim.py [--layers 32] [--width 256] [--steps 50] [--repeats 5]
     [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fn  # noqa: E402
import fn.optim  # noqa: E402
from fn.app.examples import positive_int  # noqa: E402
from fn.collectives import Local  # noqa: E402
from tests._mirror import Mirror  # noqa: E402


def make_model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    return model


def time_steps(
    steppers: dict[str, Callable[[], object]], steps: int, repeats: int
) -> dict[str, float]:
    """Median seconds per step of each stepper; the steppers take turns in every repeat, so a
    change of load hits all of them alike."""
    for step in steppers.values():
        step()  # warm up (allocations; the 1-bit optimizers' first, uncompressed update)
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(repeats):
        for name, step in steppers.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(ts) for name, ts in times.items()}


def functional_onebit_step(model: torch.nn.Module) -> Callable[[], None]:
    """The functional donated 1-bit Adam step on the flat params of ``model`` with its fixed
    gradients, on two mirrored ranks: update 1 warms up, every later one compresses."""
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    fixed = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    grads = torch.empty_like(fixed)
    tx = fn.onebit_adam(freeze_step=2, comm=Mirror())
    box = {"state": tx.init(params), "t": 0}

    def step() -> None:
        box["t"] += 1
        grads.copy_(fixed)
        _, box["state"] = fn.update_and_apply(tx, grads, box["state"], params, step=box["t"])

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=positive_int, default=32)
    parser.add_argument("--width", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=50)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    steppers = {}
    model = make_model(args.layers, args.width)
    steppers["torch.optim.Adam(foreach)"] = torch.optim.Adam(
        model.parameters(), lr=1e-3, foreach=True
    ).step

    model = make_model(args.layers, args.width)
    opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.adam(1e-3))
    steppers["fn.optim.FunctionalOptimizer(fn.adam)"] = opt.step

    model = make_model(args.layers, args.width)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    grads = {k: p.grad for k, p in model.named_parameters()}
    tx = fn.adam(1e-3)
    box = {"p": params, "s": tx.init(params)}

    def functional_step() -> None:
        updates, box["s"] = tx.update(grads, box["s"], box["p"])
        box["p"] = fn.apply_updates(box["p"], updates)

    steppers["fn.adam functional loop (per-tensor leaves)"] = functional_step

    for name, make in (
        ("fn.optim.OnebitAdam (warmup)", lambda ps: fn.optim.OnebitAdam(ps, freeze_step=10**9)),
        # update 1 (the untimed warm-up call of time_steps) warms up, every timed one compresses
        ("fn.optim.OnebitAdam (compressed)", lambda ps: fn.optim.OnebitAdam(ps, freeze_step=2)),
    ):
        model = make_model(args.layers, args.width)
        opt = make(model.parameters())
        assert isinstance(opt.comm, Local)
        steppers[name] = opt.step

    model = make_model(args.layers, args.width)
    opt = fn.optim.OnebitAdam(model.parameters(), freeze_step=2, comm=Mirror())
    steppers["fn.optim.OnebitAdam (compressed, 2 ranks)"] = opt.step
    steppers["fn.onebit_adam donated (compressed, 2 ranks)"] = functional_onebit_step(
        make_model(args.layers, args.width)
    )

    model = make_model(args.layers, args.width).to(torch.bfloat16)
    for p in model.parameters():
        p.grad = p.grad.to(torch.bfloat16)
    opt = fn.optim.OnebitAdam(model.parameters(), freeze_step=2)
    steppers["bf16"] = opt.step
    steppers["bf16 sync"] = opt._groups[0].flat.sync_master
    results = time_steps(steppers, args.steps, args.repeats)
    bf16_step, sync = results.pop("bf16"), results.pop("bf16 sync")

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
