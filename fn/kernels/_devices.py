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
from fn.kernels._spec import implementations

_CPU_KERNELS = implementations(_cpu)
_TRITON_KERNELS = implementations(_triton)


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
            {"triton": _TRITON_KERNELS, "cupy": implementations(_cupy)},
        ),
        Accelerator("xpu", torch.xpu.is_available, _xpu_backend, {"triton": _TRITON_KERNELS}),
        Accelerator("npu", _npu_available, "hccl", {"torch_npu": implementations(_npu)}),
        Accelerator("hpu", _hpu_available, "hccl"),
        Accelerator("mps", torch.backends.mps.is_available, None),
    ]
