"""Triton kernels for CUDA and XPU (imported only when Triton is installed).

They follow the canonical orders of ``fn.kernels._reference``: a program of the sign kernel
handles ``GROUP`` blocks of 1024 elements; inside a block, lane ``j`` of 16 adds the squares of
elements ``j, j+16, ...`` in fp64 in that order, then the lanes fold as ``lane[j] + lane[j+h]``
for ``h = 8, 4, 2, 1`` (a sum over an axis of length 2 is one addition, so its order is fixed).

Index arithmetic is int64 and every bound (``n``, byte and block counts) comes from the host, so
no in-kernel expression wraps at 2^31 elements. Floating-point divisions use ``tl.div_rn``
(IEEE round-to-nearest; Triton's ``/`` may be approximate on GPUs). Fused multiply-adds (on
by default) change no result: the only product that is added, ``d * d`` of an fp32 ``d`` in
fp64, is exact.

Devices without fp64 run ``sign_blocks_kernel`` with ``FP64=False``: the fp64 arithmetic is
done on int64 bit patterns instead (:func:`_square_f64` and :func:`_add_f64`), which give the
IEEE fp64 results bit for bit. Only non-negative values occur (squares and their sums), so an
addition never cancels; subnormal fp64 values cannot occur (the smallest square of an fp32 is
2^-298).
"""

import triton
import triton.language as tl

_FRAC = tl.constexpr(0xFFFFFFFFFFFFF)  # the 52 fraction bits of an fp64
_ONE = tl.constexpr(0x10000000000000)  # the implicit leading bit, 2^52
_NAN = tl.constexpr(0x7FF8000000000000)
_INF = tl.constexpr(0x7FF0000000000000)
# 1.5 * 2^23: (y + M) - M rounds |y| < 2^22 half to even in fp32
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _square_f64(v):
    """The fp64 bit pattern (int64) of ``v * v`` for fp32 ``v``: exact, as in fp64."""
    u = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    biased = u >> 23
    frac = (u & 0x7FFFFF).to(tl.int64)
    mant = tl.where(biased > 0, frac | 0x800000, frac)
    exp = tl.maximum(biased, 1).to(tl.int64) - 127  # v = mant * 2^(exp - 23)
    prod = mant * mant  # < 2^48, exact
    top = tl.zeros_like(prod)  # index of the highest set bit of prod
    rest = prod
    for i in tl.static_range(6):
        shift = 32 >> i
        has = (rest >> shift) != 0
        rest = tl.where(has, rest >> shift, rest)
        top += tl.where(has, shift, 0)
    bits = ((2 * exp - 46 + top + 1023) << 52) | ((prod << (52 - top)) & _FRAC)
    bits = tl.where(prod == 0, 0, bits)
    special = tl.where(frac != 0, _NAN, _INF)
    return tl.where(biased == 255, special, bits)


@triton.jit
def _add_f64(a, b):
    """The fp64 sum, round to nearest even, of two non-negative fp64 bit patterns (int64);
    NaN and +inf propagate. Symmetric in ``a`` and ``b``."""
    hi = tl.maximum(a, b)  # the order of non-negative fp64 values is that of their bits
    lo = tl.minimum(a, b)
    hi_exp = hi >> 52
    hi_mant = ((hi & _FRAC) | _ONE) << 3  # three guard bits
    lo_mant = tl.where(lo == 0, 0, ((lo & _FRAC) | _ONE) << 3)
    shift = tl.minimum(hi_exp - (lo >> 52), 62)
    aligned = lo_mant >> shift
    aligned |= ((aligned << shift) != lo_mant).to(tl.int64)  # sticky bit
    total = hi_mant + aligned
    carry = total >> 56
    total = (total >> carry) | (total & carry)
    mant = total >> 3
    low = total & 7
    mant += ((low > 4) | ((low == 4) & ((mant & 1) == 1))).to(tl.int64)
    over = mant >> 53
    bits = ((hi_exp + carry + over) << 52) | ((mant >> over) & _FRAC)
    return tl.where((lo == 0) | (hi_exp == 2047), hi, bits)


@triton.jit
def _halve(acc, ROWS: tl.constexpr, HALF: tl.constexpr, FP64: tl.constexpr):
    """``acc[:, j] + acc[:, j + HALF]`` for ``j < HALF`` (one addition: its order is fixed)."""
    first, second = tl.split(tl.permute(tl.reshape(acc, (ROWS, 2, HALF)), (0, 2, 1)))
    if FP64:
        return first + second
    else:
        return _add_f64(first, second)


@triton.jit
def _fold_halves(acc, GROUP: tl.constexpr, FP64: tl.constexpr):
    """Folds the 16 lanes of each row as ``lane[j] + lane[j + h]``, h = 8, 4, 2, 1."""
    acc = _halve(acc, GROUP, 8, FP64)
    acc = _halve(acc, GROUP, 4, FP64)
    acc = _halve(acc, GROUP, 2, FP64)
    return tl.reshape(_halve(acc, GROUP, 1, FP64), (GROUP,))


@triton.jit
def _signs_and_squares(v, inside, acc, blocks, k, bits_ptr, nbytes, GROUP, BLOCK, FP64):
    """Adds the squares of the fp32 ``v`` (``[GROUP, 16]``, elements ``k * 16 ...`` of the
    blocks) to their lanes and stores their packed signs; returns the lanes."""
    weights = (1 << (7 - tl.arange(0, 8))).to(tl.int32)
    if FP64:
        d = v.to(tl.float64)
        acc += d * d
    else:
        acc = _add_f64(acc, _square_f64(v))
    bit = ((v >= 0) & inside).to(tl.int32)
    byte = tl.sum(tl.reshape(bit, (GROUP, 2, 8)) * weights[None, None, :], axis=2)
    byte_idx = blocks[:, None] * (BLOCK // 8) + k * 2 + tl.arange(0, 2)[None, :]
    tl.store(bits_ptr + byte_idx, byte.to(tl.uint8), mask=byte_idx < nbytes)
    return acc


@triton.jit
def _feedback_values(x_ptr, g_ptr, e_ptr, idx, n_valid, length, beta, one_minus_beta, MOMENTUM):
    """``v = source + e`` at ``idx``: the source is ``x`` (or ``beta * x + (1 - beta) * g``;
    launched without fp fusion, so two roundings) zero-padded from ``n_valid`` to ``length``."""
    valid = idx < n_valid
    x = tl.load(x_ptr + idx, mask=valid, other=0.0)
    if MOMENTUM:
        g = tl.load(g_ptr + idx, mask=valid, other=0.0)
        x = tl.where(valid, beta * x + one_minus_beta * g, 0.0)
    return x + tl.load(e_ptr + idx, mask=idx < length, other=0.0)


@triton.jit
def feedback_blocks_kernel(
    x_ptr,
    g_ptr,
    e_ptr,
    bits_ptr,
    sums_ptr,
    n_valid,
    length,
    nbytes,
    nblocks,
    beta,
    one_minus_beta,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    FP64: tl.constexpr,
    MOMENTUM: tl.constexpr,
):
    """Packed signs and per-block sums of squares (fp64, or their int64 bits without FP64) of
    ``v`` (:func:`_feedback_values`, never stored); with ``e_ptr=None`` (a compile-time switch)
    of the first ``length`` elements of ``x`` (fp32, fp16 or bf16; ``n_valid == length``)."""
    lanes = tl.arange(0, 16)
    blocks = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP).to(tl.int64)
    if FP64:
        acc = tl.zeros((GROUP, 16), dtype=tl.float64)
    else:
        acc = tl.zeros((GROUP, 16), dtype=tl.int64)
    for k in range(BLOCK // 16):
        idx = blocks[:, None] * BLOCK + k * 16 + lanes[None, :]
        inside = idx < length
        if e_ptr is None:
            v = tl.load(x_ptr + idx, mask=inside, other=0.0).to(tl.float32)
        else:
            v = _feedback_values(
                x_ptr, g_ptr, e_ptr, idx, n_valid, length, beta, one_minus_beta, MOMENTUM
            )
        acc = _signs_and_squares(v, inside, acc, blocks, k, bits_ptr, nbytes, GROUP, BLOCK, FP64)
    tl.store(sums_ptr + blocks, _fold_halves(acc, GROUP, FP64), mask=blocks < nblocks)


@triton.jit
def sign_blocks_kernel(
    x_ptr,
    bits_ptr,
    sums_ptr,
    n,
    nbytes,
    nblocks,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    FP64: tl.constexpr,
):
    """:func:`feedback_blocks_kernel` of ``x`` itself."""
    feedback_blocks_kernel(
        x_ptr, None, None, bits_ptr, sums_ptr, n, n, nbytes, nblocks, 0.0, 1.0, GROUP, BLOCK, FP64,
        False,
    )  # fmt: skip


@triton.jit
def feedback_error_kernel(
    x_ptr,
    g_ptr,
    e_ptr,
    scale_ptr,
    out_ptr,
    n_valid,
    length,
    beta,
    one_minus_beta,
    BLOCK: tl.constexpr,
    MOMENTUM: tl.constexpr,
):
    """``out = v - scale * s(v)`` (``out`` may be ``e``: each element is read first)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    v = _feedback_values(x_ptr, g_ptr, e_ptr, idx, n_valid, length, beta, one_minus_beta, MOMENTUM)
    scale = tl.load(scale_ptr)
    tl.store(out_ptr + idx, v - tl.where(v >= 0, scale, -scale), mask=idx < length)


@triton.jit
def _sign_bits(bits_ptr, idx, inside):
    """The packed sign bits ``idx`` (most significant bit first): 1 for +1, 0 for -1."""
    byte = tl.load(bits_ptr + idx // 8, mask=inside, other=0).to(tl.int32)
    return (byte >> (7 - (idx % 8)).to(tl.int32)) & 1


@triton.jit
def unpack_scaled_kernel(bits_ptr, scales_ptr, out_ptr, n, chunk, BLOCK: tl.constexpr):
    """``out[k] = +-scales[k // chunk]`` by sign bit ``k``."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = idx < n
    bit = _sign_bits(bits_ptr, idx, inside)
    scale = tl.load(scales_ptr + idx // chunk, mask=inside, other=0.0)
    tl.store(out_ptr + idx, tl.where(bit != 0, scale, -scale), mask=inside)


@triton.jit
def adam_direction_kernel(
    m_ptr,
    v_ptr,
    p_ptr,
    out_ptr,
    n,
    eps,
    bound,
    weight_decay,
    neg_eta,
    BLOCK: tl.constexpr,
    CLAMP: tl.constexpr,
    DECAY: tl.constexpr,
):
    """``out = (clamp(m / (sqrt(v) + eps)) (+ wd * p)) * neg_eta``, the square root correctly
    rounded; launched without fp fusion."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = idx < n
    root = tl.sqrt_rn(tl.load(v_ptr + idx, mask=inside, other=1.0))
    u = tl.div_rn(tl.load(m_ptr + idx, mask=inside, other=0.0), root + eps)
    if CLAMP:
        u = tl.where(u < -bound, -bound, tl.where(u > bound, bound, u))
    if DECAY:
        u = u + weight_decay * tl.load(p_ptr + idx, mask=inside, other=0.0)
    tl.store(out_ptr + idx, u * neg_eta, mask=inside)


@triton.jit
def packbits_kernel(x_ptr, bits_ptr, n, nbytes, BYTES: tl.constexpr):
    byte_idx = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES).to(tl.int64)
    idx = byte_idx[:, None] * 8 + tl.arange(0, 8)[None, :]
    inside = idx < n
    # fp16/bf16 to fp32 is exact; the interpreter compares bf16 values only after conversion
    v = tl.load(x_ptr + idx, mask=inside, other=0.0).to(tl.float32)
    bit = ((v >= 0) & inside).to(tl.int32)
    byte = tl.sum(bit * (1 << (7 - tl.arange(0, 8)))[None, :], axis=1)
    tl.store(bits_ptr + byte_idx, byte.to(tl.uint8), mask=byte_idx < nbytes)


@triton.jit
def unpackbits_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = idx < n
    bit = _sign_bits(bits_ptr, idx, inside)
    out = tl.where(bit != 0, 1.0, -1.0)
    tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _load_group_chunk(x_ptr, rows, chunk, n, groups, group_size, CHUNK: tl.constexpr):
    """Columns ``chunk * CHUNK ...`` of the groups ``rows`` as fp32 (zero past ``n``)."""
    cols = tl.cast(chunk, tl.int64) * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    idx = rows[:, None] * group_size + cols[None, :]
    in_group = (cols[None, :] < group_size) & (rows[:, None] < groups)
    v = tl.load(x_ptr + idx, mask=in_group & (idx < n), other=0.0).to(tl.float32)
    return v, idx, in_group


@triton.jit
def quantize_kernel(
    x_ptr,
    q_ptr,
    scales_ptr,
    n,
    groups,
    group_size,
    chunks,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    BITS: tl.constexpr,
):
    """Groupwise symmetric quantization of ``ROWS`` groups, ``chunks`` tiles of ``CHUNK``."""
    qmax: tl.constexpr = 2 ** (BITS - 1)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    # absmax on the bits of |v|: their order is that of the values, and NaN beats +inf.
    abs_bits = tl.zeros((ROWS, CHUNK), dtype=tl.int32)
    for chunk in range(chunks):
        v, idx, in_group = _load_group_chunk(x_ptr, rows, chunk, n, groups, group_size, CHUNK)
        abs_bits = tl.maximum(abs_bits, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    absmax = tl.max(abs_bits, axis=1).to(tl.float32, bitcast=True)
    scale = tl.div_rn(absmax, tl.full((ROWS,), qmax, tl.float32))
    tl.store(scales_ptr + rows, scale, mask=rows < groups)
    safe = tl.where(scale > 0, scale, 1.0)
    for chunk in range(chunks):
        v, idx, in_group = _load_group_chunk(x_ptr, rows, chunk, n, groups, group_size, CHUNK)
        y = tl.div_rn(v, tl.broadcast_to(safe[:, None], (ROWS, CHUNK)))
        # clamp, then round half to even (the same as rounding first: the bounds are integers)
        y = tl.minimum(tl.maximum(y, -qmax), qmax - 1)
        y = (y + _ROUND_MAGIC) - _ROUND_MAGIC
        code = y.to(tl.int32) & 0xFF
        if BITS == 8:
            tl.store(q_ptr + idx, code.to(tl.uint8), mask=in_group)
        else:
            pairs = tl.reshape(code & 0xF, (ROWS, CHUNK // 2, 2))
            byte = tl.sum(pairs * (16 >> (4 * tl.arange(0, 2)))[None, None, :], axis=2)
            cols = tl.cast(chunk, tl.int64) * (CHUNK // 2) + tl.arange(0, CHUNK // 2).to(tl.int64)
            byte_idx = rows[:, None] * (tl.cast(group_size, tl.int64) // 2) + cols[None, :]
            keep = (cols[None, :] < tl.cast(group_size, tl.int64) // 2) & (rows[:, None] < groups)
            tl.store(q_ptr + byte_idx, byte.to(tl.uint8), mask=keep)


@triton.jit
def dequantize_kernel(
    q_ptr, scales_ptr, out_ptr, n, per_group, BITS: tl.constexpr, BLOCK: tl.constexpr
):
    """``code * scale`` in fp32 for the first ``n`` codes; ``per_group`` codes per scale."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = idx < n
    if BITS == 8:
        code = tl.load(q_ptr + idx, mask=inside, other=0).to(tl.int8, bitcast=True)
        code = code.to(tl.int32)
    else:
        byte = tl.load(q_ptr + idx // 2, mask=inside, other=0).to(tl.int32)
        nibble = tl.where(idx % 2 == 0, byte >> 4, byte & 0xF)
        code = tl.where(nibble >= 8, nibble - 16, nibble)
    scale = tl.load(scales_ptr + idx // per_group, mask=inside, other=0.0)
    tl.store(out_ptr + idx, code.to(tl.float32) * scale, mask=inside)
