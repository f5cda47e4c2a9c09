"""Triton implementations for CUDA and XPU: packbits, unpackbits and sign_compress.

Triton is imported on the first call; without it (one warning) the reference runs. The sign
kernel writes the packed signs and the canonical fp64 block sums in one pass; the scale and
the new error come from the same formulas as the reference, so results are bit-identical.
quantize/dequantize use the reference (vectorized torch ops) on these devices.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from types import ModuleType

import torch

from fn.kernels import _reference

_GROUP = 16  # blocks of 1024 elements per program of the sign kernel
_BYTES = 512  # packed bytes per program of the packbits kernel
_UNPACK = 4096  # outputs per program of the unpackbits kernel
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType | None:
    if importlib.util.find_spec("triton") is None:
        warnings.warn(
            "fn.kernels: Triton is not installed; CUDA/XPU kernels fall back to the reference.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    from fn.kernels import _triton_kernels

    return _triton_kernels


def packbits(x: torch.Tensor) -> torch.Tensor:
    k = _kernels()
    if k is None or x.dtype not in _FLOATS:
        return _reference.packbits(x)
    x = x.contiguous()
    n = x.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    if n:
        k.packbits_kernel[(-(-out.numel() // _BYTES),)](x, out, n, BYTES=_BYTES)
    return out


def unpackbits(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    k = _kernels()
    if k is None or dtype not in _FLOATS or packed.numel() * 8 < n:
        return _reference.unpackbits(packed, n, dtype)
    packed = packed.contiguous()
    out = torch.empty(n, dtype=dtype, device=packed.device)
    if n:
        k.unpackbits_kernel[(-(-n // _UNPACK),)](packed, out, n, BLOCK=_UNPACK)
    return out


def sign_compress(
    m: torch.Tensor, error: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    k = _kernels()
    if k is None:
        return _reference.sign_compress(m, error)
    v = (m.float() if error is None else m.float() + error.float()).contiguous()
    n = v.numel()
    blocks = -(-n // _reference.SUMSQ_BLOCK)
    packed = torch.empty((n + 7) // 8, dtype=torch.uint8, device=v.device)
    sums = torch.empty(blocks, dtype=torch.float64, device=v.device)
    if n:
        grid = (-(-blocks // _GROUP),)
        k.sign_blocks_kernel[grid](v, packed, sums, n, GROUP=_GROUP, BLOCK=_reference.SUMSQ_BLOCK)
    scale = _reference.rms_from_block_sums(sums, n)
    new_error = None if error is None else v - torch.where(v >= 0, scale, -scale)
    return packed, scale, new_error
