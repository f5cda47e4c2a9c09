"""Throughput of the fn.kernels ops next to numpy.packbits, the read bandwidth of x.sum(), the
write bandwidth of out.fill_(1) and, on accelerators, the copy bandwidth of y.copy_(x).

Usage:
    python3 benchmarks/kernels.py                       # CPU, 2^20 .. 2^26 elements
    python3 benchmarks/kernels.py --sizes 24 26 --repeat 9 --threads 1
    python3 benchmarks/kernels.py --device cuda --sizes 24 26 28
    python3 benchmarks/kernels.py --device cuda --sizes 28 --kernels cupy   # another kernel set

Throughput is GB/s of fp32 data: 4 bytes x n elements per call (8 bytes x n for
sign_compress with error, whose input is m and e; for unpackbits and dequantize the n fp32
outputs). The copy row counts the bytes the copy moves (read and write, 8 bytes x n): the
device's copy bandwidth. Every number is the median of --repeat timed calls after one warm-up
call (more while a CPU kernel still times its prefetch distances on its first large calls: see
fn.kernels.tuning_pending), all measured in this run.

The "donated" rows are the steady-state forms of the 1-bit allreduce (buffers reused, nothing
full-size allocated): sign compression with error feedback in its two phases
(feedback_sign_compress, then feedback_apply_error in place into the error), the same with the
momentum beta * m + (1 - beta) * g computed inside (input m, g, e), and unpackbits into a
buffer (unpack_scaled with scale 1, as the allreduce writes its output).

The sums over ranks (dequantize_sum, sign_sum_compress) reduce 4 ranks' rows into n values;
adamw_step counts the 16 bytes of p, g, m and v per element.

Targets: CPU sign_compress >= 1.5x numpy.packbits(x >= 0) at 2^26; on CUDA (and other
accelerators) packbits and sign_compress >= 50% of the copy bandwidth at 2^28. At the largest
size of the run: the donated sign_compress + error within 1.5x of the time of three x.sum()
read passes over its n-element input; packbits at >= 80% of the read bandwidth (x.sum(): 4n
bytes read) and the donated unpackbits at >= 80% of the write bandwidth (out.fill_(1): 4n
bytes written), each as the rate of the fp32 side (4n bytes) over that bandwidth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fn.kernels as K  # noqa: E402
from fn.app.examples import positive_int  # noqa: E402
from fn.kernels import _reference  # noqa: E402

_COPY = "y.copy_(x) (copy bandwidth)"
_READ = "x.sum() (read bandwidth)"
_WRITE = "out.fill_(1) (write bandwidth)"
_DONATED_EF = "sign_compress + error, donated"
_DONATED_UNPACK = "unpackbits into out, donated"
_RANKS = 4  # the ranks of the sums over ranks
_TARGET_LOG2 = 28  # the accelerator target's size: 1 GiB of fp32
MAX_WARMUP = 30


def _median_seconds(fn: Callable[[], object], repeat: int, sync: Callable[[], None]) -> float:
    for _ in range(MAX_WARMUP):  # one call, and more while a CPU kernel tunes its large calls
        fn()
        sync()
        if not K.tuning_pending():
            break
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cases(x: torch.Tensor, e: torch.Tensor, group_size: int, reference: bool):
    n = x.numel()
    packed = K.packbits(x)
    codes, scales = K.quantize(x, 4, group_size)
    out, error, grad = torch.empty_like(x), e.clone(), torch.randn_like(x)
    one = torch.ones(1, device=x.device)

    rank_codes = (*K.quantize(x.repeat(_RANKS), 4, group_size), 4, _RANKS)
    signs = K.packbits(x.repeat(_RANKS)).view(_RANKS, -1)
    weights = torch.rand(_RANKS, device=x.device)
    p, m, v = x.clone(), torch.zeros_like(x), torch.zeros_like(x)
    adamw = {"step": 3, "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}

    def donated_sign_sum():
        _, scale = K.sign_sum_compress(signs, weights, error)
        K.sign_sum_apply_error(signs, weights, error, scale, error)

    def adamw_step():
        K.adamw_step([p], [grad], [m], [v], **adamw)

    def donated_sign_compress(g=None):
        _, scale = K.feedback_sign_compress(x, error, grad=g, beta=0.9)
        K.feedback_apply_error(x, error, scale, error, grad=g, beta=0.9)

    cases = [
        (_READ, 4, lambda: x.sum()),
        (_WRITE, 4, lambda: out.fill_(1.0)),
        ("packbits", 4, lambda: K.packbits(x)),
        ("unpackbits", 4, lambda: K.unpackbits(packed, n)),
        (_DONATED_UNPACK, 4, lambda: K.unpack_scaled(packed.view(1, -1), one, out)),
        ("sign_compress", 4, lambda: K.sign_compress(x)),
        ("sign_compress + error", 8, lambda: K.sign_compress(x, e)),
        (_DONATED_EF, 8, donated_sign_compress),
        ("momentum sign_compress + error, donated", 12, lambda: donated_sign_compress(grad)),
        (f"quantize 4-bit g={group_size}", 4, lambda: K.quantize(x, 4, group_size)),
        (f"dequantize 4-bit g={group_size}", 4, lambda: K.dequantize(codes, scales, 4, n)),
        (f"dequantize_sum 4-bit W={_RANKS}", 4, lambda: K.dequantize_sum(*rank_codes, out)),
        (f"sign_sum_compress + error W={_RANKS}, donated", 4, donated_sign_sum),
        ("adamw_step (p, g, m, v)", 16, adamw_step),
    ]
    if x.device.type == "cpu":
        xn = x.numpy()
        cases.insert(1, ("numpy.packbits(x >= 0)", 4, lambda: np.packbits(xn >= 0)))
    else:
        y = torch.empty_like(x)
        cases.insert(1, (_COPY, 8, lambda: y.copy_(x)))
    if reference:
        cases.append(("reference sign_compress", 4, lambda: _reference.sign_compress(x)))
    return cases


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=list(range(20, 27)),
        help="log2 of the element counts (default 20..26)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, xpu, ... (default cpu)")
    parser.add_argument("--repeat", type=positive_int, default=7, help="timed calls per case")
    parser.add_argument("--group-size", type=positive_int, default=2048, help="quantize group size")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch.set_num_threads (default: torch's)",
    )
    parser.add_argument(
        "--reference", action="store_true", help="also time the pure-torch reference sign_compress"
    )
    parser.add_argument(
        "--kernels", default=None, help="kernel set of the device (default: its default set)"
    )
    args = parser.parse_args(argv)
    if min(args.sizes) < 3 or max(args.sizes) > 40:
        parser.error(f"--sizes must be log2 counts within 3..40, got {args.sizes}")
    if (1 << min(args.sizes)) % args.group_size:
        parser.error(f"--group-size {args.group_size} must divide every size's count")

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    K.set_accelerator(device.type)
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        if device.index is None:  # "cuda": the current device, as torch places tensors
            device = torch.device(device.type, module.current_device())
        module.set_device(device)
    if args.kernels:
        K.select_kernels(device.type, args.kernels)
    sync = K.get_accelerator().synchronize
    print(
        f"device={device} kernels={K.kernel_set(device.type)} torch={torch.__version__} "
        f"threads={torch.get_num_threads()}"
    )
    # the last-but-one column: the rate over numpy.packbits on the CPU, over the copy elsewhere
    base = "numpy.packbits(x >= 0)" if device.type == "cpu" else _COPY
    vs = "x numpy" if device.type == "cpu" else "x copy"
    print(f"{'n':>5} {'op':<40} {'ms':>9} {'GB/s':>8} {vs:>8} {'x sum':>7}")
    results = {}
    for log2 in args.sizes:
        n = 1 << log2
        g = torch.Generator().manual_seed(log2)
        x = torch.randn(n, generator=g).to(device)
        e = torch.randn(n, generator=g).to(device)
        rates, times = {}, {}
        for name, bytes_per_element, fn in _cases(x, e, args.group_size, args.reference):
            seconds = _median_seconds(fn, args.repeat, sync)
            times[name] = seconds
            rates[name] = bytes_per_element * n / seconds / 1e9
            base_rate = rates.get(base)
            vs_base = f"{rates[name] / base_rate:8.2f}" if base_rate else f"{'-':>8}"
            vs_sum = rates[name] / rates[_READ]
            print(
                f"2^{log2:<3} {name:<40} {seconds * 1e3:9.3f} {rates[name]:8.2f} "
                f"{vs_base} {vs_sum:7.2f}"
            )
        results[log2] = rates
        last = (log2, times)
        del x, e
    _print_bandwidth_targets(*last)
    if device.type == "cpu" and 26 in results:
        ratio = results[26]["sign_compress"] / results[26]["numpy.packbits(x >= 0)"]
        verdict = "met" if ratio >= 1.5 else "NOT met"
        print(f"target sign_compress >= 1.5x numpy.packbits at 2^26: {ratio:.2f}x ({verdict})")
    if device.type != "cpu" and _TARGET_LOG2 in results:
        rates = results[_TARGET_LOG2]
        for name in ("packbits", "sign_compress"):
            ratio = rates[name] / rates[_COPY]
            verdict = "met" if ratio >= 0.5 else "NOT met"
            print(
                f"target {name} >= 50% of copy bandwidth at 2^{_TARGET_LOG2}: "
                f"{ratio:.0%} ({verdict})"
            )


def _print_bandwidth_targets(log2: int, times: dict[str, float]) -> None:
    """The targets on the steady-state forms, as ratios of times measured in this run."""
    ratio = times[_DONATED_EF] / (3 * times[_READ])
    verdict = "met" if ratio <= 1.5 else "NOT met"
    print(
        f"target {_DONATED_EF} <= 1.5x three x.sum() passes at 2^{log2}: {ratio:.2f}x ({verdict})"
    )
    for name, base, what in (
        ("packbits", _READ, "read"),
        (_DONATED_UNPACK, _WRITE, "write"),
    ):
        fraction = times[base] / times[name]  # both move 4n bytes of fp32
        verdict = "met" if fraction >= 0.8 else "NOT met"
        print(
            f"target {name} >= 80% of the {what} bandwidth at 2^{log2}: {fraction:.0%} ({verdict})"
        )


if __name__ == "__main__":
    main()
