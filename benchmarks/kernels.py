"""Throughput of the fn.kernels ops next to numpy.packbits and the read bandwidth of x.sum().

Usage:
    python3 benchmarks/kernels.py                       # CPU, 2^20 .. 2^26 elements
    python3 benchmarks/kernels.py --sizes 24 26 --repeat 9 --threads 1
    python3 benchmarks/kernels.py --device cuda --sizes 26 28

Throughput is GB/s of fp32 data: 4 bytes x n elements per call (8 bytes x n for
sign_compress with error, whose input is m and e; for unpackbits and dequantize the n fp32
outputs). Every number is the median of --repeat timed calls after one warm-up call, all
measured in this run.
Targets: CPU sign_compress >= 1.5x numpy.packbits(x >= 0) at 2^26; CUDA sign_compress >= 50%
of the device read bandwidth (x.sum()) at 2^28.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

import fn.kernels as K
from fn.kernels import _reference


def _median_seconds(fn: Callable[[], object], repeat: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
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
    cases = [
        ("x.sum() (read bandwidth)", 4, lambda: x.sum()),
        ("packbits", 4, lambda: K.packbits(x)),
        ("unpackbits", 4, lambda: K.unpackbits(packed, n)),
        ("sign_compress", 4, lambda: K.sign_compress(x)),
        ("sign_compress + error", 8, lambda: K.sign_compress(x, e)),
        (f"quantize 4-bit g={group_size}", 4, lambda: K.quantize(x, 4, group_size)),
        (f"dequantize 4-bit g={group_size}", 4, lambda: K.dequantize(codes, scales, 4, n)),
    ]
    if x.device.type == "cpu":
        xn = x.numpy()
        cases.insert(1, ("numpy.packbits(x >= 0)", 4, lambda: np.packbits(xn >= 0)))
    if reference:
        cases.append(("reference sign_compress", 4, lambda: _reference.sign_compress(x)))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=list(range(20, 27)),
        help="log2 of the element counts (default 20..26)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, xpu, ... (default cpu)")
    parser.add_argument("--repeat", type=int, default=7, help="timed calls per case")
    parser.add_argument("--group-size", type=int, default=2048, help="quantize group size")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    parser.add_argument(
        "--reference", action="store_true", help="also time the pure-torch reference sign_compress"
    )
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    K.set_accelerator(device.type)
    sync = K.get_accelerator().synchronize
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}")
    print(f"{'n':>5} {'op':<28} {'ms':>9} {'GB/s':>8} {'x numpy':>8} {'x sum':>7}")
    results = {}
    for log2 in args.sizes:
        n = 1 << log2
        g = torch.Generator().manual_seed(log2)
        x = torch.randn(n, generator=g).to(device)
        e = torch.randn(n, generator=g).to(device)
        rates = {}
        for name, bytes_per_element, fn in _cases(x, e, args.group_size, args.reference):
            seconds = _median_seconds(fn, args.repeat, sync)
            rates[name] = bytes_per_element * n / seconds / 1e9
            numpy_rate = rates.get("numpy.packbits(x >= 0)")
            vs_numpy = f"{rates[name] / numpy_rate:8.2f}" if numpy_rate else f"{'-':>8}"
            vs_sum = rates[name] / rates["x.sum() (read bandwidth)"]
            print(
                f"2^{log2:<3} {name:<28} {seconds * 1e3:9.3f} {rates[name]:8.2f} "
                f"{vs_numpy} {vs_sum:7.2f}"
            )
        results[log2] = rates
        del x, e
    if device.type == "cpu" and 26 in results:
        ratio = results[26]["sign_compress"] / results[26]["numpy.packbits(x >= 0)"]
        verdict = "met" if ratio >= 1.5 else "NOT met"
        print(f"target sign_compress >= 1.5x numpy.packbits at 2^26: {ratio:.2f}x ({verdict})")
    if device.type == "cuda" and 28 in results:
        ratio = results[28]["sign_compress"] / results[28]["x.sum() (read bandwidth)"]
        verdict = "met" if ratio >= 0.5 else "NOT met"
        print(f"target sign_compress >= 50% of read bandwidth at 2^28: {ratio:.0%} ({verdict})")


if __name__ == "__main__":
    main()
