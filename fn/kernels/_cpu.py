"""Fused CPU kernels: C compiled on first use with the system compiler, called through ctypes.

The C source is ``_cpu.c``, package data next to this module. The shared library is built once
per (source text, compiler, flags, CPU) into ``$FN_CACHE_DIR`` (default ``~/.cache/fn``) with
``$CC`` (default ``cc``) and ``-O3 -march=native``. Without a working compiler every kernel
falls back to the reference and one warning says why. Results are bit-identical to
``fn.kernels._reference``. Where the reference is one of torch's own kernels (the sums over the
ranks' chunks in ``torch.sum(dim=0)``'s order, the fused AdamW step in
``torch._fused_adamw_``'s rounding), the C kernel follows the vector length that torch's kernel
is found to run on this build (found once by running it; the CPU capability does not tell it),
so the fast path is taken on every capability torch's AVX2 and AVX512 builds report.

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

# -ffp-contract=off: no fused multiply-adds where torch rounds the product and the sum apart.
_FLAGS = ("-O3", "-march=native", "-std=c99", "-ffp-contract=off", "-shared", "-fPIC")
_CHUNK = 1 << 18  # elements per work item of a threaded call
_HUGE_MIN = 1 << 23  # outputs from 8 MiB on ask for transparent huge pages
_KERNEL_IDS = {
    "sign_compress": 0,
    "apply_error": 1,
    "packbits": 2,
    "unpackbits": 3,
    "quantize": 4,
    "dequantize": 5,
    "loco_quantize": 6,
    "loco_error": 7,
    "dequantize_sum": 8,
    "dequantize_into": 9,
    "feedback_signs": 10,
    "feedback_error": 11,
    "unpack_scaled": 12,
    "adam_direction": 13,
    "adamw_step": 14,
    "sqrt_rn": 15,
}


class _JobStruct(ctypes.Structure):
    """Mirror of the C ``fn_job``."""

    _fields_ = [
        ("kernel", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("chunk", ctypes.c_int64),
        ("count", ctypes.c_int64),
        ("next", ctypes.c_int64),
        ("left", ctypes.c_int64),
        ("p", ctypes.c_void_p * 5),
        ("i", ctypes.c_int64 * 6),
        ("scale", ctypes.c_float),
        ("scale2", ctypes.c_float),
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
        lib = _load(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warnings.warn(
            f"fn.kernels: building the CPU kernels failed ({exc}); falling back to the "
            "pure-torch reference.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return lib


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
    job = _JobStruct(_KERNEL_IDS[kernel], n, chunk, count, 0, count)
    job.p[: len(pointers)] = pointers
    job.i[: len(ints)] = ints
    job.scale = scale
    job.scale2 = scale2
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


def _empty(lib: ctypes.CDLL, size: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(size, dtype=dtype)
    if out.nbytes >= _HUGE_MIN:
        lib.fn_advise_huge(out.data_ptr(), out.nbytes)
    return out


def packbits(x: torch.Tensor) -> torch.Tensor:
    lib = library()
    if lib is None or x.dtype != torch.float32:
        return _reference.packbits(x)
    x = _fp32(x)
    out = _empty(lib, (x.numel() + 7) // 8, torch.uint8)
    _run_prefetching(lib, "packbits", x.numel(), (x.data_ptr(), out.data_ptr()), align=8)
    return out


def unpackbits(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    lib = library()
    if lib is None or dtype != torch.float32 or packed.numel() * 8 < n:
        return _reference.unpackbits(packed, n, dtype)
    packed = packed.detach().contiguous()
    out = _empty(lib, n, torch.float32)
    _run(lib, "unpackbits", n, 8, (packed.data_ptr(), out.data_ptr()), (_streams(out),))
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
    v = None if e is None else _empty(lib, n, torch.float32)
    packed = _empty(lib, (n + 7) // 8, torch.uint8)
    blocks = -(-n // _reference.SUMSQ_BLOCK)
    sums = torch.empty(1 << max(0, blocks - 1).bit_length(), dtype=torch.float64)
    pointers = (
        m.data_ptr(),
        None if e is None else e.data_ptr(),
        None if v is None else v.data_ptr(),
        packed.data_ptr(),
        sums.data_ptr(),
    )
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
        ("mode", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("x", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("e", ctypes.c_void_p),
        ("beta", ctypes.c_float),
        ("one_minus_beta", ctypes.c_float),
        ("signs", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
        ("ranks", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("tails", ctypes.c_void_p),
        ("ntails", ctypes.c_int64),
        ("ahead", ctypes.c_int64),
    ]


_FEEDBACK_X, _FEEDBACK_MOMENTUM, _FEEDBACK_SIGN_SUM = 0, 1, 2
_SUM_GRAIN = 32768  # at::internal::GRAIN_SIZE: smaller reductions run on one thread
# How far ahead (elements; 0: not at all) packbits and the error-feedback kernels prefetch
# their inputs, chosen per host (fn.kernels._tuning): on a Zen 5 host 4 KiB ahead brings
# packbits from 86% to 97% of the read bandwidth, while 1 KiB ahead slows the error-feedback
# kernels by about a fifth there, where it was the faster choice on Zen 3 hosts.
# Timed calls stream from memory: their fp32 input alone fills the last-level cache.
_PREFETCH = _tuning.Tuner((0, 256, 1024), min_elements=max(1 << 22, _last_level_cache() // 4))


def tuning_pending() -> bool:
    """Whether a CPU kernel is still timing its candidate prefetch distances (on the first large
    calls of each kind, see ``fn.kernels._tuning``): a benchmark's warm-up lasts until it is not."""
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


@functools.cache
def _torch_sum_lanes() -> int:
    """The fp32 vector length of torch's CPU sum kernel, found by running it: which kernel a
    build dispatches to is not told by ``get_cpu_capability()`` (torch 2.13's AVX512 builds
    sum with 8 lanes). The smallest width whose columns take the ``row_sum`` order: narrower
    outer sums go in groups of 4 columns (rows 0, 1 and 4 tell the two orders apart)."""
    for lanes in (8, 16, 32, 64):
        rows = torch.zeros(5, lanes)
        rows[0], rows[1], rows[4] = 2.0**24, 1.0, -(2.0**24)
        if rows.sum(0)[0] != 0:  # (2^24 + 1) - 2^24 rounds to 0; row_sum adds 1 last
            return lanes
    raise RuntimeError("torch's sum(0) takes no vectorized order up to 64 lanes")


def _torch_sum_tails(ranks: int, chunk: int) -> torch.Tensor:
    """The column ranges that ``torch.sum(dim=0)`` of a contiguous fp32 ``[ranks, chunk]``
    tensor reduces in its ``row_sum`` order (int64 ``[k, 2]``); it reduces the others in its
    ``multi_row_sum`` order. Its threads split the columns into ``ceil(chunk / threads)``
    pieces rounded to 128 bytes; a piece of at least one vector of columns is summed in groups
    of 4 vectors, a shorter one in groups of 4 columns, and the columns past the last whole
    group take the ``row_sum`` order (ATen ``SumKernel.cpp``, ``TensorIteratorReduce.cpp``)."""
    lanes = _torch_sum_lanes()
    threads = torch.get_num_threads()
    pieces = [(0, chunk)]
    if ranks * chunk >= _SUM_GRAIN and threads > 1:
        step = -(-chunk // min(threads, chunk))
        pieces = []
        for begin in range(0, chunk, step):
            end = min(chunk, begin + step)
            begin, end = begin - begin % 32, end if end == chunk else end - end % 32
            if begin != end:
                pieces.append((begin, end))
    tails = []
    for begin, end in pieces:
        width = 4 * lanes if end - begin >= lanes else 4
        if (end - begin) % width:
            tails.append((begin + (end - begin) // width * width, end))
    return torch.tensor(tails, dtype=torch.int64).view(-1, 2)


def _feedback(
    mode: int, error: torch.Tensor, x=None, grad=None, beta: float = 0.0, signs=None, weights=None
) -> tuple[_FeedbackStruct, tuple[torch.Tensor, ...]]:
    """The C description of a source (and the tensors it points into, to keep alive)."""
    keep: tuple[torch.Tensor, ...] = (error,)
    f = _FeedbackStruct(mode=mode, e=error.data_ptr())
    if mode == _FEEDBACK_SIGN_SUM:
        tails = _torch_sum_tails(signs.shape[0], signs.shape[1] * 8)
        f.signs, f.weights, f.ranks, f.row_bytes = (
            signs.data_ptr(),
            weights.data_ptr(),
            signs.shape[0],
            signs.shape[1],
        )
        f.tails, f.ntails = tails.data_ptr(), tails.shape[0]
        keep += (signs, weights, tails)
    else:
        f.n, f.x = x.numel(), x.data_ptr()
        if grad is not None:
            f.mode, f.g = _FEEDBACK_MOMENTUM, grad.data_ptr()
            f.beta, f.one_minus_beta = beta, 1 - beta
            keep += (grad,)
        keep += (x,)
    return f, keep


def _feedback_signs(lib: ctypes.CDLL, f: _FeedbackStruct, length: int, alive: tuple):
    """Phase 1 over ``f``'s source; ``alive`` holds the tensors ``f`` points into."""
    packed = _empty(lib, (length + 7) // 8, torch.uint8)
    blocks = -(-length // _reference.SUMSQ_BLOCK)
    sums = torch.empty(1 << max(0, blocks - 1).bit_length(), dtype=torch.float64)
    pointers = (ctypes.addressof(f), packed.data_ptr(), sums.data_ptr())
    _run_prefetching(lib, "feedback_signs", length, pointers, feedback=f)
    del alive  # the tensors f points into lived until here
    scale = lib.fn_rms(sums.data_ptr(), blocks, sums.numel(), length)
    return packed, torch.tensor(scale, dtype=torch.float32)


def feedback_sign_compress(
    x: torch.Tensor, error: torch.Tensor, grad: torch.Tensor | None = None, beta: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = library()
    if lib is None or not _plain_fp32(x, error, grad):
        return _reference.feedback_sign_compress(x, error, grad, beta)
    f, alive = _feedback(_FEEDBACK_X, error, x, grad, beta)
    return _feedback_signs(lib, f, error.numel(), alive)


def feedback_apply_error(
    x: torch.Tensor,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    grad: torch.Tensor | None = None,
    beta: float = 0.0,
) -> None:
    lib = library()
    if lib is None or not _plain_fp32(x, error, grad, out):
        return _reference.feedback_apply_error(x, error, scale, out, grad, beta)
    f, alive = _feedback(_FEEDBACK_X, error, x, grad, beta)
    pointers = (ctypes.addressof(f), out.data_ptr())
    ints = (_streams(out, error),)
    _run_prefetching(lib, "feedback_error", error.numel(), pointers, ints, float(scale), f)
    del alive  # the tensors f points into lived until here
    return None


def sign_sum_compress(
    signs: torch.Tensor, weights: torch.Tensor, error: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = library()
    if lib is None or not _plain_fp32(weights, error) or not signs.is_contiguous():
        return _reference.sign_sum_compress(signs, weights, error)
    f, alive = _feedback(_FEEDBACK_SIGN_SUM, error, signs=signs, weights=weights)
    return _feedback_signs(lib, f, error.numel(), alive)


def sign_sum_apply_error(
    signs: torch.Tensor,
    weights: torch.Tensor,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
) -> None:
    lib = library()
    if lib is None or not _plain_fp32(weights, error, out) or not signs.is_contiguous():
        return _reference.sign_sum_apply_error(signs, weights, error, scale, out)
    f, alive = _feedback(_FEEDBACK_SIGN_SUM, error, signs=signs, weights=weights)
    pointers = (ctypes.addressof(f), out.data_ptr())
    ints = (_streams(out, error),)
    _run_prefetching(lib, "feedback_error", error.numel(), pointers, ints, float(scale), f)
    del alive  # the tensors f points into lived until here
    return None


def unpack_scaled(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    lib = library()
    if lib is None or not _plain_fp32(scales, out) or not packed.is_contiguous():
        return _reference.unpack_scaled(packed, scales, out)
    pointers = (packed.data_ptr(), scales.data_ptr(), out.data_ptr())
    _run(lib, "unpack_scaled", out.numel(), 8, pointers, (packed.shape[1] * 8, _streams(out)))
    return None


def adam_direction(
    m: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor | None,
    eta: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    bound: float | None,
    weight_decay: float,
) -> None:
    lib = library()
    if lib is None or not _plain_fp32(m, v, p, out):
        return _reference.adam_direction(m, v, p, eta, out, eps, bound, weight_decay)
    _adam_kernel(lib, m, v, p, eta, out, eps, bound, weight_decay, add=False)
    return None


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    lib = library()
    if lib is None or not _plain_fp32(v):
        return _reference.sqrt_rn(v)
    out = _empty(lib, v.numel(), torch.float32)
    _run(lib, "sqrt_rn", v.numel(), 16, (v.data_ptr(), out.data_ptr()))
    return out.view(v.shape)


def _adam_kernel(lib, m, v, p, eta, out, eps, bound, weight_decay, *, add: bool, signs=None):
    """The C ``adam_direction`` job: the direction written into ``out`` or, with ``add``, added
    to it; with ``signs`` (``add`` only), ``m`` is written from them as it is used
    (:func:`adam_apply`)."""
    constants = torch.tensor([eps, 0.0 if bound is None else bound, weight_decay])
    decayed = None if p is None else p.data_ptr()
    flags = int(bound is not None) | (2 if add else 0)  # 2: add the direction to out
    momentum = m.data_ptr()
    if signs is not None:
        packed, scales = signs
        signed = _SignedMomentum(
            packed.data_ptr(), scales.data_ptr(), packed.shape[1] * 8, _streams(m), m.data_ptr()
        )
        momentum, flags = ctypes.addressof(signed), flags | 4  # 4: m from the signs
    pointers = (momentum, v.data_ptr(), decayed, constants.data_ptr(), out.data_ptr())
    _run(lib, "adam_direction", out.numel(), 16, pointers, (flags,), -float(eta))


class _SignedMomentum(ctypes.Structure):
    """Mirror of the C ``fn_signed_momentum``."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("chunk", ctypes.c_int64),
        ("stream", ctypes.c_int64),
        ("m", ctypes.c_void_p),
    ]


def adam_apply(
    m: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    params: torch.Tensor,
    root: torch.Tensor | None,
    eps: float,
    bound: float | None,
    weight_decay: float,
    signs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    lib = library()
    plain_signs = signs is None or (signs[0].is_contiguous() and _plain_fp32(signs[1]))
    if lib is None or not _plain_fp32(m, v, params) or not plain_signs:
        return _reference.adam_apply(m, v, eta, params, root, eps, bound, weight_decay, signs)
    decayed = params if weight_decay else None
    _adam_kernel(lib, m, v, decayed, eta, params, eps, bound, weight_decay, add=True, signs=signs)
    return None


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    lib = library()
    if lib is None or bits not in (4, 8) or group_size < 2 or group_size % 2:
        return _reference.quantize(x, bits, group_size)
    x = _fp32(x)
    groups = -(-x.numel() // group_size)
    q = _empty(lib, groups * group_size * bits // 8, torch.uint8)
    scales = torch.empty(groups, dtype=torch.float32)
    pointers = (x.data_ptr(), q.data_ptr(), scales.data_ptr())
    _run(lib, "quantize", x.numel(), group_size, pointers, (bits, group_size))
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    lib = library()
    groups = scales.numel()
    values = q.numel() * 8 // bits if bits in (4, 8) else 0
    if lib is None or not groups or values % groups or n > values:
        return _reference.dequantize(q, scales, bits, n)
    q = q.detach().contiguous()
    scales = _fp32(scales)
    out = _empty(lib, n, torch.float32)
    pointers = (q.data_ptr(), scales.data_ptr(), out.data_ptr())
    _run(lib, "dequantize", n, 2, pointers, (bits, values // groups))
    return out


def _writable_fp32(out: torch.Tensor) -> bool:
    return out.dtype == torch.float32 and out.is_contiguous() and out.device.type == "cpu"


def _rows_layout(
    n: int, numel: int, rows: tuple[int, int, int] | None
) -> tuple[int, int, int, int]:
    """The C ``rows_layout`` (row, padded row, nodes, local) of ``rows = (row, padded_row,
    local)``; ``None``: one row of ``n`` values padded to ``numel``."""
    if rows is None:
        return (n, numel, 1, 1)
    row, padded_row, local = rows
    return (row, padded_row, n // row // local, local)


def loco_quantize(
    x: torch.Tensor,
    error: torch.Tensor | None,
    bits: int,
    group_size: int,
    numel: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    lib = library()
    fits = out is None or (out[0].is_contiguous() and _writable_fp32(out[1]))
    if lib is None or numel % group_size or x.numel() > numel or not fits:
        return _reference.loco_quantize(x, error, bits, group_size, numel, out, rows)
    x = _fp32(x)
    e = None if error is None else _fp32(error)
    if out is None:
        out = (
            _empty(lib, numel * bits // 8, torch.uint8),
            torch.empty(numel // group_size, dtype=torch.float32),
        )
    q, scales = out
    pointers = (
        x.data_ptr(),
        None if e is None else e.data_ptr(),
        q.data_ptr(),
        scales.data_ptr(),
    )
    ints = (bits, group_size, *_rows_layout(x.numel(), numel, rows))
    _run(lib, "loco_quantize", numel, group_size, pointers, ints)
    return q, scales


def loco_error(
    x: torch.Tensor,
    error: torch.Tensor | None,
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    err_beta: float,
    out: torch.Tensor,
    rows: tuple[int, int, int] | None = None,
) -> None:
    lib = library()
    n = out.numel()
    if lib is None or not _writable_fp32(out) or not scales.numel() or n % scales.numel():
        return _reference.loco_error(x, error, q, scales, bits, err_beta, out, rows)
    x = _fp32(x)
    e = None if error is None else _fp32(error)
    q = q.detach().contiguous()
    scales = _fp32(scales)
    pointers = (
        x.data_ptr(),
        None if e is None else e.data_ptr(),
        q.data_ptr(),
        scales.data_ptr(),
        out.data_ptr(),
    )
    ints = (bits, n // scales.numel(), *_rows_layout(x.numel(), n, rows))
    _run(lib, "loco_error", n, 1, pointers, ints, scale=1 - err_beta, scale2=err_beta)
    return None


def dequantize_sum(
    q: torch.Tensor, scales: torch.Tensor, bits: int, pieces: int, out: torch.Tensor
) -> None:
    lib = library()
    cols = out.numel()
    groups = scales.numel()
    if lib is None or not _writable_fp32(out) or not groups:
        return _reference.dequantize_sum(q, scales, bits, pieces, out)
    q = q.detach().contiguous()
    scales = _fp32(scales)
    tails = _torch_sum_tails(pieces, cols)
    pointers = (q.data_ptr(), scales.data_ptr(), out.data_ptr(), tails.data_ptr())
    ints = (bits, pieces * cols // groups, pieces, cols, tails.shape[0])
    _run(lib, "dequantize_sum", cols, 1, pointers, ints)
    return None


def dequantize_into(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    out: torch.Tensor,
    chunks: int,
    local_world_size: int = 1,
) -> None:
    lib = library()
    groups = scales.numel()
    values = q.numel() * 8 // bits
    whole = groups and not values % groups and not values % chunks
    if lib is None or not _writable_fp32(out) or not whole or values // chunks % (values // groups):
        return _reference.dequantize_into(q, scales, bits, out, chunks, local_world_size)
    q = q.detach().contiguous()
    scales = _fp32(scales)
    pointers = (q.data_ptr(), scales.data_ptr(), out.data_ptr())
    ints = (bits, values // groups, values // chunks, chunks // local_world_size, local_world_size)
    _run(lib, "dequantize_into", out.numel(), 2, pointers, ints)
    return None


class _AdamWStruct(ctypes.Structure):
    """Mirror of the C ``fn_adamw``: the leaves and constants of one fn.adamw step."""

    _fields_ = [
        ("table", ctypes.c_void_p),
        ("count", ctypes.c_int64),
        ("lanes", ctypes.c_int64),
        ("fp64", ctypes.c_int64),
        ("decayed", ctypes.c_int64),
        ("small_lerp", ctypes.c_int64),
        ("decay", ctypes.c_double),
        ("w", ctypes.c_double),
        ("b2", ctypes.c_double),
        ("c2", ctypes.c_double),
        ("bc2_sqrt", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("neg_step", ctypes.c_double),
    ]


_ADAMW_DTYPES = (torch.float32, torch.float64)
_ADAM_VECTOR_BYTES = (32, 64)  # torch's 256-bit and 512-bit CPU kernels


@functools.lru_cache(maxsize=64)
def _small_lerp(beta1: float, dtype: torch.dtype) -> bool:
    """torch's test for its lerp branch: ``|1 - beta1|`` rounded to ``dtype`` below 1/2."""
    return abs(torch.tensor(1.0 - beta1, dtype=dtype).item()) < 0.5


@functools.cache
def _adamw_lanes(dtype: torch.dtype, small_lerp: bool) -> int | None:
    """The vector length (values of ``dtype``) with which the C kernel gives the reference's
    bits on this build, or ``None`` where no length does (the reference runs). torch's kernel
    rounds its vector lanes and its scalar tail as its build contracts them (see ``_cpu.c``),
    and which vector length it runs is not told by ``get_cpu_capability()`` (torch 2.13's
    AVX512 builds run its 256-bit kernel): each (dtype, lerp branch) is checked once, for each
    length, on random data covering vector lanes and many tails."""
    gen = torch.Generator().manual_seed(0)
    ps, gs, ms, vs = [], [], [], []
    for n in (4096 + 63, *range(1, 64), *range(1, 64)):  # vector lanes, every tail length
        scale = torch.pow(10.0, torch.randint(-6, 2, (n,), generator=gen)).to(dtype)
        ps.append(torch.randn(n, generator=gen, dtype=dtype))
        gs.append(torch.randn(n, generator=gen, dtype=dtype) * scale)
        gs[-1][::5] = -0.0  # signed zeros tell the lerp forms apart at beta1 = 0
        ms.append(torch.randn(n, generator=gen, dtype=dtype) * 0.1)
        vs.append(torch.rand(n, generator=gen, dtype=dtype) * 0.1)
    betas = (0.9,) if small_lerp else (0.3, 0.0)
    for lanes in (nbytes // dtype.itemsize for nbytes in _ADAM_VECTOR_BYTES):
        if all(_adamw_matches(lanes, ps, gs, ms, vs, beta1) for beta1 in betas):
            return lanes
    return None


def _adamw_matches(lanes, ps, gs, ms, vs, beta1) -> bool:
    """Whether the C kernel with ``lanes`` gives the reference's bits on these leaves."""
    bits = torch.int32 if ps[0].dtype == torch.float32 else torch.int64
    outs = []
    for impl in (_reference.adamw_step, functools.partial(_adamw_c, lanes=lanes)):
        p, m, v = ([x.clone() for x in xs] for xs in (ps, ms, vs))
        impl(p, gs, m, v, m, v, 3.0, 1e-3, beta1, 0.999, 1e-8, 0.01)
        outs.append(torch.cat(p + m + v).view(bits))
    return torch.equal(*outs)


def _adamw_c(
    ps, gs, ms, vs, m_outs, v_outs, step, lr, beta1, beta2, eps, weight_decay, *, lanes=None
):
    """The C kernel over all leaves in one job, the scalars computed as torch's kernel does
    (in fp64); ``lanes``: its vector length (default: the one checked for this build)."""
    sizes = [p.numel() for p in ps]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    addresses = [t.data_ptr() for ts in (ps, gs, ms, vs, m_outs, v_outs) for t in ts]
    table = torch.tensor(addresses + starts, dtype=torch.int64)
    dtype = ps[0].dtype
    if lanes is None:
        lanes = _adamw_lanes(dtype, _small_lerp(beta1, dtype))
    args = _AdamWStruct(
        table.data_ptr(), len(ps), lanes, dtype == torch.float64,
        weight_decay != 0.0, _small_lerp(beta1, dtype), 1.0 - lr * weight_decay, 1.0 - beta1,
        beta2, 1.0 - beta2, math.sqrt(1.0 - beta2**step), eps, -(lr / (1.0 - beta1**step)),
    )  # fmt: skip
    _run(library(), "adamw_step", starts[-1], 16, (ctypes.addressof(args),))
    del table  # the job read it until here


def adamw_step_runs(dtype: torch.dtype | None, beta1: float) -> bool:
    """Whether :func:`adamw_step` runs the C kernel (not the reference) on contiguous CPU
    tensors of ``dtype``: a compiler works, ``dtype`` is fp32 or fp64, and the kernel follows
    torch's rounding on this build (checked once per dtype and lerp branch)."""
    return (
        dtype in _ADAMW_DTYPES
        and library() is not None
        and _adamw_lanes(dtype, _small_lerp(beta1, dtype)) is not None
    )


def adamw_step(
    ps: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    m_outs: list[torch.Tensor],
    v_outs: list[torch.Tensor],
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    operands = (ps, gs, ms, vs, m_outs, v_outs)
    dtype = ps[0].dtype if ps else None
    if (
        not ps
        or not adamw_step_runs(dtype, beta1)
        or not all(
            t.dtype == dtype and t.is_cpu and t.is_contiguous() for ts in operands for t in ts
        )
    ):
        return _reference.adamw_step(*operands, step, lr, beta1, beta2, eps, weight_decay)
    _adamw_c(*operands, step, lr, beta1, beta2, eps, weight_decay)
    return None
