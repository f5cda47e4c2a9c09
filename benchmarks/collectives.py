"""Wire traffic and wall time of the compressed allreduces against an fp32 allreduce.

W = 4 ranks, n = 2^22 fp32 values. Bytes are counted by the comms (per rank, the formulas in
fn/collectives/_traffic.py) on Simulated(W) and on W real processes; the wall time compares
the 1-bit (and 4-bit LoCo) allreduce with dist.all_reduce on the same data in those processes,
in steady state: after a warm-up call, every call writes into buffers made once
(``dist.all_reduce`` in place on a copy of the data; ``compressed_allreduce`` with ``out=``, its
errors updated in place; ``loco_allreduce`` with ``donate=True``, its mean written into a copy
of the data).

With ``--backend nccl`` every rank runs on its own GPU (rank r on cuda:r, its buffers there, the
kernels of the CUDA kernel set, default Triton), W = the GPU count unless ``--world`` says less,
and the timings wait for the GPUs (torch.cuda.synchronize) before each barrier.

Run: python3 benchmarks/collectives.py [--log2n 22] [--repeats 5]
     python3 benchmarks/collectives.py --backend nccl --log2n 26     # on a machine with GPUs
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# this script's folder is on sys.path when it runs
from cluster import tuning_anywhere  # noqa: E402

from fn.app.examples import positive_int  # noqa: E402
from fn.collectives import (  # noqa: E402
    ProcessGroup,
    Simulated,
    compressed_allreduce,
    init_error_feedback,
    loco_allreduce,
    replicate,
    simulate,
)

WORLD = 4
GROUP = 128
MAX_WARMUP = 30  # calls: one, then more while a CPU kernel tunes its first large calls


def counted_bytes(n: int, world: int = WORLD) -> dict[str, int]:
    """Per-rank bytes of one call of each allreduce on Simulated(world)."""
    comm = Simulated(world)
    x = torch.randn(world, n)
    simulate(lambda v: comm.all_reduce(v), comm)(x)
    out = {"fp32 ring all_reduce": comm.reset_bytes_sent()}
    we, se = replicate(init_error_feedback(n, comm=comm), comm)
    simulate(lambda v, a, b: compressed_allreduce(v, a, b, comm=comm), comm)(x, we, se)
    out["1-bit compressed_allreduce"] = comm.reset_bytes_sent()
    tx = loco_allreduce(4, GROUP, comm=comm)
    state = replicate(tx.init({"x": torch.zeros(n)}), comm)
    simulate(tx.update, comm)({"x": x}, state)
    out["4-bit loco_allreduce"] = comm.reset_bytes_sent()
    return out


def _timed(call, repeats, sync):
    """The median seconds of ``repeats`` calls after the warm-up (one call, then more while a
    CPU kernel on some rank is still tuning its first large calls, at most 30); the calls made."""
    calls = 0
    for _ in range(MAX_WARMUP):
        call()
        sync()
        calls += 1
        # device kernels (NCCL) tune nothing
        if dist.get_backend() != "gloo" or not tuning_anywhere():
            break
    times = []
    for _ in range(repeats):
        sync()
        dist.barrier()
        start = time.perf_counter()
        call()
        sync()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times), calls + repeats


def _worker(rank, world, backend, port, n, repeats, results):
    from fn.collectives import exit_distributed

    torch.set_num_threads(1)
    device, sync = torch.device("cpu"), lambda: None
    if backend == "nccl":
        device, sync = torch.device("cuda", rank), torch.cuda.synchronize
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group(
        backend,
        store=dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout),
        rank=rank,
        world_size=world,
        timeout=timeout,
        **({"device_id": device} if backend == "nccl" else {}),
    )
    comm = ProcessGroup()
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(device)
    buf, y = torch.empty_like(x), torch.empty_like(x)
    we, se = init_error_feedback(n, comm=comm, device=device)
    tx = loco_allreduce(4, GROUP, comm=comm)
    box = {"state": tx.init({"x": x})}

    def dense():
        buf.copy_(x)
        dist.all_reduce(buf)

    def onebit():
        compressed_allreduce(x, we, se, comm=comm, out=(y, we, se))

    def loco4():
        buf.copy_(x)
        _, box["state"] = tx.update({"x": buf}, box["state"], donate=True)

    out = {"dist.all_reduce": _timed(dense, repeats, sync)[0]}
    comm.reset_bytes_sent()
    out["1-bit compressed_allreduce"], calls = _timed(onebit, repeats, sync)
    out["1-bit bytes"] = comm.reset_bytes_sent() // calls
    out["4-bit loco_allreduce"], calls = _timed(loco4, repeats, sync)
    out["4-bit bytes"] = comm.reset_bytes_sent() // calls
    results.put((rank, out))
    results.close()
    results.join_thread()  # the result is in the pipe before the process ends
    exit_distributed()  # a finished rank must not abort in gloo's teardown at exit


def wall_times(n: int, repeats: int, world: int = WORLD, backend: str = "gloo") -> dict[str, float]:
    # the ranks meet at a store served here, on a port the kernel picks and this process holds
    # (one picked free and bound later by rank 0 could be taken in between)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world, backend, port, n, repeats, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outs = {}
    deadline = time.monotonic() + 600
    try:
        while len(outs) < world:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"rank {failed[0]} failed (its traceback is above)")
            if time.monotonic() > deadline:
                raise RuntimeError("the ranks did not finish within 600 s")
            try:
                rank, out = results.get(timeout=0.5)
            except queue.Empty:
                continue
            outs[rank] = out
    finally:
        for p in procs:
            p.join(timeout=30 if len(outs) == world else 0)  # a failed run: stop the others now
            if p.is_alive():
                p.kill()
                p.join()
    return outs[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2n", type=int, default=22, help="2^LOG2N fp32 per rank, 0..34")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument(
        "--world",
        type=positive_int,
        default=None,
        help="ranks (default: 4 for gloo, the GPUs for nccl)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.log2n <= 34:
        parser.error(f"--log2n must be within 0..34, got {args.log2n}")
    world = args.world or (torch.cuda.device_count() if args.backend == "nccl" else WORLD)
    if args.backend == "nccl" and not 1 <= world <= torch.cuda.device_count():
        parser.error(f"--backend nccl needs one GPU per rank; {torch.cuda.device_count()} here")
    if world < 2:
        parser.error(f"the collectives need at least 2 ranks to move bytes; got {world}")
    n = 2**args.log2n
    mib = 4 * n / 2**20
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
        f"{os.getloadavg()[0]:.2f}, THP_MEM_ALLOC_ENABLE="
        f"{os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}, torch {torch.__version__}"
    )
    print(f"W={world}, n=2^{args.log2n} fp32 ({mib:.0f} MiB per rank)")
    nbytes = counted_bytes(n, world)
    dense = nbytes["fp32 ring all_reduce"]
    for name, b in nbytes.items():
        print(f"  {name:28s} {b:>12,d} bytes sent per rank   fp32/this = {dense / b:7.3f}x")
    times = wall_times(n, args.repeats, world, args.backend)
    assert times["1-bit bytes"] == nbytes["1-bit compressed_allreduce"]
    assert times["4-bit bytes"] == nbytes["4-bit loco_allreduce"]
    print(f"{args.backend}, {world} processes, median of {args.repeats} calls (rank 0):")
    base = times["dist.all_reduce"]
    for name in ("dist.all_reduce", "1-bit compressed_allreduce", "4-bit loco_allreduce"):
        t = times[name]
        print(f"  {name:28s} {1e3 * t:9.1f} ms   time / dist.all_reduce = {t / base:5.2f}")


if __name__ == "__main__":
    main()
