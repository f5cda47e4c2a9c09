"""The fused LoCo kernels (loco_quantize, loco_error, dequantize_sum, dequantize_into) bit for
bit against their pure-torch definitions: the unfused ops the collectives used before them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn.kernels as K
from fn.kernels import _cpu, _reference


def _c(name):
    if _cpu.library() is None:
        pytest.skip("no working C compiler: the CPU kernels fall back to the reference")
    return getattr(_cpu, name)


IMPLS = [
    pytest.param(lambda name: getattr(_reference, name), id="reference"),
    pytest.param(_c, id="c"),
    pytest.param(lambda name: getattr(K, name), id="ops"),
]


def _values(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    x[::7] *= 1e-30
    x[::11] *= 1e20
    x[3::13] = -0.0
    x[5::17] = 1e-45
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


_CASES = st.tuples(
    st.sampled_from((4, 8)),  # bits
    st.sampled_from((2, 6, 32, 128)),  # group size
    st.integers(1, 40),  # chunks (pieces)
    st.integers(1, 5),  # groups per chunk
    st.floats(0.0, 1.0),  # where n falls in [0, N]
    st.integers(0, 2**31),  # seed
)


def _padded_quantize(x, e, bits, group_size, numel):
    """The unfused phase 1: a padded copy of x, plus e, quantized."""
    v = torch.nn.functional.pad(x, (0, numel - x.numel()))
    return K.quantize(v if e is None else v + e, bits, group_size)


@pytest.mark.parametrize("impls", IMPLS)
@settings(max_examples=60, deadline=None)
@given(case=_CASES, beta=st.floats(0.0, 1.0), with_error=st.booleans())
def test_loco_quantize_and_error_match_the_unfused_ops(impls, case, beta, with_error):
    bits, group_size, chunks, groups, where, seed = case
    numel = chunks * groups * group_size
    x = _values(int(where * numel), seed)
    e = _values(numel, seed + 1, 0.3) if with_error else None
    q, scales = impls("loco_quantize")(x, e, bits, group_size, numel)
    want_q, want_scales = _padded_quantize(x, e, bits, group_size, numel)
    assert _same_bits(q, want_q) and _same_bits(scales, want_scales)

    # today's _feedback: v - dq, then residual * (1 - beta) + beta * e (e = 0: a reset error)
    v = torch.nn.functional.pad(x, (0, numel - x.numel())) + (0.0 if e is None else e)
    residual = v - K.dequantize(q, scales, bits, numel)
    want = residual * (1 - beta) + beta * (torch.zeros(numel) if e is None else e)
    out = torch.full((numel,), 7.0)
    impls("loco_error")(x, e, q, scales, bits, beta, out)
    assert _same_bits(out, want)
    if e is not None:  # in place
        impls("loco_error")(x, e, q, scales, bits, beta, e)
        assert _same_bits(e, want)


@pytest.mark.parametrize("impls", IMPLS)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_non_finite_group_has_the_reference_s_scale(impls, bits):
    """A group with an Inf and no NaN: an infinite scale, one with a NaN a NaN scale, in every
    kernel set (the C kernel gave NaN for both); the finite group after them is unaffected."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([inf, 1.0, -2.0, 0.5, nan, 1.0, -inf, 0.0, 1.0, 2.0, 3.0, 4.0])
    q, scales = impls("loco_quantize")(x, None, bits, 4, 12)
    want_q, want_scales = _reference.loco_quantize(x, None, bits, 4, 12)
    assert _same_bits(scales, want_scales), (scales, want_scales)
    assert scales[0] == inf and scales[1].isnan() and torch.isfinite(scales[2])
    codes = 4 * bits // 8  # the finite group's codes
    assert _same_bits(q[-codes:], want_q[-codes:])


@pytest.mark.parametrize("impls", IMPLS)
@settings(max_examples=60, deadline=None)
@given(
    case=_CASES,
    row=st.integers(1, 50),
    extra=st.integers(0, 1),
    local=st.sampled_from((1, 2, 3)),
    with_error=st.booleans(),
)
def test_loco_kernels_lay_out_padded_rows(impls, case, row, extra, local, with_error):
    """FSDP's reduce-scatter input: R rows, each zero-padded, reordered for two hops."""
    bits, group_size, chunks, _, _, seed = case
    count = chunks * local
    padded_row = (-(-row // group_size) + extra) * group_size
    numel = count * padded_row
    x = _values(count * row, seed)
    v = torch.nn.functional.pad(x.view(count, row), (0, padded_row - row))
    v = v.view(chunks, local, padded_row).transpose(0, 1).reshape(-1)
    e = _values(numel, seed + 1, 0.3) if with_error else None
    rows = (row, padded_row, local)
    q, scales = impls("loco_quantize")(x, e, bits, group_size, numel, rows=rows)
    want_q, want_scales = _padded_quantize(v, e, bits, group_size, numel)
    assert _same_bits(q, want_q) and _same_bits(scales, want_scales)
    out, want = torch.empty(numel), torch.empty(numel)
    impls("loco_error")(x, e, q, scales, bits, 0.8, out, rows=rows)
    K.loco_error(v, e, q, scales, bits, 0.8, want)
    assert _same_bits(out, want)


@pytest.mark.parametrize("impls", IMPLS)
@settings(max_examples=60, deadline=None)
@given(case=_CASES)
def test_dequantize_sum_and_into_match_the_unfused_ops(impls, case):
    bits, group_size, chunks, groups, where, seed = case
    cols = groups * group_size
    q, scales = K.quantize(_values(chunks * cols, seed), bits, group_size)
    pieces = K.dequantize(q, scales, bits, chunks * cols)
    out = torch.full((cols,), 7.0)
    impls("dequantize_sum")(q, scales, bits, chunks, out)
    assert _same_bits(out, K.sum_ranks(pieces.view(chunks, -1)))

    for local in {1, chunks} | {d for d in (2, 3, 4) if chunks % d == 0}:
        ordered = pieces.view(chunks // local, local, -1).transpose(0, 1).reshape(-1)
        n = int(where * chunks * cols)
        out = torch.full((n,), 7.0)
        impls("dequantize_into")(q, scales, bits, out, chunks, local)
        assert _same_bits(out, ordered[:n])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("offset", range(9))
@pytest.mark.parametrize("group_size", [8, 32, 128, 200])
def test_dequantize_into_any_output_alignment(group_size, offset, threads):
    """4-bit output is streamed (non-temporal stores) where it is 32-byte aligned, stored
    plainly elsewhere: the same bits for every alignment, tail and split over threads."""
    _c("dequantize_into")
    chunks, cols = 4, group_size * (3 * _cpu._CHUNK // (4 * group_size) + 1)
    q, scales = K.quantize(_values(chunks * cols, offset), 4, group_size)
    ordered = K.dequantize(q, scales, 4, chunks * cols).view(2, 2, -1).transpose(0, 1)
    n = chunks * cols - 5 * offset
    base = torch.full((n + offset,), 7.0)
    out = base[offset:]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _cpu.dequantize_into(q, scales, 4, out, chunks, 2)
    finally:
        torch.set_num_threads(previous)
    assert _same_bits(out, ordered.reshape(-1)[:n])
    assert bool((base[:offset] == 7.0).all())


@pytest.mark.parametrize("pieces", [2, 3, 4, 8, 15, 16, 17, 31, 33, 64])
@pytest.mark.parametrize("cols", [32, 4096, 96 * 1024])
def test_dequantize_sum_adds_in_rank_order_on_large_rows(pieces, cols):
    """Many pieces, and rows split over threads: rank by rank, left to right."""
    x = _values(pieces * cols, pieces + cols) * torch.logspace(-6, 6, pieces * cols)
    q, scales = K.quantize(x, 4, 32)
    out = torch.empty(cols)
    K.dequantize_sum(q, scales, 4, pieces, out)
    assert _same_bits(out, K.sum_ranks(K.dequantize(q, scales, 4, pieces * cols).view(pieces, -1)))


def test_ops_run_per_row_under_vmap():
    x, e = _values(2 * 64, 1).view(2, 64), _values(2 * 64, 2).view(2, 64)
    q, scales = torch.func.vmap(lambda x, e: K.loco_quantize(x, e, 4, 32, 64))(x, e)

    def error(x, e, q, s, out):
        K.loco_error(x, e, q, s, 4, 0.5, out)
        return out

    def sum_rows(q, s, out):
        K.dequantize_sum(q, s, 4, 2, out)
        return out

    out = torch.func.vmap(error)(x, e, q, scales, torch.empty(2, 64))
    summed = torch.func.vmap(sum_rows)(q, scales, torch.empty(2, 32))
    for row in range(2):
        want_q, want_scales = K.loco_quantize(x[row], e[row], 4, 32, 64)
        assert _same_bits(q[row], want_q) and _same_bits(scales[row], want_scales)
        want = torch.empty(64)
        K.loco_error(x[row], e[row], want_q, want_scales, 4, 0.5, want)
        assert _same_bits(out[row], want)
        assert _same_bits(
            summed[row], K.sum_ranks(K.dequantize(want_q, want_scales, 4, 64).view(2, -1))
        )
    with pytest.raises(ValueError, match="batched"):
        torch.func.vmap(lambda q, s: sum_rows(q, s, torch.empty(32)))(q, scales)


def test_bad_arguments():
    x = torch.zeros(10)
    with pytest.raises(ValueError, match="numel"):
        K.loco_quantize(x, None, 4, 4, 6)
    with pytest.raises(ValueError, match="error"):
        K.loco_quantize(x, torch.zeros(3), 4, 4, 12)
    with pytest.raises(ValueError, match="rows"):
        K.loco_quantize(x, None, 4, 4, 12, rows=(3, 4, 1))
    with pytest.raises(ValueError, match="uint8"):
        K.loco_quantize(x, None, 4, 4, 12, out=(torch.empty(6), torch.empty(3)))
    q, scales = K.quantize(torch.zeros(12), 4, 4)
    with pytest.raises(ValueError, match="out must be fp32"):
        K.loco_error(x, None, q, scales, 4, 0.5, torch.empty(11))
    with pytest.raises(ValueError, match="rows"):
        K.dequantize_sum(q, scales, 4, 5, torch.empty(2))
    with pytest.raises(ValueError, match="local_world_size"):
        K.dequantize_into(q, scales, 4, torch.empty(12), 3, 2)
