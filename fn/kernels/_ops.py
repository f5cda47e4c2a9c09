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

from fn.errors import NonFiniteError
from fn.kernels import _table


def _impl(name: str, device: torch.device) -> Callable[..., Any]:
    return _table.kernel(device.type, name)


def _check_finite(scale: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(scale).all()):
        raise NonFiniteError(
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


@torch.library.custom_op("fn::feedback_sign_compress", mutates_args=())
def _feedback_sign_compress(
    x: torch.Tensor, error: torch.Tensor, grad: torch.Tensor | None, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("feedback_sign_compress", x.device)(x, error, grad, beta)


@_feedback_sign_compress.register_fake
def _(x, error, grad, beta):
    return _signs_and_scale(error)


@torch.library.custom_op("fn::feedback_apply_error", mutates_args=("out",))
def _feedback_apply_error(
    x: torch.Tensor,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    grad: torch.Tensor | None,
    beta: float,
) -> None:
    _impl("feedback_apply_error", x.device)(x, error, scale, out, grad, beta)


@torch.library.custom_op("fn::sign_sum_compress", mutates_args=())
def _sign_sum_compress(
    signs: torch.Tensor, weights: torch.Tensor, error: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl("sign_sum_compress", error.device)(signs, weights, error)


@_sign_sum_compress.register_fake
def _(signs, weights, error):
    return _signs_and_scale(error)


@torch.library.custom_op("fn::sign_sum_apply_error", mutates_args=("out",))
def _sign_sum_apply_error(
    signs: torch.Tensor,
    weights: torch.Tensor,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
) -> None:
    _impl("sign_sum_apply_error", error.device)(signs, weights, error, scale, out)


@torch.library.custom_op("fn::unpack_scaled", mutates_args=("out",))
def _unpack_scaled(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    _impl("unpack_scaled", out.device)(packed, scales, out)


@torch.library.custom_op("fn::adam_direction", mutates_args=("out",))
def _adam_direction(
    m: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor | None,
    eta: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    bound: float | None,
    weight_decay: float,
) -> None:
    _impl("adam_direction", out.device)(m, v, p, eta, out, eps, bound, weight_decay)


@torch.library.custom_op("fn::sqrt_rn", mutates_args=())
def _sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    return _impl("sqrt_rn", v.device)(v)


@_sqrt_rn.register_fake
def _(v):
    return torch.empty_like(v)


@_sqrt_rn.register_vmap
def _(info, in_dims, v):
    return _sqrt_rn(v), in_dims[0]  # elementwise: the batch is one call


def _signs_and_scale(error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        error.new_empty((error.numel() + 7) // 8, dtype=torch.uint8),
        error.new_empty((), dtype=torch.float32),
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


@torch.library.custom_op("fn::loco_quantize", mutates_args=())
def _loco_quantize(
    x: torch.Tensor,
    error: torch.Tensor | None,
    bits: int,
    group_size: int,
    numel: int,
    rows: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    layout = None if rows is None else tuple(rows)
    return _impl("loco_quantize", x.device)(x, error, bits, group_size, numel, None, layout)


@_loco_quantize.register_fake
def _(x, error, bits, group_size, numel, rows):
    return (
        x.new_empty(numel * bits // 8, dtype=torch.uint8),
        x.new_empty(numel // group_size, dtype=torch.float32),
    )


@torch.library.custom_op("fn::loco_quantize_into", mutates_args=("q", "scales"))
def _loco_quantize_into(
    x: torch.Tensor,
    error: torch.Tensor | None,
    bits: int,
    group_size: int,
    numel: int,
    rows: list[int] | None,
    q: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    layout = None if rows is None else tuple(rows)
    _impl("loco_quantize", x.device)(x, error, bits, group_size, numel, (q, scales), layout)


@_loco_quantize_into.register_fake
def _(x, error, bits, group_size, numel, rows, q, scales):
    return None


@torch.library.custom_op("fn::loco_error", mutates_args=("out",))
def _loco_error(
    x: torch.Tensor,
    error: torch.Tensor | None,
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    err_beta: float,
    out: torch.Tensor,
    rows: list[int] | None,
) -> None:
    layout = None if rows is None else tuple(rows)
    _impl("loco_error", out.device)(x, error, q, scales, bits, err_beta, out, layout)


@_loco_error.register_fake
def _(x, error, q, scales, bits, err_beta, out, rows):
    return None


@torch.library.custom_op("fn::dequantize_sum", mutates_args=("out",))
def _dequantize_sum(
    q: torch.Tensor, scales: torch.Tensor, bits: int, pieces: int, out: torch.Tensor
) -> None:
    _impl("dequantize_sum", out.device)(q, scales, bits, pieces, out)


@_dequantize_sum.register_fake
def _(q, scales, bits, pieces, out):
    return None


@torch.library.custom_op("fn::dequantize_into", mutates_args=("out",))
def _dequantize_into(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    out: torch.Tensor,
    chunks: int,
    local_world_size: int,
) -> None:
    _impl("dequantize_into", out.device)(q, scales, bits, out, chunks, local_world_size)


@_dequantize_into.register_fake
def _(q, scales, bits, out, chunks, local_world_size):
    return None


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


def _per_row_into(op: Callable[..., Any], out_index: int | None = None) -> Callable[..., Any]:
    """The vmap rule of an op that writes into its argument ``out_index`` (by default the one
    named ``out``): one call per row, each writing its row of that argument (which must be
    batched when any input is)."""
    if out_index is None:
        out_index = [a.name for a in op._opoverload._schema.arguments].index("out")

    def rule(info: Any, in_dims: Sequence[int | None], *args: Any) -> tuple[None, None]:
        if in_dims[out_index] is None:
            raise ValueError(f"{op._name}: under vmap, out must be batched like the inputs")
        for b in range(info.batch_size):
            op(*(a if d is None else a.select(d, b) for a, d in zip(args, in_dims, strict=True)))
        return None, None

    return rule


def _row_shape(a: torch.Tensor, d: int) -> tuple[int, ...]:
    return tuple(s for i, s in enumerate(a.shape) if i != d)


for _op in (
    _packbits,
    _unpackbits,
    _sign_compress,
    _sign_compress_ef,
    _feedback_sign_compress,
    _sign_sum_compress,
    _quantize,
    _dequantize,
    _loco_quantize,
):
    _op.register_vmap(_per_row(_op))
for _op in (_feedback_apply_error, _sign_sum_apply_error, _unpack_scaled, _adam_direction):
    _op.register_vmap(_per_row_into(_op))
for _op, _out_index in (
    (_loco_quantize_into, 6),
    (_loco_error, 6),
    (_dequantize_sum, 4),
    (_dequantize_into, 3),
):
    _op.register_vmap(_per_row_into(_op, _out_index))


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


def _check_buffer(out: torch.Tensor, numel: int, name: str = "out") -> None:
    _check_1d(out, name)
    if out.dtype != torch.float32 or out.numel() != numel:
        raise ValueError(
            f"{name} must be a 1-D fp32 tensor of {numel} elements, got {out.dtype} "
            f"{tuple(out.shape)}"
        )


def _check_feedback_input(x: torch.Tensor, error: torch.Tensor, grad: torch.Tensor | None) -> None:
    _check_1d(x, "x")
    _check_1d(error, "error")
    if x.numel() > error.numel():
        raise ValueError(f"x has {x.numel()} elements, more than error's {error.numel()}")
    if grad is not None and grad.shape != x.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} != x shape {tuple(x.shape)}")


def feedback_sign_compress(
    x: torch.Tensor, error: torch.Tensor, *, grad: torch.Tensor | None = None, beta: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of error-compensated sign compression, without a padded or summed copy.

    .. math::
        v = \\mathrm{pad}_N(x) + e \\quad\\text{or}\\quad
        v = \\mathrm{pad}_N(\\beta x + (1 - \\beta) g) + e, \\qquad
        a = \\lVert v \\rVert_2 / \\sqrt{N}

    The signs and the scale are those of :func:`sign_compress` of the zero-padded input, bit
    for bit; with ``grad`` the momentum is rounded as ``(beta * x) + ((1 - beta) * grad)``.
    Nothing is checked or written: the caller checks the scale (on every rank), then calls
    :func:`feedback_apply_error` to write the new error.

    Args:
        x: 1-D fp32 tensor of ``n <= N`` elements (the momentum ``m`` when ``grad`` is given).
        error: 1-D fp32 tensor of ``N`` elements, the error to compensate with.
        grad: optional gradient, ``x``'s shape: compress ``beta * x + (1 - beta) * grad``.
        beta: the momentum coefficient (with ``grad``).

    Returns:
        ``(packed, scale)``: the packed signs of ``v`` (``ceil(N / 8)`` bytes) and ``a`` (0-dim
        fp32; NaN or Inf when ``v`` is not finite).

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> x, error = torch.tensor([6.0, -8.0]), torch.zeros(4)
        >>> packed, scale = K.feedback_sign_compress(x, error)
        >>> packed.tolist(), scale.item()  # the padding is zeros: their signs are +1
        ([176], 5.0)
        >>> K.feedback_apply_error(x, error, scale, error).tolist()  # in place
        [1.0, -3.0, -5.0, -5.0]
    """
    _check_feedback_input(x, error, grad)
    return torch.ops.fn.feedback_sign_compress(x, error, grad, float(beta))


def feedback_apply_error(
    x: torch.Tensor,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    *,
    grad: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """Phase 2 of :func:`feedback_sign_compress`: writes ``e' = v - a s(v)`` into ``out``.

    ``v`` is recomputed from the same ``x``, ``error`` (and ``grad``, ``beta``); ``out`` may be
    ``error`` itself (each element is read before it is written).

    Args:
        x, error, grad, beta: as given to :func:`feedback_sign_compress`.
        scale: the scale it returned.
        out: 1-D fp32 tensor of ``error``'s length.

    Returns:
        ``out``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> m, g = torch.tensor([2.0, -6.0]), torch.tensor([4.0, -2.0])
        >>> error = torch.zeros(4)
        >>> packed, scale = K.feedback_sign_compress(m, error, grad=g, beta=0.5)
        >>> scale.item()  # v = 0.5 * m + 0.5 * g, padded: [3, -4, 0, 0]
        2.5
        >>> K.feedback_apply_error(m, error, scale, torch.empty(4), grad=g, beta=0.5).tolist()
        [0.5, -1.5, -2.5, -2.5]
    """
    _check_feedback_input(x, error, grad)
    _check_buffer(out, error.numel())
    torch.ops.fn.feedback_apply_error(x, error, scale, out, grad, float(beta))
    return out


def _check_sign_rows(signs: torch.Tensor, weights: torch.Tensor) -> None:
    if signs.dim() != 2 or signs.dtype != torch.uint8:
        raise ValueError(
            f"signs must be a 2-D uint8 tensor [W, chunk / 8], got {signs.dtype} "
            f"{tuple(signs.shape)}"
        )
    if weights.shape != (signs.shape[0],):
        raise ValueError(f"weights must have shape ({signs.shape[0]},), got {tuple(weights.shape)}")


def sign_sum_compress(
    signs: torch.Tensor, weights: torch.Tensor, error: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of the 1-bit allreduce's server compression, without unpacked signs.

    .. math::
        v_k = \\textstyle\\sum_i w_i\\, s_i[k] + e_k, \\quad a = \\lVert v \\rVert_2 / \\sqrt{n}

    The sum runs in the order of ``torch.sum(dim=0)`` over the ``[W, chunk]`` rows of
    ``+-w_i`` (the reference), so the bits are those of the reference path.

    Args:
        signs: uint8 ``[W, chunk / 8]``, row ``i`` the packed signs ``s_i``.
        weights: fp32 ``[W]``.
        error: 1-D fp32 tensor of ``chunk`` elements.

    Returns:
        ``(packed signs of v, a)`` as :func:`feedback_sign_compress`.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> signs = torch.tensor([[0b11000000], [0b10100000]], dtype=torch.uint8)
        >>> error = torch.zeros(8)
        >>> packed, scale = K.sign_sum_compress(signs, torch.tensor([1.0, 3.0]), error)
        >>> packed.tolist(), round(scale.item() ** 2, 4)  # v = [4, -2, 2, -4, -4, -4, -4, -4]
        ([160], 13.0)
    """
    _check_sign_rows(signs, weights)
    _check_buffer(error, signs.shape[1] * 8, "error")
    return torch.ops.fn.sign_sum_compress(signs, weights, error)


def sign_sum_apply_error(
    signs: torch.Tensor,
    weights: torch.Tensor,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Phase 2 of :func:`sign_sum_compress`: writes ``e' = v - a s(v)`` into ``out`` (which
    may be ``error``) and returns it.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> signs, weights = torch.tensor([[0b11000000]], dtype=torch.uint8), torch.ones(1)
        >>> error = torch.zeros(8)
        >>> _, scale = K.sign_sum_compress(signs, weights, error)
        >>> K.sign_sum_apply_error(signs, weights, error, scale, error).tolist()
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    """
    _check_sign_rows(signs, weights)
    _check_buffer(error, signs.shape[1] * 8, "error")
    _check_buffer(out, signs.shape[1] * 8)
    torch.ops.fn.sign_sum_apply_error(signs, weights, error, scale, out)
    return out


def unpack_scaled(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes ``scales[r] * s(packed[r])`` of the rows ``r``, concatenated, into ``out`` (its
    first ``out.numel()`` values), without unpacked signs.

    Args:
        packed: uint8 ``[W, chunk / 8]``.
        scales: fp32 ``[W]``.
        out: 1-D fp32 tensor of at most ``W * chunk`` elements.

    Returns:
        ``out``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> packed = torch.tensor([[0b10000000], [0b01000000]], dtype=torch.uint8)
        >>> K.unpack_scaled(packed, torch.tensor([1.0, 2.0]), torch.empty(10)).tolist()
        [1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -2.0, 2.0]
    """
    _check_sign_rows(packed, scales)
    _check_1d(out, "out")
    if out.dtype != torch.float32 or out.numel() > packed.numel() * 8:
        raise ValueError(f"out must be fp32 with at most {packed.numel() * 8} elements")
    torch.ops.fn.unpack_scaled(packed, scales, out)
    return out


def adam_direction(
    m: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    out: torch.Tensor,
    *,
    eps: float,
    bound: float | None = None,
    weight_decay: float = 0.0,
    p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The update of a compressed Adam step of the 1-bit family, written into ``out``.

    .. math::
        u = -\\eta\\,\\big(\\mathrm{clamp}(m / (\\sqrt{v} + \\epsilon), -B, B) + \\lambda p\\big)

    rounded as ``fn.onebit_adam`` computes it (no clamp when ``bound`` is ``None``; the decay
    term only with ``p``; ``sqrt`` correctly rounded, as IEEE 754's square root: torch's fp32
    ``sqrt`` on the CPU is 1 ulp off for about one input in five).

    Args:
        m, v: fp32 momentum and variance (same shape as ``out``).
        eta: the learning rate, a 0-dim fp32 tensor.
        out: fp32 tensor to write (it may be ``m``).
        eps, bound, weight_decay, p: as above.

    Returns:
        ``out``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> m, v = torch.tensor([1.0, -8.0]), torch.tensor([4.0, 1.0])
        >>> K.adam_direction(m, v, torch.tensor(0.5), torch.empty(2), eps=0.0, bound=4.0).tolist()
        [-0.25, 2.0]
    """
    for name, t in (("m", m), ("v", v), ("out", out)) + ((("p", p),) if p is not None else ()):
        if t.shape != out.shape or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 of out's shape {tuple(out.shape)}")
    torch.ops.fn.adam_direction(
        m,
        v,
        p if weight_decay else None,
        eta,
        out,
        float(eps),
        None if bound is None else float(bound),
        float(weight_decay),
    )
    return out


def adam_apply(
    m: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    params: torch.Tensor,
    *,
    eps: float,
    bound: float | None = None,
    weight_decay: float = 0.0,
    root: torch.Tensor | None = None,
    signs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The update of :func:`adam_direction` added to the params in place, with the values of
    ``params.add_(adam_direction(m, v, eta, out, ..., p=params))``; with ``signs``, the
    momentum ``m`` is first written from the packed signs it arrives as.

    .. math::
        p \\leftarrow p - \\eta\\,\\big(\\mathrm{clamp}(m / (\\sqrt{v} + \\epsilon), -B, B)
            + \\lambda p\\big)

    rounded as ``fn.onebit_adam``'s update followed by ``fn.apply_updates`` (``sqrt``
    correctly rounded). On the CPU, for contiguous fp32 tensors, a C kernel reads ``m``, ``v``
    and the params once and writes the params. With ``signs``, it writes ``m`` as
    :func:`unpack_scaled` does instead of reading it (the new momentum of a 1-bit allreduce, in
    the pass that uses it). Eager tensors only (not a custom op).

    Args:
        m, v: fp32 momentum and variance (the params' shape).
        eta: the learning rate, a 0-dim fp32 tensor.
        params: fp32 params, updated in place.
        eps, bound, weight_decay: as :func:`adam_direction` (the decay term uses ``params``).
        root: fp32 scratch of the params' shape that an implementation may overwrite (the
            reference writes the update there; the C kernel needs none), or ``None``.
        signs: ``(packed, scales)`` as for :func:`unpack_scaled` (uint8 ``[W, chunk / 8]``,
            fp32 ``[W]``, ``chunk`` a multiple of 8 with ``W * chunk`` at least the params'
            size), whose values ``m`` receives first; ``None``: ``m`` is read.

    Returns:
        ``params``.

    Raises:
        ValueError: a tensor that is not fp32 of the params' shape, or ``signs`` that do not
            hold the params' size.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> m, v, p = torch.tensor([1.0, -8.0]), torch.tensor([4.0, 1.0]), torch.ones(2)
        >>> K.adam_apply(m, v, torch.tensor(0.5), p, eps=0.0, bound=4.0).tolist()
        [0.75, 3.0]
    """
    for name, t in (("m", m), ("v", v), ("params", params), ("root", root)):
        if t is not None and (t.shape != params.shape or t.dtype != torch.float32):
            raise ValueError(f"adam_apply: {name} must be fp32 of the params' shape")
    constants = (float(eps), None if bound is None else float(bound), float(weight_decay))
    if signs is None:
        _impl("adam_apply", params.device)(m, v, eta, params, root, *constants)
        return params
    _check_sign_rows(*signs)
    if signs[0].numel() * 8 < params.numel():
        raise ValueError(f"adam_apply: signs must hold the params' {params.numel()} values")
    _impl("adam_apply", params.device)(m, v, eta, params, root, *constants, signs)
    return params


def adamw_step(
    ps: Sequence[torch.Tensor],
    gs: Sequence[torch.Tensor],
    ms: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    *,
    step: float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    m_outs: Sequence[torch.Tensor] | None = None,
    v_outs: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One AdamW step applied to the params in place, with the values of ``fn.adamw``'s
    update followed by ``fn.apply_updates``.

    For each param ``p`` with gradient ``g`` and moments ``m``, ``v``:

    .. math::
        m_t = \\beta_1 m + (1 - \\beta_1) g, \\quad v_t = \\beta_2 v + (1 - \\beta_2) g^2,
        \\quad p' = (1 - \\eta\\lambda) p - \\frac{\\eta}{1 - \\beta_1^t}\\,
        \\frac{m_t}{\\sqrt{v_t} / \\sqrt{1 - \\beta_2^t} + \\epsilon},
        \\quad p \\leftarrow p + (p' - p)

    where ``p'``, ``m_t`` and ``v_t`` are rounded as ``torch._fused_adamw_`` (the kernel of
    ``torch.optim.AdamW(fused=True)``) computes them, and ``p + (p' - p)`` as
    ``apply_updates`` adds the update ``p' - p``. On the CPU, for contiguous fp32 or fp64
    tensors, a C kernel does it in one pass over ``p``, ``g``, ``m`` and ``v``; elsewhere the
    reference runs torch's kernel on a copy of the params. Eager tensors only (not a custom op).

    Reference: Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.

    Args:
        ps: the params (updated in place), tensors of one device.
        gs: their gradients (only read).
        ms, vs: the first and second moments (only read, unless they are the outputs).
        step: ``t``, the number of this update (1 for the first).
        lr: the learning rate ``eta``.
        betas: ``(beta1, beta2)``.
        eps: the denominator term ``epsilon``.
        weight_decay: the decoupled decay ``lambda``.
        m_outs, v_outs: where the new moments go (``None``: into ``ms``, ``vs``).

    Returns:
        ``(m_outs, v_outs)`` as lists.

    Raises:
        ValueError: when the lists differ in length, or a tensor differs from its param in
            shape, dtype or device.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> p, g = torch.tensor([1.0, -2.0]), torch.tensor([0.5, -0.25])
        >>> _ = K.adamw_step(
        ...     [p], [g], [torch.zeros(2)], [torch.zeros(2)],
        ...     step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.5,
        ... )
        >>> p  # (1 - 0.1 * 0.5) * p - 0.1 * sign(g)
        tensor([ 0.8500, -1.8000])
    """
    m_outs = list(ms if m_outs is None else m_outs)
    v_outs = list(vs if v_outs is None else v_outs)
    lists = {"gs": gs, "ms": ms, "vs": vs, "m_outs": m_outs, "v_outs": v_outs}
    for name, ts in lists.items():
        if len(ts) != len(ps):
            raise ValueError(f"adamw_step: {name} has {len(ts)} tensors for {len(ps)} params")
        for t, p in zip(ts, ps, strict=True):
            if t.shape != p.shape or t.dtype != p.dtype or t.device != ps[0].device:
                raise ValueError(
                    f"adamw_step: a tensor of {name} differs from its param in shape, dtype "
                    "or device (all on one device)"
                )
    if ps:
        beta1, beta2 = betas
        _impl("adamw_step", ps[0].device)(
            list(ps), list(gs), list(ms), list(vs), m_outs, v_outs, float(step), float(lr),
            float(beta1), float(beta2), float(eps), float(weight_decay),
        )  # fmt: skip
    return m_outs, v_outs


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    r"""The square root of fp32 ``v`` correctly rounded, as IEEE 754 defines it: the same bits on
    every device and kernel set (where the root is NaN, for negative or NaN ``v``, only NaN is
    promised, not its sign or payload).

    .. math::
        \mathrm{sqrt\_rn}(v) = \mathrm{round}_{\mathrm{fp32}}(\sqrt{v})

    torch's fp32 ``sqrt`` on the CPU is 1 ulp off for about one input in five; the 1-bit Adam
    family divides by this root (docs/algorithms.md#1-bit-adam). Other dtypes take torch's
    ``sqrt``.

    Args:
        v: a tensor (negative values give NaN).

    Returns:
        A new tensor of ``v``'s shape and dtype.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> K.sqrt_rn(torch.tensor([4.0, 2.0, 0.0])).tolist()
        [2.0, 1.4142135381698608, 0.0]
    """
    if v.dtype != torch.float32 or v.device.type == "mps":
        return v.sqrt()
    return torch.ops.fn.sqrt_rn(v)


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


def _check_out(out: torch.Tensor, numel: int, what: str) -> None:
    _check_1d(out, "out")
    if out.dtype != torch.float32 or out.shape[0] != numel:
        raise ValueError(
            f"out must be fp32 with {what}={numel} values, got {out.dtype}[{out.shape[0]}]"
        )


def _check_rows(
    rows: tuple[int, int, int] | None, n: int, numel: int, group_size: int
) -> list[int] | None:
    if rows is None:
        return None
    row, padded_row, local = rows
    count = n // row if row > 0 else 0
    if (
        row < 1
        or count * row != n
        or padded_row < row
        or padded_row % group_size
        or local < 1
        or count % local
        or count * padded_row != numel
    ):
        raise ValueError(
            f"rows={rows} does not lay out x's {n} values as rows padded to whole groups of "
            f"{group_size} filling numel={numel} (local dividing the row count)"
        )
    return [row, padded_row, local]


def loco_quantize(
    x: torch.Tensor,
    error: torch.Tensor | None,
    bits: int,
    group_size: int,
    numel: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of LoCo's compensated quantization: :func:`quantize` of ``v = pad(x) + e``.

    ``x`` is read as if zero-padded to ``numel`` values (no padded copy is made) and the error
    ``e`` is added in fp32; with ``error=None`` it is plain quantization of the padded ``x``
    (ZeRO++ qgZ). Bit-identical to ``quantize(pad(x, numel) + error, bits, group_size)``. No
    finiteness check: a group with NaN/Inf gets a NaN scale (the caller checks the scales).

    Args:
        x: 1-D tensor of at most ``numel`` elements (computed in fp32).
        error: fp32 error of ``numel`` values, or ``None``.
        bits: 4 or 8.
        group_size: elements per scale; even, >= 2, dividing ``numel``.
        numel: the padded length ``N``.
        out: ``(q, scales)`` buffers to write (contiguous, the shapes below), or ``None``.
        rows: ``(row, padded_row, L)`` for ``x`` made of ``R`` rows of ``row`` values (FSDP's
            reduce-scatter input): ``v``'s row ``j`` is ``x``'s row ``(j % (R / L)) * L + j //
            (R / L)`` zero-padded to ``padded_row`` (a multiple of ``group_size``; ``numel =
            R * padded_row``); ``L = 1`` keeps the order. ``None``: one row, padded to ``numel``.

    Returns:
        ``(q, scales)``: uint8 ``q`` of ``N * bits / 8`` bytes, fp32 ``scales`` of ``N /
        group_size`` (``out``'s tensors when given).

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> x, e = torch.tensor([1.0, -2.0, 4.0]), torch.full((4,), 0.5)
        >>> q, scales = K.loco_quantize(x, e, bits=8, group_size=4, numel=4)
        >>> q.tolist(), scales.tolist()  # v = [1.5, -1.5, 4.5, 0.5]
        ([43, 213, 127, 14], [0.03515625])
    """
    _check_1d(x, "x")
    _check_quant_args(bits, group_size)
    if numel < x.shape[0] or numel % group_size:
        raise ValueError(f"numel={numel} must be a multiple of group_size >= x's {x.shape[0]}")
    if error is not None:
        _check_1d(error, "error")
        if error.shape[0] != numel:
            raise ValueError(f"error must have numel={numel} values, got {error.shape[0]}")
    rows_list = _check_rows(rows, x.shape[0], numel, group_size)
    if out is None:
        return torch.ops.fn.loco_quantize(x, error, bits, group_size, numel, rows_list)
    q, scales = out
    if q.dtype != torch.uint8 or q.shape != (numel * bits // 8,) or not q.is_contiguous():
        raise ValueError(f"out's q must be contiguous uint8[{numel * bits // 8}]")
    if scales.dtype != torch.float32 or scales.shape != (numel // group_size,):
        raise ValueError(f"out's scales must be fp32[{numel // group_size}]")
    torch.ops.fn.loco_quantize_into(x, error, bits, group_size, numel, rows_list, q, scales)
    return q, scales


def _check_codes(q: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[int, int]:
    _check_1d(q, "q")
    _check_1d(scales, "scales")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    values, groups = q.shape[0] * 8 // bits, scales.shape[0]
    if not groups or values % groups or (values // groups) % 2:
        raise ValueError(f"{q.shape[0]} bytes / {groups} scales are not whole {bits}-bit groups")
    return values, values // groups


def loco_error(
    x: torch.Tensor,
    error: torch.Tensor | None,
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    err_beta: float,
    out: torch.Tensor,
    rows: tuple[int, int, int] | None = None,
) -> None:
    """Phase 2 of LoCo: the new error, written into ``out`` (which may be ``error`` itself).

    .. math::
        v = \\mathrm{pad}(x) + e, \\quad e' = (v - DQ(q)) (1 - \\beta) + \\beta e

    rounded in fp32 after every operation (``e = 0`` for ``error=None``), as the pure path
    ``residual * (1 - beta) + beta * e`` does.

    Args:
        x, error: as given to :func:`loco_quantize` (``error``: fp32 of ``N`` values or ``None``).
        q, scales: the result of :func:`loco_quantize`.
        bits: 4 or 8, as quantized.
        err_beta: LoCo's ``beta``.
        out: fp32 buffer of ``N`` values, written.
        rows: as given to :func:`loco_quantize`.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> x, e = torch.tensor([1.0, -2.0, 4.0, 0.5]), torch.zeros(4)
        >>> q, scales = K.loco_quantize(x, e, 4, 4, 4)
        >>> K.loco_error(x, e, q, scales, 4, 0.5, e)  # in place
        >>> e.tolist()
        [0.0, 0.0, 0.25, 0.0]
    """
    _check_1d(x, "x")
    values, _ = _check_codes(q, scales, bits)
    _check_out(out, values, "N")
    if x.shape[0] > values:
        raise ValueError(f"x has {x.shape[0]} values, more than the {values} quantized")
    if error is not None and error.shape != out.shape:
        raise ValueError(f"error shape {tuple(error.shape)} != out shape {tuple(out.shape)}")
    rows_list = _check_rows(rows, x.shape[0], values, values // scales.shape[0])
    torch.ops.fn.loco_error(x, error, q, scales, bits, float(err_beta), out, rows_list)


def dequantize_sum(
    q: torch.Tensor, scales: torch.Tensor, bits: int, pieces: int, out: torch.Tensor
) -> None:
    """Sums the ``pieces`` dequantized rows held by ``q``/``scales`` into ``out``.

    ``out = DQ(q).view(pieces, -1).sum(0)`` bit for bit (torch's summation order), without the
    dequantized rows in memory.

    Args:
        q, scales: codes and scales of ``pieces * k`` values (rows of ``k``, whole groups).
        bits: 4 or 8.
        pieces: number of rows.
        out: fp32 buffer of ``k`` values, written.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> q, scales = K.quantize(torch.tensor([1.0, -2.0, 4.0, 0.5]), bits=8, group_size=2)
        >>> out = torch.empty(2)
        >>> K.dequantize_sum(q, scales, 8, 2, out)
        >>> out.tolist()  # [1.0, -2.0] + [3.96875, 0.5]
        [4.96875, -1.5]
    """
    values, group_size = _check_codes(q, scales, bits)
    if pieces < 1 or values % pieces or (values // pieces) % group_size:
        raise ValueError(f"{values} values do not split in {pieces} rows of whole groups")
    _check_out(out, values // pieces, "values / pieces")
    torch.ops.fn.dequantize_sum(q, scales, bits, pieces, out)


def dequantize_into(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    out: torch.Tensor,
    chunks: int = 1,
    local_world_size: int = 1,
) -> None:
    """Dequantizes the first ``out.numel()`` values into ``out``, chunks reordered.

    ``q``/``scales`` hold ``chunks`` equal chunks in rank order ``node * L + local`` (``L =
    local_world_size``); ``out`` receives them in the order ``local * (chunks / L) + node``
    (with ``L = 1``: unchanged), as the two-hop quantized all-gather needs, without a
    transposed copy.

    Args:
        q, scales: codes and scales (whole groups per chunk).
        bits: 4 or 8.
        out: fp32 buffer of at most ``len(q) * 8 / bits`` values, written.
        chunks: number of chunks ``W``.
        local_world_size: ``L``, dividing ``chunks``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> q, scales = K.quantize(torch.tensor([1.0, -2.0, 4.0, 0.5]), bits=8, group_size=2)
        >>> out = torch.empty(3)
        >>> K.dequantize_into(q, scales, 8, out)
        >>> out.tolist()
        [1.0, -2.0, 3.96875]
    """
    values, group_size = _check_codes(q, scales, bits)
    _check_1d(out, "out")
    if chunks < 1 or local_world_size < 1 or chunks % local_world_size:
        raise ValueError(f"local_world_size={local_world_size} must divide chunks={chunks}")
    if values % chunks or (values // chunks) % group_size:
        raise ValueError(f"{values} values do not split in {chunks} chunks of whole groups")
    if out.dtype != torch.float32 or out.shape[0] > values:
        raise ValueError(f"out must be fp32 with at most {values} values")
    torch.ops.fn.dequantize_into(q, scales, bits, out, chunks, local_world_size)
