"""Device kernels for compression and the accelerator table.

Kernels (``torch.library`` custom ops, usable under ``torch.func.vmap`` and ``torch.compile``):
:func:`packbits`, :func:`unpackbits`, :func:`sign_compress`, :func:`quantize`,
:func:`dequantize`. Each dispatches on its input's device type through the accelerator table
(fused C kernels on CPU, Triton on CUDA/XPU, ``torch_npu`` on NPU); ``_reference`` holds the
pure-torch oracle every implementation matches bit for bit.

Environment: ``FN_ACCELERATOR`` picks the accelerator; ``FN_KERNELS=reference`` forces the
reference kernels; ``FN_CACHE_DIR`` is where the CPU kernels are compiled (``~/.cache/fn``).
"""

from fn.kernels._accelerator import KERNEL_NAMES, Accelerator
from fn.kernels._ops import dequantize, packbits, quantize, sign_compress, unpackbits
from fn.kernels._table import (
    get_accelerator,
    register_accelerator,
    register_kernel,
    set_accelerator,
)

__all__ = [
    "packbits",
    "unpackbits",
    "sign_compress",
    "quantize",
    "dequantize",
    "KERNEL_NAMES",
    "Accelerator",
    "get_accelerator",
    "set_accelerator",
    "register_accelerator",
    "register_kernel",
]
