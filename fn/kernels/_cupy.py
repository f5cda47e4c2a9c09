"""CuPy kernel set for CUDA (DeepSpeed's original path): ``cupy.packbits`` and
``cupy.unpackbits`` on the tensors' memory, shared through DLPack (no copies).

The set is the CUDA record's ``"cupy"`` kernel set: ``FN_KERNELS=cupy`` (or
``fn.kernels.select_kernels("cuda", "cupy")``) selects it; ``pip install fn-optim[cuda]``
installs ``cupy-cuda12x``. ``cupy.packbits`` packs most-significant-bit first with zero tail
bits, fn's layout. sign_compress packs with CuPy and takes the scale and the new error from the
reference formulas; quantize/dequantize run the reference. CuPy runs on the tensor's device and
on torch's current stream of that device. Without CuPy (one warning) the reference runs.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from types import ModuleType
from typing import Any

import torch

from fn.kernels import _reference
from fn.kernels._spec import implementation

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _cupy() -> ModuleType | None:
    try:
        import cupy
    except Exception as error:  # not installed, or a broken CUDA install
        warnings.warn(
            f"fn.kernels: CuPy is unavailable ({type(error).__name__}: {error}); the 'cupy' "
            "kernel set runs the reference.",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    return cupy


def _on_device(cp: ModuleType, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """CuPy's current device and stream set to ``device`` and torch's current stream there."""
    if device.type != "cuda":  # CPU tensors: a CPU stand-in for CuPy (the tests)
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(cp.cuda.Device(device.index))
    stream = torch.cuda.current_stream(device)
    stack.enter_context(cp.cuda.ExternalStream(stream.cuda_stream, device.index))
    return stack


_with_cupy = implementation(_cupy)


@_with_cupy
def packbits(cp: ModuleType, x):
    if x.dtype not in _FLOATS:
        return None
    signs = (x >= 0).contiguous()
    with _on_device(cp, x.device):
        packed = cp.packbits(cp.from_dlpack(signs))
    return torch.from_dlpack(packed)


@_with_cupy
def unpackbits(cp: ModuleType, packed, n, dtype=torch.float32):
    with _on_device(cp, packed.device):
        bits = cp.unpackbits(cp.from_dlpack(packed.contiguous()))[:n]
    one = torch.ones((), dtype=dtype, device=packed.device)
    return torch.where(torch.from_dlpack(bits) != 0, one, -one)


@implementation()
def sign_compress(m, error=None):
    return _reference.sign_compress_with(packbits, m, error)
