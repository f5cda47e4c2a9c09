"""The built-in device records: cpu, cuda, xpu, npu, hpu, mps.

Every runtime is returned by a function, so ``torch_npu`` / ``habana_frameworks`` are imported
only when a runtime call needs them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

from fn.kernels import _cpu, _npu, _triton
from fn.kernels._accelerator import Accelerator

_CPU_KERNELS = {
    "packbits": _cpu.packbits,
    "unpackbits": _cpu.unpackbits,
    "sign_compress": _cpu.sign_compress,
    "quantize": _cpu.quantize,
    "dequantize": _cpu.dequantize,
}
_TRITON_KERNELS = {
    "packbits": _triton.packbits,
    "unpackbits": _triton.unpackbits,
    "sign_compress": _triton.sign_compress,
}
_NPU_KERNELS = {"packbits": _npu.packbits, "sign_compress": _npu.sign_compress}


def _peak_rss() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return _peak_rss()


def _cpu_runtime() -> types.SimpleNamespace:
    # Host memory "allocated" is the resident set size of this process.
    return types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        synchronize=lambda device=None: None,
        empty_cache=lambda: None,
        memory_allocated=lambda device=None: _rss(),
        max_memory_allocated=lambda device=None: max(_peak_rss(), _rss()),
        manual_seed=torch.manual_seed,
    )


def _mps_max_memory_allocated(device=None) -> int:
    raise NotImplementedError("torch.mps keeps no peak-memory counter")


def _mps_runtime() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        is_available=torch.backends.mps.is_available,
        device_count=lambda: int(torch.backends.mps.is_available()),
        current_device=lambda: 0,
        synchronize=lambda device=None: torch.mps.synchronize(),
        empty_cache=torch.mps.empty_cache,
        memory_allocated=lambda device=None: torch.mps.current_allocated_memory(),
        max_memory_allocated=_mps_max_memory_allocated,
        manual_seed=torch.mps.manual_seed,
    )


def _npu_runtime() -> types.ModuleType:
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu


def _hpu_runtime() -> types.SimpleNamespace:
    import habana_frameworks.torch.hpu as hpu

    return types.SimpleNamespace(
        is_available=hpu.is_available,
        device_count=hpu.device_count,
        current_device=hpu.current_device,
        synchronize=lambda device=None: hpu.synchronize(),
        # The HPU runtime exposes no allocator cache to release.
        empty_cache=lambda: None,
        memory_allocated=hpu.memory_allocated,
        max_memory_allocated=hpu.max_memory_allocated,
        manual_seed=hpu.random.manual_seed,
    )


def _xpu_backend() -> str:
    # Intel's oneCCL bindings register "ccl"; recent torch has the built-in "xccl".
    return "ccl" if importlib.util.find_spec("oneccl_bindings_for_pytorch") else "xccl"


def builtin() -> list[Accelerator]:
    """The records fn ships with."""
    return [
        Accelerator("cpu", _cpu_runtime, "gloo", _CPU_KERNELS, pins_memory=False),
        Accelerator("cuda", lambda: torch.cuda, "nccl", _TRITON_KERNELS),
        Accelerator("xpu", lambda: torch.xpu, _xpu_backend, _TRITON_KERNELS),
        Accelerator("npu", _npu_runtime, "hccl", _NPU_KERNELS),
        Accelerator("hpu", _hpu_runtime, "hccl"),
        Accelerator("mps", _mps_runtime, None, pins_memory=False),
    ]
