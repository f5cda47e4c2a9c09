"""Pure-torch reference kernels: readable, run on any device, and the bit-exact oracle for the
fast implementations.

Each kernel computes what the public op of its name in ``fn.kernels`` documents (the rule and
its math); the public op adds the input checks, the non-finite check, vmap and compile support.
The conventions (docs/algorithms.md, "Conventions") in the detail every implementation follows:
- Signs: NaN gives bit 0 (``v >= 0`` is false).
- Sign-compression scale: ``a = sqrt(S / n)`` rounded once to fp32, where ``S = sum(v_i^2)`` is
  accumulated in fp64 in one fixed order, so that every implementation gets the same bits
  (squares of fp32 values are exact in fp64; only the additions round):
  ``v`` is zero-padded to whole blocks of ``SUMSQ_BLOCK`` = 1024 elements; inside a block, lane
  ``j`` (of ``SUMSQ_LANES`` = 16) adds ``v[j]^2, v[j+16]^2, v[j+32]^2, ...`` in that order;
  the lanes are then folded as ``lane[j] += lane[j + h]`` for ``h = 8, 4, 2, 1``; the block
  sums are zero-padded to a power of two and folded the same way (first half plus second half)
  down to one value. See :func:`block_sumsq` and :func:`rms_from_block_sums`.
- Sums over ranks: :func:`sum_ranks`.
- Quantization error bound (up to fp32 rounding): an element that is not clamped satisfies
  ``|x - DQ(Q(x))| <= scale / 2``; elements above ``(2^(bits-1) - 1/2) * scale`` (just below
  ``+absmax``) are clamped and their error is up to one ``scale``. A group whose absmax is
  below ``2^(bits-1)`` times the smallest fp32 subnormal (``2^-149``) gets scale 0 (the
  division underflows) and dequantizes to zeros.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

SUMSQ_BLOCK = 1024
SUMSQ_LANES = 16

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=device)


def packbits(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    bits = (x >= 0).to(torch.uint8)
    bits = torch.nn.functional.pad(bits, (0, -n % 8)).view(-1, 8)
    return (bits * _bit_weights(x.device)).sum(dim=1, dtype=torch.uint8)


def unpackbits(packed: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    bits = (packed.view(-1, 1) & _bit_weights(packed.device)) != 0
    bits = bits.view(-1)[:n]
    one = torch.ones((), dtype=dtype, device=packed.device)
    return torch.where(bits, one, -one)


def _halve_until_one(x: torch.Tensor) -> torch.Tensor:
    """Folds the last axis (a power of two long) as ``first half + second half`` to length 1."""
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def block_sumsq(v: torch.Tensor) -> torch.Tensor:
    """Per-block fp64 sums of squares of 1-D fp32 ``v`` in the canonical order (module doc).

    Returns:
        fp64 tensor of ``ceil(n / SUMSQ_BLOCK)`` block sums (on the CPU for devices without
        fp64, such as MPS).
    """
    if v.device.type == "mps":
        v = v.cpu()
    n = v.numel()
    blocks = -(-n // SUMSQ_BLOCK)
    w = torch.nn.functional.pad(v.double(), (0, blocks * SUMSQ_BLOCK - n))
    w = w.view(blocks, SUMSQ_BLOCK // SUMSQ_LANES, SUMSQ_LANES)
    w = w * w
    lanes = w[:, 0]  # [blocks, LANES]
    for k in range(1, SUMSQ_BLOCK // SUMSQ_LANES):
        lanes = lanes + w[:, k]
    return _halve_until_one(lanes)


def rms_from_block_sums(block_sums: torch.Tensor, n: int) -> torch.Tensor:
    """``sqrt(S / n)`` as a 0-dim fp32 tensor from fp64 block sums (shared by every
    implementation, so the final rounding is the same everywhere); 0 when ``n == 0``."""
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=block_sums.device)
    count = block_sums.numel()
    padded = torch.nn.functional.pad(block_sums, (0, (1 << (count - 1).bit_length()) - count))
    return torch.sqrt(_halve_until_one(padded) / n).float()


def sign_compress(
    m: torch.Tensor, error: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Without the check that ``a`` is finite (the op's)."""
    return sign_compress_with(packbits, m, error)


def sign_compress_with(
    pack: Callable[[torch.Tensor], torch.Tensor], m: torch.Tensor, error: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`sign_compress` with the signs packed by ``pack`` (a bit-exact :func:`packbits`
    of another kernel set); the scale and the new error come from the reference formulas."""
    v = m.float() if error is None else m.float() + error.float()
    scale = rms_from_block_sums(block_sumsq(v), v.numel()).to(v.device)
    new_error = None if error is None else v - torch.where(v >= 0, scale, -scale)
    return pack(v), scale, new_error


def _feedback_input(
    x: torch.Tensor | None,
    length: int,
    grad: torch.Tensor | None,
    beta: float,
    signs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x`` (or the momentum ``beta * x + (1 - beta) * grad``, rounded as written) as fp32,
    zero-padded to ``length`` elements; with ``signs = (packed, scales)``, ``x`` is the first
    ``grad.numel()`` values of :func:`unpack_scaled` of them."""
    if signs is not None:
        x = torch.empty(grad.numel(), dtype=torch.float32, device=grad.device)
        unpack_scaled(*signs, x)
    source = x.float() if grad is None else (beta * x.float()).add_((1 - beta) * grad.float())
    return torch.nn.functional.pad(source, (0, length - source.numel()))


def feedback_sign_compress(
    x: torch.Tensor | None,
    error: torch.Tensor,
    grad: torch.Tensor | None = None,
    beta: float = 0.0,
    signs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """With ``grad``, rounded as ``fn.transforms._leafwise.moving_average``."""
    return sign_compress(_feedback_input(x, error.numel(), grad, beta, signs) + error.float())[:2]


def feedback_apply_error(
    x: torch.Tensor | None,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
    grad: torch.Tensor | None = None,
    beta: float = 0.0,
    signs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    v = _feedback_input(x, error.numel(), grad, beta, signs) + error.float()
    out.copy_(v - torch.where(v >= 0, scale, -scale))


def sum_ranks(rows: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of ``rows`` (``[W, ...]``, row ``i`` from rank ``i``), added left to
    right in rank order from zero: ``((0 + rows[0]) + rows[1]) + ... + rows[W - 1]``, rounded in
    ``rows``' dtype after every addition.

    The order is part of the result: every kernel that sums over ranks (the 1-bit allreduce's
    server sum, the quantized allreduce's sum of dequantized pieces) follows it, on every
    device and kernel set, so their bits do not depend on a library's reduction order. Adding
    from zero makes a zero sum ``+0.0``.

    Args:
        rows: a tensor of at least one dimension; dim 0 is the rank.

    Returns:
        A tensor of ``rows[0]``'s shape and dtype.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> rows = torch.tensor([[1.0, 2.0**24], [2.0, 1.0], [3.0, 1.0]])
        >>> K.sum_ranks(rows).tolist()  # (2^24 + 1) rounds to 2^24, and so does + 1 again
        [6.0, 16777216.0]
    """
    total = torch.zeros_like(rows[0])
    for row in rows.unbind(0):
        total = total + row
    return total


def sign_sum(signs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_i weights[i] * s_i`` over the ``W`` rows of packed signs ``signs`` (uint8
    ``[W, chunk / 8]``), as the 1-bit allreduce's server reduces: ``W`` rows of +-1 scaled in
    place and summed in rank order (:func:`sum_ranks`)."""
    ranks, chunk = signs.shape[0], signs.shape[1] * 8
    unpacked = unpackbits(signs.reshape(-1), ranks * chunk).view(ranks, chunk)
    return sum_ranks(unpacked.mul_(weights[:, None]))


def sign_sum_compress(
    signs: torch.Tensor, weights: torch.Tensor, error: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return sign_compress(sign_sum(signs, weights) + error.float())[:2]


def sign_sum_apply_error(
    signs: torch.Tensor,
    weights: torch.Tensor,
    error: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
) -> None:
    v = sign_sum(signs, weights) + error.float()
    out.copy_(v - torch.where(v >= 0, scale, -scale))


def unpack_scaled(packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    ranks, chunk = packed.shape[0], packed.shape[1] * 8
    values = unpackbits(packed.reshape(-1), ranks * chunk).view(ranks, chunk)
    out.copy_(values.mul_(scales[:, None]).reshape(-1)[: out.numel()])


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The fp64 root rounded once to fp32, which is exact (fp64 carries more than 2 * 24 + 2
    bits, so the double rounding is innocuous)."""
    if v.dtype != torch.float32 or v.device.type == "mps":
        return v.sqrt()
    return v.double().sqrt().float()


def adam_direction(
    m: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor | None,
    eta: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    bound: float | None,
    weight_decay: float,
) -> None:
    u = m / sqrt_rn(v).add_(eps)
    if bound is not None:
        u = u.clamp(-bound, bound)
    if p is not None:
        u = u.add_(weight_decay * p.float())
    out.copy_(u.mul_(-eta))


def adam_apply(
    m: torch.Tensor | None,
    v: torch.Tensor,
    eta: torch.Tensor,
    params: torch.Tensor,
    root: torch.Tensor | None,
    eps: float,
    bound: float | None,
    weight_decay: float,
    signs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``root`` (like ``params``, or ``None``) is scratch for the update."""
    if signs is not None:
        values = torch.empty(params.numel(), dtype=torch.float32, device=params.device)
        unpack_scaled(*signs, values)
        m = values.view(params.shape) if m is None else m.copy_(values.view(m.shape))
    decayed = params if weight_decay else None
    update = torch.empty_like(params) if root is None else root
    adam_direction(m, v, decayed, eta, update, eps, bound, weight_decay)
    params.add_(update)


def check_bits(bits: int) -> None:
    """Raises ``ValueError`` unless ``bits`` is a code width of :func:`quantize`: the int 4 or
    8 (``4.0`` and ``True`` are not: a setting of another type is a mistake upstream)."""
    if not _is_int(bits) or bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")


def check_quant_args(bits: int, group_size: int) -> None:
    """Checks the settings of blockwise quantization (:func:`fn.kernels.quantize`), once for
    every layer that takes them.

    Args:
        bits: the code width: the int 4 or 8 (``4.0`` and ``True`` are not).
        group_size: values per group, each with its own scale: an even int >= 2.

    Raises:
        ValueError: naming the setting that is neither.

    Example:
        >>> fn.kernels.check_quant_args(4.0, 128)
        Traceback (most recent call last):
        ...
        ValueError: bits must be 4 or 8, got 4.0
    """
    check_bits(bits)
    if not _is_int(group_size) or group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be an even number >= 2, got {group_size!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_quant_args(bits, group_size)
    n = x.numel()
    v = torch.nn.functional.pad(x.float(), (0, -n % group_size)).view(-1, group_size)
    qmax = 2 ** (bits - 1)
    scales = v.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.clamp(torch.round(v / safe[:, None]), -qmax, qmax - 1).to(torch.int8)
    q = q.view(torch.uint8).view(-1)
    if bits == 4:
        q = ((q[0::2] & 0xF) << 4) | (q[1::2] & 0xF)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    check_bits(bits)
    if bits == 4:
        high = (q >> 4).to(torch.int16)
        low = (q & 0xF).to(torch.int16)
        values = torch.stack([high, low], dim=1).view(-1)
        values = torch.where(values >= 8, values - 16, values)
    else:
        values = q.view(torch.int8)
    groups = scales.numel()
    values = values.float().view(groups, -1) if groups else values.float().view(0, 1)
    return (values * scales[:, None]).view(-1)[:n]


def _laid_out(x: torch.Tensor, numel: int, rows: tuple[int, int, int] | None) -> torch.Tensor:
    """``x`` as the ``numel`` values ``v`` it stands for: zero-padded past its end, or with
    ``rows = (row, padded_row, local)`` its rows of ``row`` values each zero-padded to
    ``padded_row`` and reordered from ``[nodes, local]`` to ``[local, nodes]``."""
    x = x.float()
    if rows is not None:
        row, padded_row, local = rows
        x = torch.nn.functional.pad(x.view(-1, row), (0, padded_row - row))
        x = x.view(-1, local, padded_row).transpose(0, 1).reshape(-1)
    return torch.nn.functional.pad(x, (0, numel - x.numel()))


def loco_quantize(
    x: torch.Tensor,
    error: torch.Tensor | None,
    bits: int,
    group_size: int,
    numel: int,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of a group with a non-finite value are unspecified."""
    v = _laid_out(x, numel, rows)
    q, scales = quantize(v if error is None else v + error.float(), bits, group_size)
    if out is None:
        return q, scales
    return out[0].copy_(q), out[1].copy_(scales)


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
    n = out.numel()
    e = torch.zeros(n, device=out.device) if error is None else error.float()
    residual = (_laid_out(x, n, rows) + e) - dequantize(q, scales, bits, n)
    out.copy_(residual * (1 - err_beta) + err_beta * e)


def dequantize_sum(
    q: torch.Tensor, scales: torch.Tensor, bits: int, pieces: int, out: torch.Tensor
) -> None:
    rows = dequantize(q, scales, bits, pieces * out.numel()).view(pieces, -1)
    out.copy_(sum_ranks(rows))


def dequantize_into(
    q: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    out: torch.Tensor,
    chunks: int = 1,
    local_world_size: int = 1,
) -> None:
    values = dequantize(q, scales, bits, q.numel() * 8 // bits)
    values = values.view(chunks // local_world_size, local_world_size, -1).transpose(0, 1)
    out.copy_(values.reshape(-1)[: out.numel()])


def copy_moments(
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    m_outs: list[torch.Tensor],
    v_outs: list[torch.Tensor],
) -> None:
    """The moments into the outputs of :func:`adamw_step` that are not the moments themselves
    (the step then updates the outputs in place)."""
    for outs, xs in ((m_outs, ms), (v_outs, vs)):
        for out, x in zip(outs, xs, strict=True):
            if out is not x:
                out.copy_(x)


def adamw_step(
    ps: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    m_outs: list[torch.Tensor],
    v_outs: list[torch.Tensor],
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    copy_moments(ms, vs, m_outs, v_outs)
    stepped = [p.clone() for p in ps]
    counts = [torch.tensor(step, dtype=torch.float32, device=p.device) for p in ps]
    torch._fused_adamw_(
        stepped, gs, m_outs, v_outs, [], counts, lr=lr, beta1=beta1, beta2=beta2,
        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
    )  # fmt: skip
    for p, new in zip(ps, stepped, strict=True):
        p.add_(new.sub_(p))
