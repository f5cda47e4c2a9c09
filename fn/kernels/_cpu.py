"""Fused CPU kernels: C compiled on first use with the system compiler, called through ctypes.

The shared library is built once per (source, flags, CPU) into ``$FN_CACHE_DIR`` (default
``~/.cache/fn``) with ``$CC`` (default ``cc``), ``-O3 -march=native`` and OpenMP when the
compiler supports it. Without a working compiler every kernel falls back to the reference and
one warning says why. Results are bit-identical to ``fn.kernels._reference``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from fn.kernels import _reference
from fn.kernels._cpu_source import SOURCE

_FLAGS = ("-O3", "-march=native", "-std=c99", "-shared", "-fPIC")
_I64, _INT, _FLOAT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "fn_sign_compress": (_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _INT),
    "fn_apply_error": (_PTR, _I64, _FLOAT, _INT),
    "fn_packbits": (_PTR, _I64, _PTR, _INT),
    "fn_unpackbits": (_PTR, _I64, _PTR, _INT),
    "fn_quantize": (_PTR, _I64, _INT, _I64, _PTR, _PTR, _INT),
    "fn_dequantize": (_PTR, _PTR, _I64, _INT, _I64, _PTR, _INT),
}


def cache_dir() -> Path:
    """Where compiled kernels are cached: ``$FN_CACHE_DIR`` or ``~/.cache/fn``."""
    return Path(os.environ.get("FN_CACHE_DIR") or Path.home() / ".cache" / "fn")


def _cpu_fingerprint() -> str:
    # -march=native code must not be reused on a different CPU sharing the cache directory.
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def _compile(compiler: str, out: Path) -> None:
    src = out.with_suffix(".c")
    src.write_text(SOURCE)
    errors = []
    for extra in (("-fopenmp",), ()):
        cmd = [compiler, *_FLAGS, *extra, str(src), "-o", str(out), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode == 0:
            return
        errors.append(f"{' '.join(cmd)}: {proc.stderr.strip()[-500:]}")
    raise RuntimeError("; ".join(errors))


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first call; ``None`` (after one warning) when no
    compiler works."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        warnings.warn(
            f"fn.kernels: C compiler {compiler!r} not found; the CPU kernels fall back to the "
            "slower pure-torch reference (set CC to a working compiler to enable them).",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    key = hashlib.sha256(
        "\0".join((SOURCE, compiler, *_FLAGS, _cpu_fingerprint())).encode()
    ).hexdigest()[:16]
    path = cache_dir() / f"fn_cpu_kernels_{key}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                _compile(compiler, Path(tmp) / path.name)
                # Atomic: a concurrent process never loads a partly written library.
                os.replace(Path(tmp) / path.name, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warnings.warn(
            f"fn.kernels: building the CPU kernels failed ({exc}); falling back to the "
            "pure-torch reference.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = None
    return lib


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().contiguous()


def packbits(x: torch.Tensor) -> torch.Tensor:
    lib = library()
    if lib is None or x.dtype != torch.float32:
        return _reference.packbits(x)
    x = _fp32(x)
    out = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
    lib.fn_packbits(x.data_ptr(), x.numel(), out.data_ptr(), torch.get_num_threads())
    return out


def unpackbits(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    lib = library()
    if lib is None or dtype != torch.float32 or packed.numel() * 8 < n:
        return _reference.unpackbits(packed, n, dtype)
    packed = packed.detach().contiguous()
    out = torch.empty(n, dtype=torch.float32)
    lib.fn_unpackbits(packed.data_ptr(), n, out.data_ptr(), torch.get_num_threads())
    return out


def sign_compress(
    m: torch.Tensor, error: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    lib = library()
    if lib is None:
        return _reference.sign_compress(m, error)
    m = _fp32(m)
    n = m.numel()
    e = None if error is None else _fp32(error)
    v = None if e is None else torch.empty(n, dtype=torch.float32)
    packed = torch.empty((n + 7) // 8, dtype=torch.uint8)
    sums = torch.empty(-(-n // _reference.SUMSQ_BLOCK), dtype=torch.float64)
    threads = torch.get_num_threads()
    lib.fn_sign_compress(
        m.data_ptr(),
        None if e is None else e.data_ptr(),
        None if v is None else v.data_ptr(),
        n,
        packed.data_ptr(),
        sums.data_ptr(),
        threads,
    )
    scale = _reference.rms_from_block_sums(sums, n)
    if v is not None and torch.isfinite(scale):
        lib.fn_apply_error(v.data_ptr(), n, scale.item(), threads)
    return packed, scale, v


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    lib = library()
    if lib is None or bits not in (4, 8) or group_size < 2 or group_size % 2:
        return _reference.quantize(x, bits, group_size)
    x = _fp32(x)
    groups = -(-x.numel() // group_size)
    q = torch.empty(groups * group_size * bits // 8, dtype=torch.uint8)
    scales = torch.empty(groups, dtype=torch.float32)
    lib.fn_quantize(
        x.data_ptr(),
        x.numel(),
        bits,
        group_size,
        q.data_ptr(),
        scales.data_ptr(),
        torch.get_num_threads(),
    )
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    lib = library()
    groups = scales.numel()
    values = q.numel() * 8 // bits if bits in (4, 8) else 0
    if lib is None or not groups or values % groups or n > values:
        return _reference.dequantize(q, scales, bits, n)
    q = q.detach().contiguous()
    scales = _fp32(scales)
    out = torch.empty(n, dtype=torch.float32)
    lib.fn_dequantize(
        q.data_ptr(),
        scales.data_ptr(),
        n,
        bits,
        values // groups,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
