"""The reference kernels against independent oracles: numpy.packbits, Python-float loops for
the canonical scale order, numpy for quantization."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fn.kernels import _reference as ref

_FLOATS = st.floats(width=32, allow_nan=False, allow_infinity=False)
_BOUNDED = st.floats(min_value=-(2.0**100), max_value=2.0**100, width=32)


def _canonical_scale(values: list[float]) -> float:
    """The documented scale order, written with Python floats (IEEE fp64)."""
    n = len(values)
    if n == 0:
        return 0.0
    blocks = []
    for start in range(0, n, 1024):
        chunk = values[start : start + 1024] + [0.0] * max(0, start + 1024 - n)
        lanes = [0.0] * 16
        for i, x in enumerate(chunk):
            lanes[i % 16] += x * x
        for h in (8, 4, 2, 1):
            for j in range(h):
                lanes[j] += lanes[j + h]
        blocks.append(lanes[0])
    while len(blocks) & (len(blocks) - 1):
        blocks.append(0.0)
    while len(blocks) > 1:
        half = len(blocks) // 2
        blocks = [blocks[i] + blocks[i + half] for i in range(half)]
    return float(np.float32(math.sqrt(blocks[0] / n)))


@pytest.mark.parametrize("n", range(71))
def test_packbits_roundtrip_every_short_length(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    packed = ref.packbits(x)
    assert packed.dtype == torch.uint8 and packed.shape == ((n + 7) // 8,)
    assert np.array_equal(packed.numpy(), np.packbits(x.numpy() >= 0))
    assert torch.equal(ref.unpackbits(packed, n), torch.where(x >= 0, 1.0, -1.0))


@settings(max_examples=40, deadline=None)
@given(st.lists(_FLOATS, max_size=3000))
def test_packbits_matches_numpy(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert np.array_equal(ref.packbits(x).numpy(), np.packbits(x.numpy() >= 0))
    assert torch.equal(ref.unpackbits(ref.packbits(x), len(values)), torch.where(x >= 0, 1.0, -1.0))


def test_sign_rule_special_values():
    x = torch.tensor([-0.0, 0.0, -1e-45, 1e-45, -1.0, float("nan"), 3.0, -0.0, -2.0])
    expected = np.array([1, 1, 0, 1, 0, 0, 1, 1, 0], dtype=bool)
    assert np.array_equal(ref.packbits(x).numpy(), np.packbits(expected))
    assert ref.packbits(torch.full((13,), -0.0)).tolist() == [255, 0b11111000]
    assert ref.packbits(torch.zeros(9)).tolist() == [255, 0b10000000]
    assert ref.packbits(-torch.rand(11) - 0.5).tolist() == [0, 0]


def test_tail_bits_are_zero():
    for n in range(1, 17):
        tail = n % 8
        expected = 0xFF if tail == 0 else (0xFF << (8 - tail)) & 0xFF
        assert ref.packbits(torch.ones(n))[-1].item() == expected


@pytest.mark.parametrize("n", [0, 1, 5, 16, 17, 1023, 1024, 1025, 3000, 5000])
def test_scale_follows_the_documented_order(n):
    g = torch.Generator().manual_seed(n)
    m = (
        torch.randn(n, generator=g)
        * torch.logspace(-20, 20, n).flip(0)[torch.randperm(n, generator=g)]
    )
    _, scale, _ = ref.sign_compress(m)
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert scale.item() == _canonical_scale(m.tolist())
    if n:
        norm = torch.linalg.vector_norm(m.double()).item() / math.sqrt(n)
        assert scale.item() == pytest.approx(norm, rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(_BOUNDED, _BOUNDED), min_size=1, max_size=2100))
def test_sign_compress_formula(pairs):
    m, e = torch.tensor(pairs).unbind(1)
    packed, scale, new_error = ref.sign_compress(m, e)
    v = m + e
    assert scale.item() == _canonical_scale(v.tolist())
    assert np.array_equal(packed.numpy(), np.packbits(v.numpy() >= 0))
    expected = [vi - (scale.item() if vi >= 0 else -scale.item()) for vi in v.tolist()]
    assert new_error.numpy().tolist() == np.float32(expected).tolist()
    assert ref.sign_compress(m)[2] is None


def test_sign_compress_empty():
    packed, scale, new_error = ref.sign_compress(torch.zeros(0), torch.zeros(0))
    assert packed.numel() == 0 and scale.item() == 0.0 and new_error.numel() == 0


def _numpy_quantize(x: np.ndarray, bits: int, group_size: int):
    qmax = 2 ** (bits - 1)
    pad = -len(x) % group_size
    v = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, group_size)
    scales = (np.abs(v).max(axis=1) / np.float32(qmax)).astype(np.float32)
    codes = np.zeros_like(v, dtype=np.int64)
    for g, s in enumerate(scales):
        if s > 0:
            codes[g] = np.clip(np.rint(v[g] / s), -qmax, qmax - 1)
    return codes.reshape(-1), scales


def _unpack_codes(q: torch.Tensor, bits: int) -> np.ndarray:
    if bits == 8:
        return q.view(torch.int8).numpy().astype(np.int64)
    nibbles = np.stack([q.numpy() >> 4, q.numpy() & 0xF], axis=1).reshape(-1).astype(np.int64)
    return np.where(nibbles >= 8, nibbles - 16, nibbles)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [2, 6, 64])
@pytest.mark.parametrize("n", [0, 1, 7, 64, 65, 300])
def test_quantize_matches_numpy_and_error_bound(bits, group_size, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n + bits)) * 3
    if n > 4:
        x[4] = 0.0
    q, scales = ref.quantize(x, bits, group_size)
    groups = -(-n // group_size)
    assert q.dtype == torch.uint8 and q.numel() == groups * group_size * bits // 8
    codes, np_scales = _numpy_quantize(x.numpy(), bits, group_size)
    assert np.array_equal(scales.numpy(), np_scales)
    assert np.array_equal(_unpack_codes(q, bits), codes)
    back = ref.dequantize(q, scales, bits, n)
    assert back.shape == (n,) and back.dtype == torch.float32
    # Bound: scale/2 for elements that were not clamped, one scale for clamped ones.
    s = scales.repeat_interleave(group_size)[:n]
    clamped = torch.from_numpy(codes[:n] == 2 ** (bits - 1) - 1) & (x > (2 ** (bits - 1) - 0.5) * s)
    err = (x - back).abs()
    slack = 1e-6 * x.abs()
    assert bool((err[~clamped] <= s[~clamped] / 2 + slack[~clamped]).all())
    assert bool((err[clamped] <= s[clamped] + slack[clamped]).all())


def test_quantize_zero_group_and_clamp():
    x = torch.tensor([0.0, 0.0, 8.0, -8.0, 1.0, 1.0])
    q, scales = ref.quantize(x, 4, 2)
    assert scales.tolist() == [0.0, 1.0, 0.125]
    back = ref.dequantize(q, scales, 4, 6)
    assert back.tolist() == [0.0, 0.0, 7.0, -8.0, 0.875, 0.875]
