"""Bytes per rank sent by DDP training setups, counted by the kernel, not by fn.

Two gloo ranks train the same model for ``--steps`` steps: an MLP of ``--layers`` square
``--width`` layers whose forward returns ``{"loss": mean square of the output}`` (the output
shape a Hugging Face ``Trainer`` trains), batches of 8 random rows per rank. 1-bit Adam has
``freeze_step=--freeze`` (``--freeze - 1`` dense warmup steps, then compressed ones) and the
hooks the same number of dense iterations (``start_iter=--freeze - 1``). One launch: the setups
run one after the other, each with its own model:

- ``fn OnebitAdam (no DDP)``: the bare ``fn.optim.OnebitAdam`` (it averages the gradients
  itself); the reference of the ``vs bare`` column;
- ``DDP + fn.ddp.register(OnebitAdam)``;
- ``Trainer + attach(OnebitAdam)``: ``transformers.Trainer`` (``use_cpu=True``, default
  arguments otherwise: DDP with ``find_unused_parameters=True``, gradient clipping at 1.0, no
  logging within the run) with ``fn.integrations.transformers.attach``;
- ``Accelerate + attach(OnebitAdam)``: an ``Accelerator(cpu=True)`` loop (the prepared model,
  optimizer and data loader) with ``fn.integrations.accelerate.attach``;
- ``DDP + AdamW (dense)``: DDP's own allreduce;
- ``DDP + AdamW + onebit_hook`` and ``DDP + AdamW + loco_hook (4 bit)``: the hooks overlapped
  with the backward pass (their default), and the same ``(no overlap)``
  (``overlap=False``: each bucket compressed inside the hook).

Bytes are what each rank process wrote from the start of the first step (its forward) to the
end of the last one (its optimizer step), ``wchar`` of ``/proc/self/io``: every ``write`` /
``writev`` on gloo's sockets, the TCP store included. Counted: the gradient traffic, fn's 1-bit
allreduce and whatever else a setup does per step (Trainer's collectives, DDP's per-iteration
bookkeeping). Not counted: one-time setup before the first step (DDP's broadcast of the initial
weights, Trainer/Accelerate start-up barriers and data loader seeding) and Trainer's end-of-run
work. fn's own byte counter is not used (it is printed alongside, for fn's collectives only).
``warmup`` is the part before step ``--freeze - 1``, ``compressed`` the rest.

Step time: rank 0's median wall time of one compressed step (from ``zero_grad`` to the end of
``optimizer.step()``, steps ``--freeze`` on), for the plain-loop setups (Trainer and Accelerate
are not timed), and ``dense/this``, the dense setup's over this one's, measured in the same run.
Without ``--rate`` the ranks talk over this machine's loopback, so step times say little about
a network. ``--rate 1gbit`` (root, ``ip`` and ``tc``) runs each rank in its own network
namespace behind a link of that rate both ways, through ``benchmarks/cluster.py``'s
``namespace_cluster`` (its cleanup: also on errors, timeouts and Ctrl-C; ``sudo python3
benchmarks/cluster.py --cleanup --prefix fnddp`` removes what a killed run left). Both ranks
share this machine's CPUs, so compute-bound steps are pessimistic and overlap has only the
cores that the other rank leaves.

Trainer's small excess over the bare loop is DDP's allreduce of its used-parameter map, which
DDP runs every step under ``find_unused_parameters=True`` (Trainer's default for a model that is
not a ``PreTrainedModel``; ``ddp_find_unused_parameters=False`` removes it and the row then equals
the bare one): a few hundred bytes per step, whatever the model size. With batches that carry
``labels`` (e.g. a GPT-2), Trainer also gathers the label count every step
(``average_tokens_across_devices``, on by default), another collective of one number per step.

Gloo sends a few hundred bytes per collective besides the data, which dominates tiny models;
the 1.05x comparison of issue 16 needs gradient bytes to dominate (about 4M params or more):

    python3 benchmarks/ddp.py --width 1024 --layers 4 --steps 40 --freeze 10

The default run (``--width 256``, 40 steps) takes a minute or two on 2 CPU cores.

Run: python3 benchmarks/ddp.py [--width 256] [--layers 4] [--steps 40] [--freeze 10]
     [--setups NAME ...] [--json FILE]
     sudo python3 benchmarks/ddp.py --rate 1gbit --width 1024 --layers 8 --steps 30 \\
         --freeze 5 --setups "DDP + AdamW (dense)" "DDP + AdamW + onebit_hook" \\
         "DDP + AdamW + onebit_hook (no overlap)" "DDP + AdamW + loco_hook (4 bit)" \\
         "DDP + AdamW + loco_hook (4 bit, no overlap)"   (step times at 1 Gbit/s, 8.4M params)
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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# this script's folder is on sys.path when it runs
import cluster  # noqa: E402

import fn  # noqa: E402
import fn.ddp  # noqa: E402
import fn.optim  # noqa: E402
from fn.app.launch import spawn_gloo  # noqa: E402

BARE = "fn OnebitAdam (no DDP)"
TRAINER = "Trainer + attach(OnebitAdam)"
ACCELERATE = "Accelerate + attach(OnebitAdam)"
SETUPS = (
    BARE,
    "DDP + fn.ddp.register(OnebitAdam)",
    TRAINER,
    ACCELERATE,
    "DDP + AdamW (dense)",
    "DDP + AdamW + onebit_hook",
    "DDP + AdamW + onebit_hook (no overlap)",
    "DDP + AdamW + loco_hook (4 bit)",
    "DDP + AdamW + loco_hook (4 bit, no overlap)",
)
DENSE = "DDP + AdamW (dense)"
# The stacks a setup needs beyond torch (an optional extra of fn).
NEEDS = {TRAINER: ("transformers", "accelerate"), ACCELERATE: ("accelerate",)}
BATCH = 8
LR = 1e-4


def missing(setup: str) -> list[str]:
    """The packages ``setup`` needs that are not installed."""
    return [name for name in NEEDS.get(setup, ()) if importlib.util.find_spec(name) is None]


def bytes_written() -> int:
    """What this process has written so far, sockets included (the kernel's count)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


class LossMLP(torch.nn.Module):
    """``layers`` square linear layers; ``forward(x)`` returns ``{"loss": mean(mlp(x)^2)}``."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.mlp(x).square().mean()}


class RandomRows(torch.utils.data.Dataset):
    """``size`` fixed random rows of ``width``, as ``{"x": row}`` items."""

    def __init__(self, size: int, width: int, seed: int) -> None:
        self.rows = torch.randn(size, width, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.rows[i]}


class Meter:
    """Bytes written from :meth:`start` (before step 0) on; ``warmup`` is marked before step
    ``freeze - 1``. :meth:`timed` steps: the wall time of each compressed one."""

    def __init__(self, freeze: int) -> None:
        self.freeze = freeze
        self.begin = self.warmup = self.total = 0
        self.times: list[float] = []

    def timed(self, step: int, run) -> None:
        start = time.perf_counter()
        run()
        if step >= self.freeze:
            self.times.append(time.perf_counter() - start)

    def before_step(self, step: int) -> None:
        if step == 0:
            self.begin = bytes_written()
        if step == self.freeze - 1:
            self.warmup = bytes_written() - self.begin

    def stop(self) -> None:
        self.total = bytes_written() - self.begin

    def result(self, opt: torch.optim.Optimizer) -> dict:
        inner = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer
        fn_bytes = (
            inner.comm.bytes_sent if isinstance(inner, fn.optim.FunctionalOptimizer) else None
        )
        step_s = statistics.median(self.times) if self.times else None
        return {
            "total": self.total,
            "warmup": self.warmup,
            "fn_counter": fn_bytes,
            "step_s": step_s,
        }


def build(setup: str, width: int, layers: int, freeze: int) -> tuple:
    """``(model to call, optimizer)`` of a plain-loop ``setup``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = LossMLP(width, layers)
    if setup == BARE:
        return model, fn.optim.OnebitAdam(model.parameters(), lr=LR, freeze_step=freeze)
    net = DDP(model)
    if setup == "DDP + fn.ddp.register(OnebitAdam)":
        opt = fn.optim.OnebitAdam(model.parameters(), lr=LR, freeze_step=freeze)
        fn.ddp.register(net, opt)
        return net, opt
    overlap = not setup.endswith("no overlap)")
    if setup.startswith("DDP + AdamW + onebit_hook"):
        state = fn.ddp.OnebitHookState(start_iter=freeze - 1, overlap=overlap)
        net.register_comm_hook(state, fn.ddp.onebit_hook)
    elif setup.startswith("DDP + AdamW + loco_hook"):
        state = fn.ddp.LocoHookState(bits=4, start_iter=freeze - 1, overlap=overlap)
        net.register_comm_hook(state, fn.ddp.loco_hook)
    return net, torch.optim.AdamW(model.parameters(), lr=LR)


def measure_loop(rank: int, setup: str, args: dict) -> dict:
    """This rank's bytes over a plain training loop of ``setup``."""
    net, opt = build(setup, args["width"], args["layers"], args["freeze"])
    data = RandomRows(BATCH * args["steps"], args["width"], seed=rank)
    meter = Meter(args["freeze"])

    def step(t: int) -> None:
        opt.zero_grad()
        net(data.rows[t * BATCH : (t + 1) * BATCH])["loss"].backward()
        opt.step()

    for t in range(args["steps"]):
        meter.before_step(t)
        meter.timed(t, lambda t=t: step(t))
    meter.stop()
    return meter.result(opt)


def measure_trainer(args: dict) -> dict:
    """This rank's bytes over ``Trainer.train()``, counted by a callback."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fn.integrations.transformers import attach

    meter = Meter(args["freeze"])

    class Count(TrainerCallback):
        def on_step_begin(self, training_args, state, control, **kwargs):
            meter.before_step(state.global_step)

        def on_step_end(self, training_args, state, control, **kwargs):
            if state.global_step == state.max_steps:
                meter.stop()

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            max_steps=args["steps"],
            per_device_train_batch_size=BATCH,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
        )
        training_args.device  # noqa: B018 (joins the process group before the optimizer exists)
        model = LossMLP(args["width"], args["layers"])
        opt = fn.optim.OnebitAdam(model.parameters(), lr=LR, freeze_step=args["freeze"])
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        data = RandomRows(2 * BATCH * args["steps"], args["width"], seed=0)
        trainer = Trainer(
            model=model, args=training_args, train_dataset=data, optimizers=(opt, scheduler)
        )
        attach(trainer)
        trainer.add_callback(Count())
        trainer.train()
    return meter.result(opt)


def measure_accelerate(args: dict) -> dict:
    """This rank's bytes over an ``accelerate`` loop."""
    from accelerate import Accelerator

    from fn.integrations.accelerate import attach

    accelerator = Accelerator(cpu=True)
    model = LossMLP(args["width"], args["layers"])
    opt = fn.optim.OnebitAdam(model.parameters(), lr=LR, freeze_step=args["freeze"])
    loader = torch.utils.data.DataLoader(
        RandomRows(2 * BATCH * args["steps"], args["width"], seed=0), batch_size=BATCH
    )
    model, opt, loader = accelerator.prepare(model, opt, loader)
    attach(accelerator, model, opt)
    meter = Meter(args["freeze"])
    for t, batch in enumerate(loader):
        meter.before_step(t)
        accelerator.backward(model(**batch)["loss"])
        opt.step()
        opt.zero_grad()
    meter.stop()
    return meter.result(opt)


def worker(rank: int, world_size: int, send, setups: list[str], args: dict) -> list[dict]:
    del send
    # what torchrun would set: Trainer and Accelerate read the process group's shape from it
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
    )
    results = []
    for setup in setups:
        if setup == TRAINER:
            results.append(measure_trainer(args))
        elif setup == ACCELERATE:
            results.append(measure_accelerate(args))
        else:
            results.append(measure_loop(rank, setup, args))
        torch.distributed.barrier()
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--freeze", type=int, default=10)
    parser.add_argument(
        "--setups",
        nargs="+",
        choices=SETUPS,
        default=list(SETUPS),
        metavar="SETUP",
        help=f"which setups (default: all; {BARE!r} always runs first)",
    )
    parser.add_argument("--timeout", type=float, default=1200, help="seconds for the launch")
    parser.add_argument("--json", help="also write the results to this file")
    cluster.add_link_arguments(parser, prefix="fnddp", subnet="10.215.0")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        config = json.loads(args.worker)
        rank, world_size = config["rank"], config["world_size"]
        cluster.serve_rank(
            config, lambda: worker(rank, world_size, None, config["setups"], config["args"])
        )
        return []
    if not 1 < args.freeze <= args.steps:
        parser.error("--freeze must be in 2..--steps")
    cluster.check_link_arguments(parser, args)
    setups = [BARE] + [s for s in SETUPS if s in args.setups and s != BARE]
    for setup in setups:
        if absent := missing(setup):
            parser.error(
                f"{setup!r} needs {', '.join(absent)} (pip install 'fn-optim[integrations]')"
            )
    config = {k: getattr(args, k) for k in ("width", "layers", "steps", "freeze")}
    numel = args.layers * (args.width * args.width + args.width)
    links = f"links at {args.rate}" if args.rate else "local gloo"
    print(
        f"2 gloo ranks ({links}), MLP of {numel} fp32 params, {args.steps} steps, compressed "
        f"from step {args.freeze}, {datetime.date.today()}; bytes written per rank (kernel "
        "count, rank 0); step: median ms of a compressed step (rank 0)"
    )
    if args.rate is None:
        ranks = spawn_gloo(
            worker, 2, (setups, config), timeout=args.timeout, on_message=lambda r, m: None
        )
    else:
        cluster.check_host("benchmarks/ddp.py --rate", hint="; run without --rate for local gloo")
        ranks = {"setups": setups, "args": config, "rate": args.rate, "timeout": args.timeout}
        ranks = cluster.run_on_links(
            args.prefix, args.subnet, [{**ranks, "world_size": 2}], args.timeout, __file__
        )
    print(
        f"{'setup':44} {'total':>12} {'warmup':>12} {'compressed':>12} {'vs bare':>8} "
        f"{'step ms':>8} {'dense/this':>10}"
    )
    results = []
    dense_s = next((r["step_s"] for s, r in zip(setups, ranks[0], strict=True) if s == DENSE), None)
    for index, setup in enumerate(setups):
        row = {"setup": setup, **ranks[0][index], "ranks": [r[index] for r in ranks]}
        results.append(row)
        ratio = row["total"] / results[0]["total"]
        step = "" if row["step_s"] is None else f"{1e3 * row['step_s']:8.1f}"
        speedup = "" if dense_s is None or not step else f"{dense_s / row['step_s']:10.2f}"
        print(
            f"{setup:44} {row['total']:12d} {row['warmup']:12d} "
            f"{row['total'] - row['warmup']:12d} {ratio:8.3f} {step:>8} {speedup:>10}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"config": {**config, "rate": args.rate}, "results": results}, out, indent=1)
    return results


if __name__ == "__main__":
    main()
