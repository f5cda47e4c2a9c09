"""Device kernels for compression and the accelerator table.

Kernels (``torch.library`` custom ops, usable under ``torch.func.vmap`` and ``torch.compile``):
:func:`packbits`, :func:`unpackbits`, :func:`sign_compress`, :func:`quantize`,
:func:`dequantize`; the fused LoCo kernels :func:`loco_quantize`, :func:`loco_error`,
:func:`dequantize_sum`, :func:`dequantize_into`; for the 1-bit allreduce without full-size
temporaries, the two phases of error-compensated compression (:func:`feedback_sign_compress` /
:func:`feedback_apply_error`, :func:`sign_sum_compress` / :func:`sign_sum_apply_error`),
:func:`unpack_scaled` and :func:`adam_direction`; :func:`sqrt_rn`; eager only (no custom op),
:func:`adam_apply` and :func:`adamw_step`. :func:`sum_ranks` is the sum over ranks in the order
every kernel follows. A kernel called on a tensor of device type ``D`` runs a kernel set of the
accelerator table's record for ``D``: by default fused C kernels on the CPU, Triton on CUDA/XPU
(CUDA also offers the kernel set ``"cupy"``), ``torch_npu`` on NPU; every record also offers
``"reference"``, the pure-torch oracle every implementation matches bit for bit.

The table (:func:`get_accelerator`, :func:`set_accelerator`, :func:`register_accelerator`)
holds one :class:`Accelerator` per device type: its availability, its ``torch.distributed``
backend and its kernel sets (:func:`register_kernels`, :func:`select_kernels`,
:func:`kernel_set`).

``packbits`` and the CPU kernels of the 1-bit allreduce choose, per process, how far ahead
they prefetch their inputs by timing their first large calls (the results do not depend on it);
:func:`tuning_pending` tells whether that is still going on.

Environment: ``FN_ACCELERATOR`` names the accelerator in use (over detection);
``FN_KERNELS`` selects kernel sets, ``NAME`` for every device type offering it or
``DEVICE_TYPE:NAME`` entries, comma-separated (``FN_KERNELS=reference`` forces the reference
kernels); ``FN_CACHE_DIR`` is where the CPU kernels are compiled (``~/.cache/fn``).
"""

from fn.kernels._accelerator import KERNEL_NAMES, Accelerator
from fn.kernels._cpu import tuning_pending
from fn.kernels._ops import (
    adam_apply,
    adam_direction,
    adamw_step,
    dequantize,
    dequantize_into,
    dequantize_sum,
    feedback_apply_error,
    feedback_sign_compress,
    loco_error,
    loco_quantize,
    packbits,
    quantize,
    sign_compress,
    sign_sum_apply_error,
    sign_sum_compress,
    sqrt_rn,
    unpack_scaled,
    unpackbits,
)
from fn.kernels._reference import check_quant_args, sum_ranks
from fn.kernels._table import (
    get_accelerator,
    kernel_set,
    register_accelerator,
    register_kernels,
    select_kernels,
    set_accelerator,
)

__all__ = [
    "packbits",
    "unpackbits",
    "sign_compress",
    "feedback_sign_compress",
    "feedback_apply_error",
    "sign_sum_compress",
    "sign_sum_apply_error",
    "unpack_scaled",
    "adam_direction",
    "adam_apply",
    "adamw_step",
    "sqrt_rn",
    "quantize",
    "dequantize",
    "loco_quantize",
    "loco_error",
    "dequantize_sum",
    "dequantize_into",
    "sum_ranks",
    "check_quant_args",
    "tuning_pending",
    "KERNEL_NAMES",
    "Accelerator",
    "get_accelerator",
    "set_accelerator",
    "register_accelerator",
    "register_kernels",
    "select_kernels",
    "kernel_set",
]
