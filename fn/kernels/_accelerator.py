"""The :class:`Accelerator` record: what the accelerator table knows about one device type.

A record names the device, its ``torch.distributed`` backend, wraps the device runtime
(``torch.cuda``, ``torch.xpu``, ``torch_npu``, ...) and maps kernel names to implementations.
Device modules are imported lazily, on the first runtime call, never when ``fn`` is imported.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

KERNEL_NAMES = ("packbits", "unpackbits", "sign_compress", "quantize", "dequantize")


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """A device type: names, communication backend, runtime calls and kernels.

    Args:
        name: the torch device type, e.g. ``"cuda"``.
        runtime: zero-argument callable returning the device runtime (an object with the
            ``torch.cuda``-style functions ``is_available``, ``device_count``,
            ``current_device``, ``synchronize``, ``empty_cache``, ``memory_allocated``,
            ``max_memory_allocated``, ``manual_seed``); called lazily. Raising ``ImportError``
            means the device's package is not installed.
        backend: the ``torch.distributed`` backend name, ``None`` when there is none, or a
            zero-argument callable returning it (decided at call time).
        kernels: kernel name (one of ``KERNEL_NAMES``) to implementation, with the signature
            and the bit-exact semantics of ``fn.kernels._reference``. Missing kernels use the
            reference.
        pins_memory: whether :meth:`pin_memory` pins host tensors for this device.
    """

    name: str
    runtime: Callable[[], Any]
    backend: str | None | Callable[[], str | None] = None
    kernels: Mapping[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    pins_memory: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.kernels) - set(KERNEL_NAMES)
        if unknown:
            raise ValueError(f"unknown kernel names {sorted(unknown)}; valid: {KERNEL_NAMES}")
        object.__setattr__(self, "kernels", types.MappingProxyType(dict(self.kernels)))

    def device_name(self, idx: int | None = None) -> str:
        """``"cuda"`` for ``idx=None``, else ``"cuda:idx"``."""
        return self.name if idx is None else f"{self.name}:{idx}"

    def current_device_name(self) -> str:
        """The current device, e.g. ``"cuda:0"`` (``"cpu"`` for the CPU)."""
        return "cpu" if self.name == "cpu" else self.device_name(self.current_device())

    def communication_backend_name(self) -> str | None:
        """The ``torch.distributed`` backend for this device (``None`` when there is none)."""
        return self.backend() if callable(self.backend) else self.backend

    def is_available(self) -> bool:
        """Whether the device's package is installed and at least one device is usable."""
        try:
            return bool(self.runtime().is_available())
        except ImportError:
            return False

    def device_count(self) -> int:
        return int(self.runtime().device_count())

    def current_device(self) -> int:
        return int(self.runtime().current_device())

    def synchronize(self, device: Any = None) -> None:
        self.runtime().synchronize(device)

    def empty_cache(self) -> None:
        self.runtime().empty_cache()

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of a host tensor (the tensor itself where pinning does not apply)."""
        return tensor.pin_memory() if self.pins_memory else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device type."""
        return tensor.device.type == self.name

    def memory_allocated(self, device: Any = None) -> int:
        return int(self.runtime().memory_allocated(device))

    def max_memory_allocated(self, device: Any = None) -> int:
        return int(self.runtime().max_memory_allocated(device))

    def manual_seed(self, seed: int) -> None:
        self.runtime().manual_seed(seed)
