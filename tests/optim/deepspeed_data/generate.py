"""Generates the DeepSpeed 0.18.9 reference data of tests/optim/test_deepspeed.py.

Runs DeepSpeed's own ``OnebitAdam``, ``ZeroOneAdam`` and ``OnebitLamb`` on CPU with gloo (2 and
4 ranks, no engine: the engine's gradient averaging is emulated from the optimizers'
``enable_backward_allreduce`` flag, as the engine reads it) on a tiny quadratic model, and
DeepSpeed's LR schedulers on a dummy optimizer. DeepSpeed 0.18.9 ships no CPU packbits kernel: a
numpy one (the semantics of its XPU kernel: bit 1 unless the sign bit is set, most significant
bit first) is plugged into its ``CompressedBackend``.

For every world size, optimizer and checkpoint update ``k`` (in the warmup and in the compressed
phase; for 0/1 Adam also after a local step, where the ranks' params and momenta differ by
design) one run of ``steps`` real updates is recorded: EVERY rank's optimizer ``state_dict()``
and params after update ``k`` (DeepSpeed's engine checkpoints rank 0's), and every rank's params
after every later update, with the error feedback zeroed on every rank right after update ``k``
(as DeepSpeed's ``load_state_dict`` zeroes it). DeepSpeed's first ``step()`` is its
gradient-dropping init step; it gets gradient index 0, real update ``t`` gets index ``t``.

Regenerate (needs DeepSpeed 0.18.9 in a venv that sees the machine's torch; a few minutes)::

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
# The leaf shapes per world size. DeepSpeed pads 1-bit LAMB's fused buffer to a multiple of
# 16 elements for 2 ranks and of 32 for 4; only without that padding does its padding bug not
# show (docs/algorithms.md, "Deviations from DeepSpeed"): 24 + 6 + 18 = 48 for 2 ranks and
# 24 + 8 + 64 = 96 for 4. 1-bit and 0/1 Adam pad each leaf on its own, which fn reproduces:
# with 4 ranks two leaves are padded (24 and 8 to 32) and one is not.
SHAPES = {2: [(4, 6), (6,), (3, 6)], 4: [(4, 6), (8,), (8, 8)]}
CASES = [
    # name, DeepSpeed optimizer block, real updates, {checkpoint update: its kind}; the kinds:
    # "warmup", "compressed", and for 0/1 Adam "sync" and "local" (its variance freezes after
    # update 6; it then syncs at updates 7, 8, 9 and 11 and steps locally at 10, 12, 13 and 14)
    (
        "onebit_adam",
        {
            "type": "OneBitAdam",
            "params": {"lr": 0.01, "freeze_step": 4, "weight_decay": 0.01, "cuda_aware": False},
        },
        10,
        {2: "warmup", 6: "compressed"},
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
        {4: "warmup", 9: "sync", 10: "local"},
    ),
    (
        "onebit_lamb",
        {
            "type": "OneBitLamb",
            "params": {"lr": 0.01, "freeze_step": 4, "weight_decay": 0.01, "max_coeff": 0.3},
        },
        10,
        {2: "warmup", 6: "compressed"},
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


def problem(world: int, steps: int, seed: int):
    """Initial params, per-rank targets and per-rank gradient noise (index 0: the init step)."""
    shapes = SHAPES[world]
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in shapes]
    targets = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(world)]
    noise = [
        [[0.3 * torch.randn(s, generator=gen) for s in shapes] for _ in range(world)]
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


def run_case(rank, world, name, block, steps, checkpoint, seed):
    import deepspeed.runtime.fp16.onebit as onebit

    cls = {"onebit_adam": onebit.OnebitAdam, "zero_one_adam": onebit.ZeroOneAdam}.get(
        name, onebit.OnebitLamb
    )
    init, targets, noise = problem(world, steps, seed)
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
                p.grad.mul_(1.0 / world)
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


def worker(rank, world, port, folder):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
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
            trajectory, record = run_case(rank, world, name, block, steps, k, seed)
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


def run_world(world: int) -> list[list]:
    """Every rank's ``(name, k, trajectory, record)`` per run, indexed by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=worker, args=(r, world, port, folder)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=900)
            if p.exitcode != 0:
                sys.exit(f"a worker failed with exit code {p.exitcode}")
        return [torch.load(Path(folder) / f"rank{r}.pt") for r in range(world)]


def ranks_agree(params_by_rank) -> bool:
    """Whether every rank's params equal rank 0's (0/1 Adam at a sync: up to the rounding of its
    accumulator)."""
    return all(
        torch.allclose(a, b, rtol=0, atol=1e-6)
        for other in params_by_rank[1:]
        for a, b in zip(params_by_rank[0], other, strict=True)
    )


def by_leaf(nested):
    """``nested[i][rank][leaf]`` as one tensor per leaf, indexed ``[i, rank]``."""
    return [
        torch.stack([torch.stack([x[j] for x in row]) for row in nested])
        for j in range(len(nested[0][0]))
    ]


def packed(tree):
    """``tree`` with every tensor a view of one flat buffer per dtype (tensors that ``tree``
    shares stay shared). ``torch.save`` writes one zip record per storage, a few hundred bytes
    of headers, more than most of these tiny tensors hold: packed, the file is mostly data."""
    unique = {}

    def collect(x):
        if isinstance(x, torch.Tensor):
            unique.setdefault(id(x), x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(tree)
    views = {}
    for dtype in {t.dtype for t in unique.values()}:
        tensors = [t for t in unique.values() if t.dtype == dtype]
        buffer = torch.cat([t.detach().reshape(-1) for t in tensors])
        for t, flat in zip(tensors, buffer.split([t.numel() for t in tensors]), strict=True):
            views[id(t)] = flat.view(t.shape)

    def rebuild(x):
        if isinstance(x, torch.Tensor):
            return views[id(x)]
        if isinstance(x, dict):
            return {k: rebuild(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(rebuild(v) for v in x)
        return x

    return rebuild(tree)


def main() -> None:
    import deepspeed

    assert deepspeed.__version__ == "0.18.9", deepspeed.__version__
    runs = []
    for world in sorted(SHAPES):
        by_rank = run_world(world)
        problems = {}  # one copy per world size and case: torch.save stores shared tensors once
        for index, (name, k, _, _) in enumerate(by_rank[0]):
            seed = next(i for i, case in enumerate(CASES) if case[0] == name)
            _, block, steps, kinds = CASES[seed]
            if name not in problems:
                init, targets, noise = problem(world, steps, seed)
                problems[name] = init, targets, by_leaf(noise)
            init, targets, noise = problems[name]
            records = [by_rank[r][index][3] for r in range(world)]
            params = [record["params"] for record in records]
            # a single-file checkpoint (rank 0's) stands for every rank except after a local step
            assert ranks_agree(params) == (kinds[k] != "local"), (world, name, k)
            runs.append(
                {
                    "name": name,
                    "world_size": world,
                    "config": {"optimizer": block},
                    "checkpoint_step": k,
                    "checkpoint_kind": kinds[k],
                    "steps": steps,
                    "init": init,  # [leaf]
                    "targets": targets,  # [rank][leaf]
                    # [leaf], indexed [t, rank]: the noise of the gradient of update t (t = 0:
                    # the init step) on the rank
                    "noise": noise,
                    # [rank]: every rank's optimizer state dict and params after update k
                    "state_dicts": [record["state_dict"] for record in records],
                    "params_at_checkpoint": params,
                    # [leaf], indexed [t - k - 1, rank]: the rank's params after update t > k
                    "trajectory": by_leaf(
                        [
                            [by_rank[r][index][2][t - 1] for r in range(world)]
                            for t in range(k + 1, steps + 1)
                        ]
                    ),
                }
            )
    torch.save({"deepspeed": deepspeed.__version__, "runs": packed(runs)}, HERE / "optimizers.pt")
    torch.save(
        {"deepspeed": deepspeed.__version__, "schedulers": scheduler_reference()},
        HERE / "schedulers.pt",
    )
    print("wrote", HERE / "optimizers.pt", HERE / "schedulers.pt")


if __name__ == "__main__":
    main()
