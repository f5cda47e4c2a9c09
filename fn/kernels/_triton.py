"""Triton implementations for CUDA and XPU, each a function of its kernel's name: ``packbits``,
``unpackbits``, ``sign_compress``, the error-feedback phases, ``unpack_scaled``,
``adam_direction``, ``quantize`` and ``dequantize``. The others run the reference there: the
sums over ranks (``sign_sum_compress`` / ``sign_sum_apply_error``, ``dequantize_sum``: rank by
rank, as ``fn.kernels.sum_ranks`` adds), the LoCo kernels, ``sqrt_rn`` (one elementwise op that
the reference's fp64 root serves on a GPU), ``adam_apply`` and ``adamw_step``, and the
error-feedback phases given the previous momentum as packed signs (``signs=``).

Results are bit-identical to ``fn.kernels._reference`` for fp32, fp16 and bf16 inputs. The
sign kernel writes the packed signs and the canonical fp64 block sums in one pass; the scale
and the new error come from the same formulas as the reference.

Safety:

- Every launch runs under the input's device (``torch.cuda.device(t.device)``, or the device
  module of its type), so it goes to that device and its current stream whatever device is
  current.
- Triton is imported on the first call. Without Triton, or when its import, a compilation or a
  launch fails (a broken driver, a wrong build), one ``RuntimeWarning`` names the error and
  every later call of this module runs the reference kernels.
- Devices without fp64 (``has_fp64`` false in the device properties, e.g. some Intel GPUs)
  run the sign kernel on integer emulation of the fp64 additions (bit-identical results);
  the block sums come back as their int64 bit patterns and are folded on the CPU.
- Tensors on the CPU run the kernels under ``TRITON_INTERPRET=1`` (used by the tests).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import warnings
from types import ModuleType
from typing import Any

import torch

from fn.kernels import _reference
from fn.kernels._spec import implementation

_GROUP = 16  # blocks of 1024 elements per program of the sign kernel
_BYTES = 512  # packed bytes per program of the packbits kernel
_UNPACK = 4096  # elements per program of the elementwise kernels (_launch_elementwise)
_TILE = 4096  # elements per tile of the quantize kernel (rows x chunk)
# The interpreter runs programs one after another, paying per operation: on the CPU every
# program takes this many times more work. Results do not depend on the program sizes.
_INTERPRETER_SCALE = 16
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_FAILURES: list[BaseException] = []  # the first Triton failure; Triton is off after it


def _disable(error: BaseException, what: str) -> None:
    _FAILURES.append(error)
    warnings.warn(
        f"fn.kernels: Triton {what} failed ({type(error).__name__}: {error}); CUDA/XPU "
        "kernels run the reference from now on.",
        RuntimeWarning,
        stacklevel=4,
    )


@functools.lru_cache(maxsize=1)
def _import_kernels() -> ModuleType | None:
    if importlib.util.find_spec("triton") is None:
        warnings.warn(
            "fn.kernels: Triton is not installed; CUDA/XPU kernels fall back to the reference.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    try:
        return importlib.import_module("fn.kernels._triton_kernels")
    except Exception as error:  # a broken install: anything its import raises
        _disable(error, "import")
        return None


def _device_guard(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cpu":  # the interpreter
        return contextlib.nullcontext()
    return torch.get_device_module(device.type).device(device)


def _launch(kernel: Any, grid: tuple[int, ...], device: torch.device, *args: Any, **meta: Any):
    """Runs ``kernel[grid](*args, **meta)`` on ``device``; ``False`` when Triton failed."""
    try:
        with _device_guard(device):
            kernel[grid](*args, **meta)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # a compiler or driver failure: anything the launch raises
        _disable(error, f"launch of {getattr(kernel, '__name__', kernel)}")
        return False
    return True


def _per_program(size: int, device: torch.device) -> int:
    return size * _INTERPRETER_SCALE if device.type == "cpu" else size


def _launch_elementwise(
    kernel: Any, n: int, device: torch.device, *args: Any, **meta: Any
) -> bool | None:
    """Runs ``kernel(*args, BLOCK=..., **meta)`` over ``n`` elements, ``_UNPACK`` a program:
    ``True``, or ``None`` (the reference runs) when Triton failed."""
    block = _per_program(_UNPACK, device)
    if n and not _launch(kernel, (_cdiv(n, block),), device, *args, BLOCK=block, **meta):
        return None
    return True


def _has_fp64(device: torch.device) -> bool:
    if device.type in ("cpu", "cuda"):
        return True
    properties = torch.get_device_module(device.type).get_device_properties(device)
    return bool(getattr(properties, "has_fp64", True))


# A Triton host function gets the kernel module; the reference runs without it (Triton missing
# or failed) or when the function returns None (an input it does not take, or a failed launch).
_with_triton = implementation(lambda: None if _FAILURES else _import_kernels())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@_with_triton
def packbits(k: ModuleType, x):
    if x.dtype not in _FLOATS:
        return None
    x = x.contiguous()
    n = x.numel()
    out = torch.empty(_cdiv(n, 8), dtype=torch.uint8, device=x.device)
    per_program = _per_program(_BYTES, x.device)
    if n and not _launch(
        k.packbits_kernel,
        (_cdiv(out.numel(), per_program),),
        x.device,
        x,
        out,
        n,
        out.numel(),
        BYTES=per_program,
    ):
        return None
    return out


@_with_triton
def unpackbits(k: ModuleType, packed, n, dtype=torch.float32):
    if dtype not in _FLOATS or packed.numel() * 8 < n:
        return None
    packed = packed.contiguous()
    out = torch.empty(n, dtype=dtype, device=packed.device)
    if not _launch_elementwise(k.unpackbits_kernel, n, packed.device, packed, out, n):
        return None
    return out


def _fp32_contiguous(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.is_contiguous()) for t in tensors)


def _sign_blocks(
    kernel: Any,
    device: torch.device,
    length: int,
    inputs: tuple[Any, ...],
    lengths: tuple[int, ...],
    scalars: tuple[float, ...] = (),
    **meta: Any,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Launches a sign-blocks kernel as ``kernel(*inputs, packed, sums, *lengths, nbytes,
    nblocks, *scalars)`` over ``length`` elements; returns the packed signs and the scale."""
    blocks = _cdiv(length, _reference.SUMSQ_BLOCK)
    fp64 = _has_fp64(device)
    group = _per_program(_GROUP, device)
    packed = torch.empty(_cdiv(length, 8), dtype=torch.uint8, device=device)
    sums = torch.empty(blocks, dtype=torch.float64 if fp64 else torch.int64, device=device)
    if length and not _launch(
        kernel,
        (_cdiv(blocks, group),),
        device,
        *inputs,
        packed,
        sums,
        *lengths,
        packed.numel(),
        blocks,
        *scalars,
        GROUP=group,
        BLOCK=_reference.SUMSQ_BLOCK,
        FP64=fp64,
        **meta,
    ):
        return None
    if fp64:
        return packed, _reference.rms_from_block_sums(sums, length)
    return packed, _reference.rms_from_block_sums(sums.cpu().view(torch.float64), length).to(device)


@_with_triton
def sign_compress(k: ModuleType, m, error=None):
    if error is not None:
        v = (m.float() + error.float()).contiguous()
    else:  # the kernel converts fp16/bf16 to fp32 itself
        v = (m if m.dtype in _FLOATS else m.float()).contiguous()
    n = v.numel()
    signs = _sign_blocks(k.sign_blocks_kernel, v.device, n, (v,), (n,))
    if signs is None:
        return None
    packed, scale = signs
    new_error = None if error is None else v - torch.where(v >= 0, scale, -scale)
    return packed, scale, new_error


@_with_triton
def feedback_sign_compress(k: ModuleType, x, error, grad=None, beta=0.0, signs=None):
    if signs is not None or not _fp32_contiguous(x, error, grad):
        return None  # the momentum given as signs: the reference
    return _sign_blocks(
        k.feedback_blocks_kernel,
        error.device,
        error.numel(),
        (x, x if grad is None else grad, error),
        (x.numel(), error.numel()),
        (float(beta), 1 - float(beta)),
        MOMENTUM=grad is not None,
        enable_fp_fusion=False,
    )


@_with_triton
def feedback_apply_error(k: ModuleType, x, error, scale, out, grad=None, beta=0.0, signs=None):
    if signs is not None or not _fp32_contiguous(x, error, grad, out, scale):
        return None
    length = error.numel()
    return _launch_elementwise(
        k.feedback_error_kernel,
        length,
        error.device,
        x,
        x if grad is None else grad,
        error,
        scale,
        out,
        x.numel(),
        length,
        float(beta),
        1 - float(beta),
        MOMENTUM=grad is not None,
        enable_fp_fusion=False,
    )


@_with_triton
def unpack_scaled(k: ModuleType, packed, scales, out):
    if not _fp32_contiguous(scales, out) or not packed.is_contiguous():
        return None
    n = out.numel()
    return _launch_elementwise(
        k.unpack_scaled_kernel, n, out.device, packed, scales, out, n, packed.shape[1] * 8
    )


@_with_triton
def adam_direction(k: ModuleType, m, v, p, eta, out, eps, bound, weight_decay):
    if not _fp32_contiguous(m, v, p, out):
        return None
    n = out.numel()
    return _launch_elementwise(
        k.adam_direction_kernel,
        n,
        out.device,
        m,
        v,
        m if p is None else p,
        out,
        n,
        float(eps),
        0.0 if bound is None else float(bound),
        float(weight_decay),
        -float(eta),
        CLAMP=bound is not None,
        DECAY=p is not None,
        enable_fp_fusion=False,
    )


@_with_triton
def quantize(k: ModuleType, x, bits, group_size):
    if x.dtype not in _FLOATS or bits not in (4, 8) or group_size < 2 or group_size % 2:
        return None  # the reference raises the argument errors
    x = x.contiguous()
    n = x.numel()
    groups = _cdiv(n, group_size)
    q = torch.empty(groups * group_size * bits // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(groups, dtype=torch.float32, device=x.device)
    tile = _per_program(_TILE, x.device)
    chunk = min(1 << (group_size - 1).bit_length(), tile)  # a power of 2
    rows = tile // chunk
    if groups and not _launch(
        k.quantize_kernel,
        (_cdiv(groups, rows),),
        x.device,
        x,
        q,
        scales,
        n,
        groups,
        group_size,
        _cdiv(group_size, chunk),
        ROWS=rows,
        CHUNK=chunk,
        BITS=bits,
    ):
        return None
    return q, scales


@_with_triton
def dequantize(k: ModuleType, q, scales, bits, n):
    values = q.numel() * 8 // bits if bits in (4, 8) else 0
    groups = scales.numel()
    if bits not in (4, 8) or scales.dtype != torch.float32 or not groups or n > values:
        return None
    q, scales = q.contiguous(), scales.contiguous()
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    if not _launch_elementwise(
        k.dequantize_kernel, n, q.device, q, scales, out, n, values // groups, BITS=bits
    ):
        return None
    return out
