"""The built-in device records: cpu, cuda, xpu, npu, hpu, mps.

``torch_npu`` / ``habana_frameworks`` are imported only when their record's availability is
asked for; Triton and CuPy on the first call of one of their kernels. CUDA offers two kernel
sets: ``"triton"`` (the default) and ``"cupy"``.
"""

from __future__ import annotations

import importlib.util

import torch

from fn.kernels import _cpu, _cupy, _npu, _triton
from fn.kernels._accelerator import Accelerator

_CPU_KERNELS = {
    "packbits": _cpu.packbits,
    "unpackbits": _cpu.unpackbits,
    "sign_compress": _cpu.sign_compress,
    "feedback_sign_compress": _cpu.feedback_sign_compress,
    "feedback_apply_error": _cpu.feedback_apply_error,
    "sign_sum_compress": _cpu.sign_sum_compress,
    "sign_sum_apply_error": _cpu.sign_sum_apply_error,
    "unpack_scaled": _cpu.unpack_scaled,
    "adam_direction": _cpu.adam_direction,
    "adam_apply": _cpu.adam_apply,
    "adamw_step": _cpu.adamw_step,
    "sqrt_rn": _cpu.sqrt_rn,
    "quantize": _cpu.quantize,
    "dequantize": _cpu.dequantize,
    "loco_quantize": _cpu.loco_quantize,
    "loco_error": _cpu.loco_error,
    "dequantize_sum": _cpu.dequantize_sum,
    "dequantize_into": _cpu.dequantize_into,
}
_TRITON_KERNELS = {
    "packbits": _triton.packbits,
    "unpackbits": _triton.unpackbits,
    "sign_compress": _triton.sign_compress,
    "feedback_sign_compress": _triton.feedback_sign_compress,
    "feedback_apply_error": _triton.feedback_apply_error,
    "unpack_scaled": _triton.unpack_scaled,
    "adam_direction": _triton.adam_direction,
    "quantize": _triton.quantize,
    "dequantize": _triton.dequantize,
}
_NPU_KERNELS = {"packbits": _npu.packbits, "sign_compress": _npu.sign_compress}


def _npu_available() -> bool:
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.is_available()


def _hpu_available() -> bool:
    import habana_frameworks.torch.hpu as hpu  # registers torch.hpu

    return hpu.is_available()


def _xpu_backend() -> str:
    # Intel's oneCCL bindings register "ccl"; recent torch has the built-in "xccl".
    return "ccl" if importlib.util.find_spec("oneccl_bindings_for_pytorch") else "xccl"


def builtin() -> list[Accelerator]:
    """The records fn ships with."""
    return [
        Accelerator("cpu", lambda: True, "gloo", {"c": _CPU_KERNELS}),
        Accelerator(
            "cuda",
            torch.cuda.is_available,
            "nccl",
            {"triton": _TRITON_KERNELS, "cupy": _cupy.KERNELS},
        ),
        Accelerator("xpu", torch.xpu.is_available, _xpu_backend, {"triton": _TRITON_KERNELS}),
        Accelerator("npu", _npu_available, "hccl", {"torch_npu": _NPU_KERNELS}),
        Accelerator("hpu", _hpu_available, "hccl"),
        Accelerator("mps", torch.backends.mps.is_available, None),
    ]
