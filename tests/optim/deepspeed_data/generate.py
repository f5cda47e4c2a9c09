"""Generates the DeepSpeed 0.18.9 reference data of tests/optim/test_deepspeed.py.

Runs DeepSpeed's own ``OnebitAdam``, ``ZeroOneAdam`` and ``OnebitLamb`` on CPU with gloo (2
ranks, no engine: the engine's gradient averaging is emulated from the optimizers'
``enable_backward_allreduce`` flag, as the engine reads it) on a tiny quadratic model, and
DeepSpeed's LR schedulers on a dummy optimizer. DeepSpeed 0.18.9 ships no CPU packbits kernel: a
numpy one (the semantics of its XPU kernel: bit 1 unless the sign bit is set, most significant
bit first) is plugged into its ``CompressedBackend``.

For every optimizer and two checkpoint updates ``k`` (one in the warmup, one in the compressed
phase) one run of ``steps`` real updates is recorded: DeepSpeed's optimizer ``state_dict()`` of
rank 0 after update ``k`` (what its engine checkpoints), and every rank's params after every
update, with the error feedback zeroed on every rank right after update ``k`` (as DeepSpeed's
``load_state_dict`` zeroes it). DeepSpeed's first ``step()`` is its gradient-dropping init step;
it gets gradient index 0, real update ``t`` gets index ``t``.

Regenerate (needs DeepSpeed 0.18.9 in a venv that sees the machine's torch; about a minute)::

    python3 -m venv --system-site-packages /work/wt/dsvenv
    DS_BUILD_OPS=0 /work/wt/dsvenv/bin/pip install --no-build-isolation deepspeed==0.18.9
    DS_ACCELERATOR=cpu /work/wt/dsvenv/bin/python tests/optim/deepspeed_data/generate.py

It writes ``optimizers.pt`` and ``schedulers.pt`` beside this file (plain containers and
tensors: ``torch.load(..., weights_only=True)`` reads them).
"""

from __future__ import annotations

import copy
import os
import socket
import sys
import tempfile
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
WORLD = 2
# 24 + 6 + 18 = 48 elements: 1-bit LAMB's fused buffer needs no padding for 2 ranks (16 | 48),
# where DeepSpeed's padding bug does not show (docs/algorithms.md, "Deviations from DeepSpeed")
SHAPES = [(4, 6), (6,), (3, 6)]
CASES = [
    # name, DeepSpeed optimizer block, real updates, checkpoint updates
    (
        "onebit_adam",
        {
            "type": "OneBitAdam",
            "params": {"lr": 0.01, "freeze_step": 4, "weight_decay": 0.01, "cuda_aware": False},
        },
        10,
        (2, 6),
    ),
    (
        "zero_one_adam",
        {
            "type": "ZeroOneAdam",
            "params": {
                "lr": 0.01,
                "var_freeze_step": 6,
                "var_update_scaler": 2,
                "local_step_scaler": 2,
                "local_step_clipper": 4,
                "cuda_aware": False,
            },
        },
        14,
        (4, 9),
    ),
    (
        "onebit_lamb",
        {
            "type": "OneBitLamb",
            "params": {"lr": 0.01, "freeze_step": 4, "weight_decay": 0.01, "max_coeff": 0.3},
        },
        10,
        (2, 6),
    ),
]
SCHEDULERS = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5}),
    (
        "WarmupLR",
        {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 0.02,
            "warmup_num_steps": 6,
            "warmup_type": "linear",
        },
    ),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_max_lr": 0.01, "warmup_num_steps": 4}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 12,
            "warmup_min_ratio": 0.1,
            "warmup_num_steps": 4,
            "cos_min_ratio": 0.05,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.001,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 4,
            "cycle_second_step_size": 3,
            "decay_lr_rate": 0.5,
            "decay_step_size": 2,
            "decay_mom_rate": 0.1,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.001,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 3,
            "cycle_first_stair_count": 2,
            "cycle_momentum": False,
        },
    ),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3}),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 0.002,
            "lr_range_test_step_size": 2,
            "lr_range_test_step_rate": 0.5,
            "lr_range_test_staircase": True,
        },
    ),
]
SCHEDULER_STEPS = 16


class NumpyPacker:
    """A CPU packbits kernel for DeepSpeed's ``CompressedBackend`` (its XPU kernel's rules)."""

    @staticmethod
    def packbits(tensor, numel, rank):
        del rank
        bits = ~numpy.signbit(tensor.detach().reshape(-1)[:numel].numpy())
        return torch.from_numpy(numpy.packbits(bits))

    @staticmethod
    def unpackbits(tensor, numel, rank):
        del rank
        bits = numpy.unpackbits(tensor.reshape(-1)[:numel].numpy())
        return torch.from_numpy(bits.astype(numpy.float32) * 2 - 1)


class NumpyPackbitsBuilder:
    def load(self):
        return NumpyPacker()


def gloo_all_gather(all_gather):
    """DeepSpeed gathers 0-dim scales into 1-element buffers; NCCL accepts that, gloo wants the
    same shape."""

    def wrapped(tensor_list, tensor, *args, **kwargs):
        return all_gather(tensor_list, tensor.reshape(tensor_list[0].shape), *args, **kwargs)

    return wrapped


class FakeEngine:
    """What DeepSpeed's 1-bit optimizers read from their engine."""

    mpu = None
    local_rank = 0

    def __init__(self):
        self.enable_backward_allreduce = True


def problem(steps: int, seed: int):
    """Initial params, per-rank targets and per-rank gradient noise (index 0: the init step)."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    targets = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(WORLD)]
    noise = [
        [[0.3 * torch.randn(s, generator=gen) for s in SHAPES] for _ in range(WORLD)]
        for _ in range(steps + 1)
    ]
    return init, targets, noise


def gradient(p: torch.Tensor, target: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The gradient of the rank's loss ``0.5 ||p - target||^2 + <noise, p>``."""
    return (p - target) + noise


def zero_errors(opt) -> None:
    for state in opt.state.values():
        for key in ("worker_error", "server_error"):
            if key in state:
                state[key].zero_()
    for errors in (getattr(opt, "worker_errors", []), getattr(opt, "server_errors", [])):
        for e in errors:
            e.zero_()


def run_case(rank, name, block, steps, checkpoint, seed):
    import deepspeed.runtime.fp16.onebit as onebit

    cls = {"onebit_adam": onebit.OnebitAdam, "zero_one_adam": onebit.ZeroOneAdam}.get(
        name, onebit.OnebitLamb
    )
    init, targets, noise = problem(steps, seed)
    params = [torch.nn.Parameter(x.clone()) for x in init]
    engine = FakeEngine()
    hyper = dict(block["params"], comm_backend_name="compressed")
    opt = cls(params, engine, **hyper)
    trajectory, record = [], {}
    for t in range(steps + 1):
        for p, c, n in zip(params, targets[rank], noise[t][rank], strict=True):
            p.grad = gradient(p.detach(), c, n)
            if engine.enable_backward_allreduce:
                dist.all_reduce(p.grad)
                p.grad.mul_(1.0 / WORLD)
        opt.step()
        if t == 0:
            continue
        trajectory.append([p.detach().clone() for p in params])
        if t == checkpoint:
            record = {
                "state_dict": copy.deepcopy(opt.state_dict()),
                "params": [p.detach().clone() for p in params],
            }
            zero_errors(opt)
    return trajectory, record


def worker(rank, port, folder):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    import deepspeed.comm
    import deepspeed.runtime.comm.compressed as compressed

    compressed.PackbitsBuilder = NumpyPackbitsBuilder
    dist.all_gather = gloo_all_gather(dist.all_gather)
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    results = []
    for seed, (name, block, steps, checkpoints) in enumerate(CASES):
        for k in checkpoints:
            trajectory, record = run_case(rank, name, block, steps, k, seed)
            results.append((name, k, trajectory, record))
    torch.save(results, Path(folder) / f"rank{rank}.pt")


def scheduler_reference():
    from deepspeed.runtime import lr_schedules

    out = []
    for kind, params in SCHEDULERS:
        opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.005, betas=(0.9, 0.999))
        sched = getattr(lr_schedules, kind)(opt, **params)
        lrs, betas = [opt.param_groups[0]["lr"]], [opt.param_groups[0]["betas"]]
        for _ in range(SCHEDULER_STEPS):
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
            betas.append(opt.param_groups[0]["betas"])
        out.append({"type": kind, "params": params, "lr": lrs, "betas": betas})
    return out


def main() -> None:
    import deepspeed

    assert deepspeed.__version__ == "0.18.9", deepspeed.__version__
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=worker, args=(r, port, folder)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            if p.exitcode != 0:
                sys.exit(f"a worker failed with exit code {p.exitcode}")
        by_rank = [torch.load(Path(folder) / f"rank{r}.pt") for r in range(WORLD)]
    runs = []
    for index, (name, k, _, record) in enumerate(by_rank[0]):
        seed = next(i for i, case in enumerate(CASES) if case[0] == name)
        _, block, steps, _ = CASES[seed]
        init, targets, noise = problem(steps, seed)
        other = by_rank[1][index][3]
        for a, b in zip(record["params"], other["params"], strict=True):
            # rank 0's checkpoint stands for both ranks only where their params agree (0/1 Adam:
            # at a synchronization, up to the rounding of its accumulator)
            assert torch.allclose(a, b, rtol=0, atol=1e-6), (name, k)
        runs.append(
            {
                "name": name,
                "config": {"optimizer": block},
                "checkpoint_step": k,
                "steps": steps,
                "init": init,
                "targets": targets,
                "noise": noise,
                "state_dict": record["state_dict"],
                "params_at_checkpoint": record["params"],
                # [update t - 1][rank][leaf]: every rank's params after real update t
                "trajectory": [
                    [by_rank[r][index][2][t] for r in range(WORLD)] for t in range(steps)
                ],
            }
        )
    torch.save(
        {"deepspeed": deepspeed.__version__, "world_size": WORLD, "runs": runs},
        HERE / "optimizers.pt",
    )
    torch.save(
        {"deepspeed": deepspeed.__version__, "schedulers": scheduler_reference()},
        HERE / "schedulers.pt",
    )
    print("wrote", HERE / "optimizers.pt", HERE / "schedulers.pt")


if __name__ == "__main__":
    main()
