"""The public kernels: ``torch.library`` custom ops in namespace ``fn``.

Each op runs the implementation the accelerator table dispatches to for its input's device type
(``fn.kernels._table.kernel``: a kernel of the device's selected kernel set, or the reference).
``register_fake`` gives shapes to ``torch.compile`` (the op stays one opaque node, so a graph has
no breaks and no data-dependent guards, and a change of kernel set needs no recompilation);
``register_vmap`` runs the op once per row, so under ``torch.func.vmap`` every row is an
independent call (its own scale, its own error) and the non-finite check sees concrete data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fn.kernels import _table


def _impl(name: str, device: torch.device) -> Callable[..., Any]:
    return _table.kernel(device.type, name)


def _check_finite(scale: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(
            f"{what}: the scale is non-finite (NaN or Inf in the input); refusing to "
            "produce compressed garbage"
        )


@torch.library.custom_op("fn::packbits", mutates_args=())
def _packbits(x: torch.Tensor) -> torch.Tensor:
    return _impl("packbits", x.device)(x)


@_packbits.register_fake
def _(x):
    return x.new_empty((x.numel() + 7) // 8, dtype=torch.uint8)


@torch.library.custom_op("fn::unpackbits", mutates_args=())
def _unpackbits(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    return _impl("unpackbits", packed.device)(packed, n, dtype)


@_unpackbits.register_fake
def _(packed, n, dtype):
    return packed.new_empty(n, dtype=dtype)


@torch.library.custom_op("fn::sign_compress", mutates_args=())
def _sign_compress(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed, scale, _ = _impl("sign_compress", m.device)(m)
    _check_finite(scale, "sign_compress")
    return packed, scale


@_sign_compress.register_fake
def _(m):
    return m.new_empty((m.numel() + 7) // 8, dtype=torch.uint8), m.new_empty(
        (), dtype=torch.float32
    )


@torch.library.custom_op("fn::sign_compress_ef", mutates_args=())
def _sign_compress_ef(
    m: torch.Tensor, error: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packed, scale, new_error = _impl("sign_compress", m.device)(m, error)
    _check_finite(scale, "sign_compress")
    return packed, scale, new_error


@_sign_compress_ef.register_fake
def _(m, error):
    n = m.numel()
    return (
        m.new_empty((n + 7) // 8, dtype=torch.uint8),
        m.new_empty((), dtype=torch.float32),
        m.new_empty(n, dtype=torch.float32),
    )


@torch.library.custom_op("fn::quantize", mutates_args=())
def _quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, scales = _impl("quantize", x.device)(x, bits, group_size)
    _check_finite(scales, "quantize")
    return q, scales


@_quantize.register_fake
def _(x, bits, group_size):
    groups = (x.numel() + group_size - 1) // group_size
    return (
        x.new_empty(groups * group_size * bits // 8, dtype=torch.uint8),
        x.new_empty(groups, dtype=torch.float32),
    )


@torch.library.custom_op("fn::dequantize", mutates_args=())
def _dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    return _impl("dequantize", q.device)(q, scales, bits, n)


@_dequantize.register_fake
def _(q, scales, bits, n):
    return q.new_empty(n, dtype=torch.float32)


def _per_row(op: Callable[..., Any]) -> Callable[..., Any]:
    """A vmap rule that calls ``op`` once per row and stacks the results along dim 0."""

    def rule(info: Any, in_dims: Sequence[int | None], *args: Any) -> tuple[Any, Any]:
        def row(b: int | None) -> list[Any]:
            if b is None:  # a zero-filled row, for the output shapes of an empty batch
                return [
                    a if d is None else a.new_zeros(_row_shape(a, d))
                    for a, d in zip(args, in_dims, strict=True)
                ]
            return [a if d is None else a.select(d, b) for a, d in zip(args, in_dims, strict=True)]

        count = info.batch_size
        rows = [op(*row(b)) for b in range(count)] if count else [op(*row(None))]
        rows = [r if isinstance(r, tuple) else (r,) for r in rows]
        stacked = tuple(torch.stack(column)[:count] for column in zip(*rows, strict=True))
        if len(stacked) == 1:
            return stacked[0], 0
        return stacked, (0,) * len(stacked)

    return rule


def _row_shape(a: torch.Tensor, d: int) -> tuple[int, ...]:
    return tuple(s for i, s in enumerate(a.shape) if i != d)


for _op in (_packbits, _unpackbits, _sign_compress, _sign_compress_ef, _quantize, _dequantize):
    _op.register_vmap(_per_row(_op))


def _check_1d(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 1-D tensor, got {shape}")


def _check_quant_args(bits: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even number >= 2, got {group_size}")


def packbits(x: torch.Tensor) -> torch.Tensor:
    """Packs the signs of ``x`` (bit 1 for ``x >= 0``, ``-0.0`` included), MSB first.

    Args:
        x: 1-D tensor of ``n`` elements.

    Returns:
        uint8 tensor of ``ceil(n / 8)`` bytes, equal to ``numpy.packbits(x >= 0)``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> K.packbits(torch.tensor([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, 2.0, 5.0, -4.0])).tolist()
        [187, 0]
    """
    _check_1d(x, "x")
    return torch.ops.fn.packbits(x)


def unpackbits(bits: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpacks the first ``n`` signs packed by :func:`packbits`.

    Args:
        bits: 1-D uint8 tensor of at least ``ceil(n / 8)`` bytes.
        n: number of values.
        dtype: output dtype.

    Returns:
        1-D tensor of ``n`` values, ``+1`` where the bit is set and ``-1`` elsewhere.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> K.unpackbits(torch.tensor([187], dtype=torch.uint8), 5).tolist()
        [1.0, -1.0, 1.0, 1.0, 1.0]
    """
    _check_1d(bits, "bits")
    if bits.dtype != torch.uint8:
        raise ValueError(f"bits must be uint8, got {bits.dtype}")
    if n < 0 or bits.shape[0] * 8 < n:
        raise ValueError(f"{bits.shape[0]} bytes cannot hold n={n} signs")
    return torch.ops.fn.unpackbits(bits, n, dtype)


def sign_compress(
    m: torch.Tensor, error: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Error-compensated 1-bit compression (Seide et al. 2014; 1-bit Adam, Tang et al. 2021).

    .. math::
        v = m + e, \\quad a = \\lVert v \\rVert_2 / \\sqrt{n}, \\quad
        e' = v - a\\,\\mathrm{sign}(v), \\quad \\mathrm{sign}(0) = +1

    Args:
        m: 1-D tensor of ``n`` elements (computed in fp32).
        error: the error to compensate with (same shape), or ``None`` for plain compression.

    Returns:
        ``(packed, scale, new_error)``: the packed signs of ``v`` (uint8, ``ceil(n / 8)``), ``a``
        as a 0-dim fp32 tensor (0 for ``n == 0``), and ``e'`` (fp32) or ``None`` without error.

    Raises:
        ValueError: when the scale is non-finite (NaN/Inf in ``m`` or ``error``).

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> m = torch.tensor([1.0, 7.0, -7.0, -1.0])
        >>> packed, scale, error = K.sign_compress(m, torch.zeros(4))
        >>> packed.tolist(), scale.item(), error.tolist()
        ([192], 5.0, [-4.0, 2.0, -2.0, 4.0])
    """
    _check_1d(m, "m")
    if error is None:
        packed, scale = torch.ops.fn.sign_compress(m)
        return packed, scale, None
    _check_1d(error, "error")
    if error.shape != m.shape:
        raise ValueError(f"error shape {tuple(error.shape)} != m shape {tuple(m.shape)}")
    return torch.ops.fn.sign_compress_ef(m, error)


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric blockwise ``bits``-bit quantization (ZeRO++ qgZ; Wang et al. 2023).

    .. math::
        s_g = \\max_{i \\in g} |x_i| / 2^{b-1}, \\quad
        q_i = \\mathrm{clamp}(\\mathrm{round}(x_i / s_g), -2^{b-1}, 2^{b-1} - 1)

    Args:
        x: 1-D tensor of ``n`` elements (zero-padded to whole groups).
        bits: 4 (two values per byte, first in the high nibble) or 8.
        group_size: elements per scale; even, >= 2.

    Returns:
        ``(q, scales)``: uint8 ``q`` of ``ceil(n / group_size) * group_size * bits / 8`` bytes
        and fp32 ``scales``, one per group.

    Raises:
        ValueError: for bad ``bits``/``group_size`` or a non-finite scale (NaN/Inf input).

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> q, scales = K.quantize(torch.tensor([1.0, -2.0, 4.0, 0.5]), bits=8, group_size=4)
        >>> q.tolist(), scales.tolist()  # 4.0 / scale = 128 is clamped to 127
        ([32, 192, 127, 16], [0.03125])
    """
    _check_1d(x, "x")
    _check_quant_args(bits, group_size)
    return torch.ops.fn.quantize(x, bits, group_size)


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``x_i = q_i s_g`` for the first ``n`` values, fp32.

    Args:
        q: uint8 codes from :func:`quantize`.
        scales: fp32 scales from :func:`quantize`.
        bits: 4 or 8, as quantized.
        n: number of values to return (at most ``len(q) * 8 / bits``).

    Returns:
        1-D fp32 tensor of ``n`` values.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> q, scales = K.quantize(torch.tensor([1.0, -2.0, 4.0, 0.5]), bits=8, group_size=4)
        >>> K.dequantize(q, scales, bits=8, n=4).tolist()
        [1.0, -2.0, 3.96875, 0.5]
    """
    _check_1d(q, "q")
    _check_1d(scales, "scales")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    values = q.shape[0] * 8 // bits
    groups = scales.shape[0]
    if n < 0 or n > values or (groups and values % groups) or (not groups and values):
        raise ValueError(f"{q.shape[0]} bytes / {groups} scales do not fit {bits}-bit n={n}")
    return torch.ops.fn.dequantize(q, scales, bits, n)
