"""Fused CPU kernels: C compiled on first use with the system compiler, called through ctypes.

The C source is ``_cpu.c``, package data next to this module. The shared library is built once
per (source text, compiler, flags, CPU) into ``$FN_CACHE_DIR`` (default ``~/.cache/fn``) with
``$CC`` (default ``cc``) and ``-O3 -march=native``. Without a working compiler every kernel
falls back to the reference and one warning says why. Results are bit-identical to
``fn.kernels._reference``, whose arithmetic order each kernel follows (the sums over the ranks'
chunks in rank order, :func:`fn.kernels.sum_ranks`); nothing depends on how torch's own kernels
are built.

Large calls are split into chunks of ``_CHUNK`` elements claimed by up to
``torch.get_num_threads()`` threads (ctypes releases the GIL; no OpenMP runtime is involved).
The calling thread works too and waits only for chunks already claimed, never for a helper
that has not started: on a busy machine a call degrades towards one thread instead of
stalling on a descheduled helper.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.resources
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from fn.kernels import _reference, _tuning
from fn.kernels._spec import implementation

# -ffp-contract=off: no fused multiply-adds where torch rounds the product and the sum apart.
_FLAGS = ("-O3", "-march=native", "-std=c99", "-ffp-contract=off", "-shared", "-fPIC")
_CHUNK = 1 << 18  # elements per work item of a threaded call
_HUGE_MIN = 1 << 23  # outputs from 8 MiB on ask for transparent huge pages
# The C kernels' enum, in its order: a kernel's id is its index.
_KERNELS = (
    "sign_compress apply_error packbits unpackbits quantize dequantize loco_quantize loco_error "
    "dequantize_sum dequantize_into feedback_signs feedback_error unpack_scaled adam_direction "
    "sqrt_rn"
).split()


def _fields(ctype: type, *names: str) -> list[tuple[str, type]]:
    """Fields of a ``ctypes.Structure``: ``names``, in order, each of ``ctype``."""
    return [(name, ctype) for name in names]


class _JobStruct(ctypes.Structure):
    """Mirror of the C ``fn_job``."""

    _fields_ = [
        *_fields(ctypes.c_int64, "kernel", "n", "chunk", "count", "next", "left"),
        ("p", ctypes.c_void_p * 5),
        ("i", ctypes.c_int64 * 6),
        *_fields(ctypes.c_float, "scale", "scale2"),
    ]


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


@functools.lru_cache(maxsize=1)
def source() -> str:
    """The C source of the kernels (``fn/kernels/_cpu.c``, shipped as package data)."""
    return importlib.resources.files("fn.kernels").joinpath("_cpu.c").read_text(encoding="utf-8")


def _compile(compiler: str, out: Path, flags: tuple[str, ...] = _FLAGS) -> None:
    src = out.with_suffix(".c")
    src.write_text(source(), encoding="utf-8")
    cmd = [compiler, *flags, str(src), "-o", str(out), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()[-500:]}")


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name in ("fn_work", "fn_wait"):
        getattr(lib, name).argtypes = (ctypes.POINTER(_JobStruct),)
        getattr(lib, name).restype = None
    lib.fn_advise_huge.argtypes = (ctypes.c_void_p, ctypes.c_int64)
    lib.fn_advise_huge.restype = None
    lib.fn_rms.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
    lib.fn_rms.restype = ctypes.c_float
    return lib


def library_path(compiler: str) -> Path:
    """Where the library built by ``compiler`` is cached: the name hashes the source text, the
    compiler, the flags and the CPU, so a change to any of them builds a new library."""
    key = hashlib.sha256(
        "\0".join((source(), compiler, *_FLAGS, _cpu_fingerprint())).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"fn_cpu_kernels_{key}.so"


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
    try:
        path = library_path(compiler)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                _compile(compiler, Path(tmp) / path.name)
                # Atomic: a concurrent process never loads a partly written library.
                os.replace(Path(tmp) / path.name, path)
        return _load(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warnings.warn(
            f"fn.kernels: building the CPU kernels failed ({exc}); falling back to the "
            "pure-torch reference.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


@functools.lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="fn")


# A forked child inherits the pool object but not its threads.
os.register_at_fork(after_in_child=_pool.cache_clear)


def _run(
    lib: ctypes.CDLL,
    kernel: str,
    n: int,
    align: int,
    pointers: tuple[int | None, ...],
    ints: tuple[int, ...] = (),
    scale: float = 0.0,
    scale2: float = 0.0,
) -> None:
    """Runs ``kernel`` over ``[0, n)`` in chunks starting at multiples of ``align``, on up to
    ``torch.get_num_threads()`` threads."""
    chunk = max(align, _CHUNK // align * align)
    count = -(-n // chunk)
    job = _JobStruct(_KERNELS.index(kernel), n, chunk, count, 0, count, scale=scale, scale2=scale2)
    job.p[: len(pointers)] = pointers
    job.i[: len(ints)] = ints
    ref = ctypes.byref(job)  # keeps the job alive for helpers that start late
    for _ in range(min(torch.get_num_threads(), count) - 1):
        _pool().submit(lib.fn_work, ref)
    lib.fn_work(ref)
    lib.fn_wait(ref)


def _last_level_cache() -> int:
    """The bytes of the largest CPU cache Linux reports (32 MiB where it reports none)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip()
        except OSError:
            continue
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes, default=32 << 20)


# Outputs written without being read, from half the last-level cache on, bypass the cache
# (non-temporal stores): no read of each line before its write, and the inputs of the next pass
# stay cached. Smaller outputs stay in the cache, where their consumer reads them next.
_STREAM_MIN = _last_level_cache() // 2


def _streams(out: torch.Tensor, updated: torch.Tensor | None = None) -> int:
    """1 where the kernel should write ``out`` with non-temporal stores: large, and not the
    tensor ``updated`` in place (whose lines the kernel has just read into the cache)."""
    if updated is not None and out.data_ptr() == updated.data_ptr():
        return 0
    return int(out.numel() * out.element_size() >= _STREAM_MIN)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x.detach().float().contiguous()


def _codes(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantized codes and their scales as the C kernels read them (contiguous; fp32 scales)."""
    return q.detach().contiguous(), _fp32(scales)


def _block_sums(length: int) -> tuple[int, torch.Tensor]:
    """The number of sum-of-squares blocks of ``length`` elements and the fp64 buffer the C
    kernel writes their sums into and ``fn_rms`` folds (a power of two long)."""
    blocks = -(-length // _reference.SUMSQ_BLOCK)
    return blocks, torch.empty(1 << max(0, blocks - 1).bit_length(), dtype=torch.float64)


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _empty(lib: ctypes.CDLL, size: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(size, dtype=dtype)
    if out.nbytes >= _HUGE_MIN:
        lib.fn_advise_huge(out.data_ptr(), out.nbytes)
    return out


# The library is looked up on every call (a test builds it for another CPU); each kernel runs
# the reference without it, or for the inputs it does not take (returning None).
_with_library = implementation(lambda: library())


@_with_library
def packbits(lib, x):
    if x.dtype != torch.float32:
        return None
    x = _fp32(x)
    out = _empty(lib, (x.numel() + 7) // 8, torch.uint8)
    _run_prefetching(lib, "packbits", x.numel(), (x.data_ptr(), out.data_ptr()), align=8)
    return out


@_with_library
def unpackbits(lib, packed, n, dtype=torch.float32):
    if dtype != torch.float32 or packed.numel() * 8 < n:
        return None
    packed = packed.detach().contiguous()
    out = _empty(lib, n, torch.float32)
    _run(lib, "unpackbits", n, 8, (packed.data_ptr(), out.data_ptr()), (_streams(out),))
    return out


@_with_library
def sign_compress(lib, m, error=None):
    m = _fp32(m)
    n = m.numel()
    e = None if error is None else _fp32(error)
    v = None if e is None else _empty(lib, n, torch.float32)
    packed = _empty(lib, (n + 7) // 8, torch.uint8)
    blocks, sums = _block_sums(n)
    pointers = (m.data_ptr(), _address(e), _address(v), packed.data_ptr(), sums.data_ptr())
    _run_prefetching(lib, "sign_compress", n, pointers)
    # Padded and folded in C, not by torch ops: on a busy machine, torch's intra-op thread pool
    # (which even a 512 KiB fill enters) can stall a call for a scheduler tick.
    scale = lib.fn_rms(sums.data_ptr(), blocks, sums.numel(), n)
    if v is not None and math.isfinite(scale):
        _run(lib, "apply_error", n, 1, (v.data_ptr(),), scale=scale)
    return packed, torch.tensor(scale, dtype=torch.float32), v


class _FeedbackStruct(ctypes.Structure):
    """Mirror of the C ``fn_feedback``: the source of an error-compensated compression."""

    _fields_ = [
        *_fields(ctypes.c_int64, "mode", "n"),
        *_fields(ctypes.c_void_p, "x", "g", "e"),
        *_fields(ctypes.c_float, "beta", "one_minus_beta"),
        *_fields(ctypes.c_void_p, "signs", "weights"),
        *_fields(ctypes.c_int64, "ranks", "row_bytes", "ahead", "e_bf16"),
    ]


_FEEDBACK_X, _FEEDBACK_MOMENTUM, _FEEDBACK_SIGN_SUM, _FEEDBACK_SIGNED_MOMENTUM = 0, 1, 2, 3
# How far ahead (elements; 0: not at all) packbits and the error-feedback kernels prefetch
# their inputs, chosen per host (fn.kernels._tuning): on a Zen 5 host 4 KiB ahead brings
# packbits from 86% to 97% of the read bandwidth, while 1 KiB ahead slows the error-feedback
# kernels by about a fifth there, where it was the faster choice on Zen 3 hosts.
# Timed calls stream from memory: their fp32 input alone fills the last-level cache.
_PREFETCH = _tuning.Tuner((0, 256, 1024), min_elements=max(1 << 22, _last_level_cache() // 4))


def tuning_pending() -> bool:
    """Whether a CPU kernel is still timing its candidate prefetch distances (on the first large
    calls of each kind): a benchmark's warm-up lasts until it is not.

    Returns:
        ``True`` while some kernel has begun timing and not yet chosen; the results of the
        kernels do not depend on it.

    Example:
        A benchmark's warm-up, bounded:

        >>> x = torch.randn(1 << 16)
        >>> for _ in range(100):
        ...     _ = fn.kernels.packbits(x)
        ...     if not fn.kernels.tuning_pending():
        ...         break
    """
    return _PREFETCH.pending()


def _run_prefetching(
    lib: ctypes.CDLL,
    kernel: str,
    n: int,
    pointers: tuple[int | None, ...],
    ints: tuple[int, ...] = (),
    scale: float = 0.0,
    feedback: _FeedbackStruct | None = None,
    align: int = _reference.SUMSQ_BLOCK,
) -> None:
    """:func:`_run` of a kernel that prefetches its input streams, at the distance tuned for it
    (and ``feedback``'s mode): in ``feedback.ahead``, or else before ``ints``."""
    mode = None if feedback is None else feedback.mode

    def call(ahead: int) -> None:
        if feedback is not None:
            feedback.ahead = ahead
        args = ints if feedback is not None else (ahead, *ints)
        _run(lib, kernel, n, align, pointers, args, scale)

    _PREFETCH.run((kernel, mode), n, call)


def _plain_fp32(*tensors: torch.Tensor | None) -> bool:
    return all(
        t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")
        for t in tensors
    )


def _feedback(
    mode: int, error: torch.Tensor, x=None, grad=None, beta: float = 0.0, signs=None, weights=None
) -> tuple[_FeedbackStruct, tuple[torch.Tensor, ...]]:
    """The C description of a source (and the tensors it points into, to keep alive): ``x``
    (the momentum with ``grad``), the sign sum of ``signs`` and ``weights``, or with
    :data:`_FEEDBACK_SIGNED_MOMENTUM` the momentum of ``grad`` and the previous momentum
    given as ``signs`` rows scaled by ``weights``."""
    f = _FeedbackStruct(mode=mode, e=error.data_ptr(), e_bf16=error.dtype == torch.bfloat16)
    if mode in (_FEEDBACK_SIGN_SUM, _FEEDBACK_SIGNED_MOMENTUM):
        f.signs, f.weights = signs.data_ptr(), weights.data_ptr()
        f.ranks, f.row_bytes = signs.shape
    if mode != _FEEDBACK_SIGN_SUM:
        f.n = grad.numel() if x is None else x.numel()
        f.x = _address(x)
        if grad is not None:
            if mode == _FEEDBACK_X:
                f.mode = _FEEDBACK_MOMENTUM
            f.g = grad.data_ptr()
            f.beta, f.one_minus_beta = beta, 1 - beta
    return f, tuple(t for t in (error, x, grad, signs, weights) if t is not None)


def _feedback_signs(lib: ctypes.CDLL, f: _FeedbackStruct, alive: tuple, length: int):
    """Phase 1 over ``f``'s source; ``alive`` holds the tensors ``f`` points into."""
    packed = _empty(lib, (length + 7) // 8, torch.uint8)
    blocks, sums = _block_sums(length)
    pointers = (ctypes.addressof(f), packed.data_ptr(), sums.data_ptr())
    _run_prefetching(lib, "feedback_signs", length, pointers, feedback=f)
    del alive  # the tensors f points into lived until here
    scale = lib.fn_rms(sums.data_ptr(), blocks, sums.numel(), length)
    return packed, torch.tensor(scale, dtype=torch.float32)


def _feedback_error(
    lib: ctypes.CDLL,
    f: _FeedbackStruct,
    alive: tuple,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
) -> bool:
    """Phase 2 over ``f``'s source: ``out = v - scale * s(v)`` (``out`` may be ``error``), fp32
    or rounded to bf16; ``alive`` holds the tensors ``f`` points into."""
    pointers = (ctypes.addressof(f), out.data_ptr())
    ints = (_streams(out, error), int(out.dtype == torch.bfloat16))
    _run_prefetching(lib, "feedback_error", error.numel(), pointers, ints, float(scale), f)
    del alive  # the tensors f points into lived until here
    return True


def _momentum_source(error, x, grad, beta, signs, out=None):
    """:func:`_feedback` of the feedback kernels' source (``x``, or the packed ``signs`` of the
    previous momentum), or ``None`` for inputs the C kernels do not take (with the error written
    into ``out``, when given)."""
    buffers = _error_buffer(error) and (out is None or _error_buffer(out))
    if not buffers or not _plain_fp32(x, grad):
        return None
    if signs is None:
        return None if x is None else _feedback(_FEEDBACK_X, error, x, grad, beta)
    packed, scales = signs
    rows = packed.dtype == torch.uint8 and packed.is_contiguous() and packed.device.type == "cpu"
    if grad is None or not rows or not _plain_fp32(scales) or packed.numel() * 8 < grad.numel():
        return None
    return _feedback(_FEEDBACK_SIGNED_MOMENTUM, error, None, grad, beta, packed, scales)


def _error_buffer(t: torch.Tensor) -> bool:
    """Whether the feedback kernels read or write ``t`` as an error: contiguous fp32 or bf16."""
    fits = t.dtype in (torch.float32, torch.bfloat16)
    return fits and t.is_contiguous() and t.device.type == "cpu"


@_with_library
def feedback_sign_compress(lib, x, error, grad=None, beta=0.0, signs=None):
    source = _momentum_source(error, x, grad, beta, signs)
    return None if source is None else _feedback_signs(lib, *source, error.numel())


@_with_library
def feedback_apply_error(lib, x, error, scale, out, grad=None, beta=0.0, signs=None):
    source = _momentum_source(error, x, grad, beta, signs, out)
    return None if source is None else _feedback_error(lib, *source, error, scale, out)


def _sign_sum_source(signs, weights, error, out=None):
    """:func:`_feedback` of the sign sum of ``signs`` and ``weights``, or ``None`` for inputs
    the C kernels do not take (with the error written into ``out``, when given)."""
    buffers = _error_buffer(error) and (out is None or _error_buffer(out))
    if not _plain_fp32(weights) or not buffers or not signs.is_contiguous():
        return None
    return _feedback(_FEEDBACK_SIGN_SUM, error, signs=signs, weights=weights)


@_with_library
def sign_sum_compress(lib, signs, weights, error):
    source = _sign_sum_source(signs, weights, error)
    return None if source is None else _feedback_signs(lib, *source, error.numel())


@_with_library
def sign_sum_apply_error(lib, signs, weights, error, scale, out):
    source = _sign_sum_source(signs, weights, error, out)
    return None if source is None else _feedback_error(lib, *source, error, scale, out)


@_with_library
def unpack_scaled(lib, packed, scales, out):
    if not _plain_fp32(scales, out) or not packed.is_contiguous():
        return None
    pointers = (packed.data_ptr(), scales.data_ptr(), out.data_ptr())
    _run(lib, "unpack_scaled", out.numel(), 8, pointers, (packed.shape[1] * 8, _streams(out)))
    return True


@_with_library
def adam_direction(lib, m, v, p, eta, out, eps, bound, weight_decay):
    if not _plain_fp32(m, v, p, out):
        return None
    _adam_kernel(lib, m, v, p, eta, out, eps, bound, weight_decay, add=False)
    return True


@_with_library
def sqrt_rn(lib, v):
    if not _plain_fp32(v):
        return None
    out = _empty(lib, v.numel(), torch.float32)
    _run(lib, "sqrt_rn", v.numel(), 16, (v.data_ptr(), out.data_ptr()))
    return out.view(v.shape)


def _adam_kernel(lib, m, v, p, eta, out, eps, bound, weight_decay, *, add: bool, signs=None):
    """The C ``adam_direction`` job: the direction written into ``out`` or, with ``add``, added
    to it; with ``signs`` (``add`` only), ``m`` (unless ``None``) is written from them as it is
    used (:func:`adam_apply`)."""
    constants = torch.tensor([eps, 0.0 if bound is None else bound, weight_decay])
    flags = int(bound is not None) | (2 if add else 0)  # 2: add the direction to out
    momentum = _address(m)
    if signs is not None:
        packed, scales = signs
        written = (0, None) if m is None else (_streams(m), m.data_ptr())
        signed = _SignedMomentum(
            packed.data_ptr(), scales.data_ptr(), packed.shape[1] * 8, *written
        )
        momentum, flags = ctypes.addressof(signed), flags | 4  # 4: m from the signs
    pointers = (momentum, v.data_ptr(), _address(p), constants.data_ptr(), out.data_ptr())
    _run(lib, "adam_direction", out.numel(), 16, pointers, (flags,), -float(eta))


class _SignedMomentum(ctypes.Structure):
    """Mirror of the C ``fn_signed_momentum``."""

    _fields_ = [
        *_fields(ctypes.c_void_p, "packed", "scales"),
        *_fields(ctypes.c_int64, "chunk", "stream"),
        ("m", ctypes.c_void_p),
    ]


@_with_library
def adam_apply(lib, m, v, eta, params, root, eps, bound, weight_decay, signs=None):
    plain_signs = signs is None or (signs[0].is_contiguous() and _plain_fp32(signs[1]))
    if not _plain_fp32(m, v, params) or not plain_signs:
        return None
    decayed = params if weight_decay else None
    _adam_kernel(lib, m, v, decayed, eta, params, eps, bound, weight_decay, add=True, signs=signs)
    return True


@_with_library
def quantize(lib, x, bits, group_size):
    if bits not in (4, 8) or group_size < 2 or group_size % 2:
        return None  # the reference raises the argument errors
    x = _fp32(x)
    groups = -(-x.numel() // group_size)
    q = _empty(lib, groups * group_size * bits // 8, torch.uint8)
    scales = torch.empty(groups, dtype=torch.float32)
    pointers = (x.data_ptr(), q.data_ptr(), scales.data_ptr())
    _run(lib, "quantize", x.numel(), group_size, pointers, (bits, group_size))
    return q, scales


@_with_library
def dequantize(lib, q, scales, bits, n):
    groups = scales.numel()
    values = q.numel() * 8 // bits if bits in (4, 8) else 0
    if not groups or values % groups or n > values:
        return None
    q, scales = _codes(q, scales)
    out = _empty(lib, n, torch.float32)
    pointers = (q.data_ptr(), scales.data_ptr(), out.data_ptr())
    _run(lib, "dequantize", n, 2, pointers, (bits, values // groups))
    return out


def _rows_layout(
    n: int, numel: int, rows: tuple[int, int, int] | None
) -> tuple[int, int, int, int]:
    """The C ``rows_layout`` (row, padded row, nodes, local) of ``rows = (row, padded_row,
    local)``; ``None``: one row of ``n`` values padded to ``numel``."""
    if rows is None:
        return (n, numel, 1, 1)
    row, padded_row, local = rows
    return (row, padded_row, n // row // local, local)


@_with_library
def loco_quantize(lib, x, error, bits, group_size, numel, out=None, rows=None):
    fits = out is None or (out[0].is_contiguous() and _plain_fp32(out[1]))
    if numel % group_size or x.numel() > numel or not fits:
        return None
    x = _fp32(x)
    e = None if error is None else _fp32(error)
    if out is None:
        out = (
            _empty(lib, numel * bits // 8, torch.uint8),
            torch.empty(numel // group_size, dtype=torch.float32),
        )
    q, scales = out
    pointers = (x.data_ptr(), _address(e), q.data_ptr(), scales.data_ptr())
    ints = (bits, group_size, *_rows_layout(x.numel(), numel, rows))
    _run(lib, "loco_quantize", numel, group_size, pointers, ints)
    return q, scales


@_with_library
def loco_error(lib, x, error, q, scales, bits, err_beta, out, rows=None):
    n = out.numel()
    if not _plain_fp32(out) or not scales.numel() or n % scales.numel():
        return None
    x = _fp32(x)
    e = None if error is None else _fp32(error)
    q, scales = _codes(q, scales)
    pointers = (x.data_ptr(), _address(e), q.data_ptr(), scales.data_ptr(), out.data_ptr())
    ints = (bits, n // scales.numel(), *_rows_layout(x.numel(), n, rows))
    _run(lib, "loco_error", n, 1, pointers, ints, scale=1 - err_beta, scale2=err_beta)
    return True


@_with_library
def dequantize_sum(lib, q, scales, bits, pieces, out):
    cols = out.numel()
    groups = scales.numel()
    if not _plain_fp32(out) or not groups:
        return None
    q, scales = _codes(q, scales)
    pointers = (q.data_ptr(), scales.data_ptr(), out.data_ptr())
    ints = (bits, pieces * cols // groups, pieces, cols)
    _run(lib, "dequantize_sum", cols, 1, pointers, ints)
    return True


@_with_library
def dequantize_into(lib, q, scales, bits, out, chunks=1, local_world_size=1):
    groups = scales.numel()
    values = q.numel() * 8 // bits
    whole = groups and not values % groups and not values % chunks
    if not _plain_fp32(out) or not whole or values // chunks % (values // groups):
        return None
    q, scales = _codes(q, scales)
    pointers = (q.data_ptr(), scales.data_ptr(), out.data_ptr())
    ints = (bits, values // groups, values // chunks, chunks // local_world_size, local_world_size)
    _run(lib, "dequantize_into", out.numel(), 2, pointers, ints)
    return True


# Elements per batch of adamw_step: a batch's p, its copy, g, m and v stay in the cache between
# the kernel's passes. Leaves are cut at multiples of it (a multiple of every vector length).
_ADAMW_BATCH = 1 << 18


def _adamw_batches(leaves: list[tuple[torch.Tensor, ...]]) -> list[list[tuple[torch.Tensor, ...]]]:
    """The leaves ``(p, g, m, v)`` cut into pieces of at most ``_ADAMW_BATCH`` elements (but
    for non-contiguous leaves, kept whole) and grouped into batches of about that many."""
    batches: list[list[tuple[torch.Tensor, ...]]] = [[]]
    size = 0
    for leaf in leaves:
        n = leaf[0].numel()
        if all(t.is_contiguous() for t in leaf):
            flat = [t.view(-1) for t in leaf]
            pieces = [
                tuple(t[i : i + _ADAMW_BATCH] for t in flat)
                for i in range(0, max(n, 1), _ADAMW_BATCH)
            ]
        else:
            pieces = [leaf]
        for piece in pieces:
            if size and size + piece[0].numel() > _ADAMW_BATCH:
                batches.append([])
                size = 0
            batches[-1].append(piece)
            size += piece[0].numel()
    return batches


@implementation()  # torch's kernels only: it runs without the library
def adamw_step(ps, gs, ms, vs, m_outs, v_outs, step, lr, beta1, beta2, eps, weight_decay):
    """The reference's step (torch's fused AdamW kernel on a copy of the params, then
    ``p + (p' - p)``) a cache-sized batch at a time, the copies in one workspace: torch's kernel
    is elementwise and rounds only a tensor's last ``n % lanes`` elements apart from its vector
    lanes, which the cuts at multiples of ``_ADAMW_BATCH`` keep where they are."""
    _reference.copy_moments(ms, vs, m_outs, v_outs)
    if not ps:
        return True
    count = torch.tensor(step, dtype=torch.float32)
    work: dict[torch.dtype, torch.Tensor] = {}
    for batch in _adamw_batches(list(zip(ps, gs, m_outs, v_outs, strict=True))):
        p, g, m, v = (list(column) for column in zip(*batch, strict=True))
        copies, used = [], dict.fromkeys(work, 0)
        for t in p:
            if t.numel() > _ADAMW_BATCH or not t.is_contiguous():
                copies.append(torch.empty_like(t))
                continue
            if t.dtype not in work:
                work[t.dtype], used[t.dtype] = torch.empty(_ADAMW_BATCH, dtype=t.dtype), 0
            copies.append(work[t.dtype][used[t.dtype] : used[t.dtype] + t.numel()].view_as(t))
            used[t.dtype] += t.numel()
        torch._foreach_copy_(copies, p)
        torch._fused_adamw_(
            copies, g, m, v, [], [count] * len(p), lr=lr, beta1=beta1, beta2=beta2,
            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        torch._foreach_sub_(copies, p)
        torch._foreach_add_(p, copies)
    return True
