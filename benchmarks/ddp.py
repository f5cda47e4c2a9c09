"""Bytes per rank sent by DDP training setups, counted by the kernel, not by fn.

Two gloo ranks train an MLP for ``--steps`` steps; 1-bit Adam has ``freeze_step=--freeze``
(``--freeze - 1`` dense warmup steps, then compressed ones) and the hooks the same number of
dense iterations (``start_iter=--freeze - 1``). One launch: the setups run one after the
other, each with its own model:

- ``fn OnebitAdam (no DDP)``: the bare ``fn.optim.OnebitAdam`` (it averages the gradients
  itself);
- ``DDP + fn.ddp.register(OnebitAdam)``;
- ``DDP + AdamW (dense)``: DDP's own allreduce;
- ``DDP + AdamW + onebit_hook`` and ``DDP + AdamW + loco_hook (4 bit)``.

Bytes are what each rank process wrote from the first to the last step (``wchar`` of
``/proc/self/io``: every ``write``/``writev`` on gloo's sockets, the TCP store included), so
DDP's one-time broadcast of the initial weights (in its constructor) is not counted, and
nothing of fn's own byte counter is used (it is printed alongside, for fn's collectives only).
Per-step gloo overhead (a few hundred bytes per collective) dominates tiny models.

Run: python3 benchmarks/ddp.py [--width 1024] [--layers 4] [--steps 40] [--freeze 10]
     [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fn  # noqa: E402
import fn.ddp  # noqa: E402
import fn.optim  # noqa: E402
from fn.app._launch import spawn_gloo  # noqa: E402

SETUPS = (
    "fn OnebitAdam (no DDP)",
    "DDP + fn.ddp.register(OnebitAdam)",
    "DDP + AdamW (dense)",
    "DDP + AdamW + onebit_hook",
    "DDP + AdamW + loco_hook (4 bit)",
)


def bytes_written() -> int:
    """What this process has written so far, sockets included (the kernel's count)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


def build(setup: str, width: int, layers: int, freeze: int) -> tuple:
    """``(model to call, optimizer)`` of ``setup``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    if setup == "fn OnebitAdam (no DDP)":
        return model, fn.optim.OnebitAdam(model.parameters(), lr=1e-4, freeze_step=freeze)
    net = DDP(model)
    if setup == "DDP + fn.ddp.register(OnebitAdam)":
        opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-4, freeze_step=freeze)
        fn.ddp.register(net, opt)
        return net, opt
    if setup == "DDP + AdamW + onebit_hook":
        state = fn.ddp.OnebitHookState(start_iter=freeze - 1)
        net.register_comm_hook(state, fn.ddp.onebit_hook)
    elif setup == "DDP + AdamW + loco_hook (4 bit)":
        state = fn.ddp.LocoHookState(bits=4, start_iter=freeze - 1)
        net.register_comm_hook(state, fn.ddp.loco_hook)
    return net, torch.optim.AdamW(model.parameters(), lr=1e-4)


def measure(rank: int, setup: str, args: dict) -> dict:
    """This rank's bytes over the run of ``setup``: in all, and in the warmup steps."""
    net, opt = build(setup, args["width"], args["layers"], args["freeze"])
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, args["width"], generator=gen) for _ in range(args["steps"])]
    torch.distributed.barrier()
    start = bytes_written()
    warmup = 0
    for t, x in enumerate(batches):
        if t == args["freeze"] - 1:
            warmup = bytes_written() - start
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    total = bytes_written() - start
    fn_bytes = opt.comm.bytes_sent if isinstance(opt, fn.optim.FunctionalOptimizer) else None
    return {"total": total, "warmup": warmup, "fn_counter": fn_bytes}


def worker(rank: int, world_size: int, send, setups: list[str], args: dict) -> list[dict]:
    del world_size, send
    return [measure(rank, setup, args) for setup in setups]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--freeze", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for the launch")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if not 1 < args.freeze <= args.steps:
        parser.error("--freeze must be in 2..--steps")
    config = {k: getattr(args, k) for k in ("width", "layers", "steps", "freeze")}
    numel = args.layers * (args.width * args.width + args.width)
    print(
        f"2 gloo ranks, MLP of {numel} fp32 params, {args.steps} steps, compressed from step "
        f"{args.freeze}; bytes written per rank (kernel count, rank 0)"
    )
    print(f"{'setup':36} {'total':>12} {'warmup':>12} {'compressed':>12} {'vs bare':>8}")
    ranks = spawn_gloo(
        worker, 2, (list(SETUPS), config), timeout=args.timeout, on_message=lambda r, m: None
    )
    results = []
    for index, setup in enumerate(SETUPS):
        row = {"setup": setup, **ranks[0][index], "ranks": [r[index] for r in ranks]}
        results.append(row)
        ratio = row["total"] / results[0]["total"]
        print(
            f"{setup:36} {row['total']:12d} {row['warmup']:12d} "
            f"{row['total'] - row['warmup']:12d} {ratio:8.3f}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"config": config, "results": results}, out, indent=1)
    return results


if __name__ == "__main__":
    main()
