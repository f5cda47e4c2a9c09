"""The public kernels: dispatch, input checks, non-finite policy, vmap and torch.compile."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounter

import fn.kernels as K
from fn.kernels import _reference


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 200_000), st.integers(0, 2**31))
def test_roundtrip_random_large(n, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    bits = K.packbits(x)
    assert np.array_equal(bits.numpy(), np.packbits(x.numpy() >= 0))
    assert torch.equal(K.unpackbits(bits, n), torch.where(x >= 0, 1.0, -1.0))
    assert K.unpackbits(bits, n, torch.bfloat16).dtype == torch.bfloat16


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, width=32), max_size=600),
    st.sampled_from([4, 8]),
    st.sampled_from([2, 4, 10, 64]),
)
def test_quantize_error_bound(values, bits, group_size):
    x = torch.tensor(values, dtype=torch.float32)
    q, scales = K.quantize(x, bits, group_size)
    back = K.dequantize(q, scales, bits, len(values))
    s = scales.repeat_interleave(group_size)[: len(values)]
    top = 2 ** (bits - 1)
    clamped = x > (top - 0.5) * s  # rounds to +2^(b-1), one above the largest code
    err = (x - back).abs()
    # Relative fp32 rounding, plus the documented underflow of absmax / 2^(b-1) for subnormals.
    slack = 1e-6 * x.abs() + top * 2.0**-149
    assert bool((err[~clamped] <= s[~clamped] / 2 + slack[~clamped]).all())
    assert bool((err[clamped] <= s[clamped] + slack[clamped]).all())
    assert bool((back.abs() <= x.abs() + s / 2 + slack).all())


@pytest.mark.parametrize("n", range(71))
def test_public_roundtrip_every_short_length(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(100 + n))
    bits = K.packbits(x)
    assert np.array_equal(bits.numpy(), np.packbits(x.numpy() >= 0))
    assert torch.equal(K.unpackbits(bits, n), torch.where(x >= 0, 1.0, -1.0))
    q, scales = K.quantize(x, 4, 8)
    assert torch.equal(K.dequantize(q, scales, 4, n), _reference.dequantize(q, scales, 4, n))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(bad):
    m = torch.randn(50)
    m[17] = bad
    with pytest.raises(ValueError, match="non-finite"):
        K.sign_compress(m)
    with pytest.raises(ValueError, match="non-finite"):
        K.sign_compress(torch.randn(50), m)
    with pytest.raises(ValueError, match="non-finite"):
        K.quantize(m, 4, 16)


def test_non_finite_raises_under_vmap_and_compile():
    m = torch.randn(3, 40)
    m[1, 5] = float("nan")
    e = torch.zeros(3, 40)
    with pytest.raises(ValueError, match="non-finite"):
        torch.func.vmap(K.sign_compress)(m, e)
    with pytest.raises(ValueError, match="non-finite"):
        torch.func.vmap(K.sign_compress)(m)
    compiled = torch.compile(K.sign_compress, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="non-finite"):
        compiled(m[1], e[1])


def test_input_checks():
    with pytest.raises(ValueError, match="1-D"):
        K.packbits(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shape"):
        K.sign_compress(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="cannot hold"):
        K.unpackbits(torch.zeros(1, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="bits"):
        K.quantize(torch.zeros(4), 3, 2)
    with pytest.raises(ValueError, match="group_size"):
        K.quantize(torch.zeros(4), 4, 3)
    with pytest.raises(ValueError, match="fit"):
        K.dequantize(torch.zeros(4, dtype=torch.uint8), torch.zeros(3), 4, 8)


def test_empty_inputs():
    packed, scale, err = K.sign_compress(torch.zeros(0), torch.zeros(0))
    assert packed.shape == (0,) and scale.item() == 0.0 and err.shape == (0,)
    q, scales = K.quantize(torch.zeros(0), 4, 8)
    assert q.numel() == 0 and scales.numel() == 0
    assert K.dequantize(q, scales, 4, 0).shape == (0,)


def test_inputs_are_not_modified():
    m, e = torch.randn(3000), torch.randn(3000)
    m0, e0 = m.clone(), e.clone()
    K.sign_compress(m, e)
    K.quantize(m, 8, 64)
    assert torch.equal(m, m0) and torch.equal(e, e0)


def test_vmap_sign_compress_with_error_equals_row_loop():
    g = torch.Generator().manual_seed(0)
    m, e = torch.randn(4, 1500, generator=g), torch.randn(4, 1500, generator=g)
    packed, scale, new_error = torch.func.vmap(K.sign_compress)(m, e)
    assert packed.shape == (4, 188) and scale.shape == (4,) and new_error.shape == (4, 1500)
    for r in range(4):
        row = _reference.sign_compress(m[r], e[r])
        assert torch.equal(packed[r], row[0]) and torch.equal(scale[r], row[1])
        assert torch.equal(new_error[r], row[2])
    # Unbatched error, leading axis elsewhere, and nested vmap.
    _, scale_shared, _ = torch.func.vmap(K.sign_compress, in_dims=(1, None))(m.T, e[0])
    assert torch.equal(scale_shared[2], _reference.sign_compress(m[2], e[0])[1])
    nested = torch.func.vmap(torch.func.vmap(K.sign_compress))(
        m.view(2, 2, 1500), e.view(2, 2, 1500)
    )
    assert torch.equal(nested[2].view(4, 1500), new_error)


def test_vmap_other_kernels_and_empty_batch():
    x = torch.randn(3, 77)
    bits = torch.func.vmap(K.packbits)(x)
    assert all(torch.equal(bits[r], K.packbits(x[r])) for r in range(3))
    signs = torch.func.vmap(K.unpackbits, in_dims=(0, None))(bits, 77)
    assert torch.equal(signs, torch.where(x >= 0, 1.0, -1.0))
    q, scales = torch.func.vmap(lambda v: K.quantize(v, 4, 10))(x)
    back = torch.func.vmap(lambda a, b: K.dequantize(a, b, 4, 77))(q, scales)
    for r in range(3):
        q_r, s_r = _reference.quantize(x[r], 4, 10)
        assert torch.equal(q[r], q_r) and torch.equal(
            back[r], _reference.dequantize(q_r, s_r, 4, 77)
        )
    packed, scale, err = torch.func.vmap(K.sign_compress)(torch.zeros(0, 9), torch.zeros(0, 9))
    assert packed.shape == (0, 2) and scale.shape == (0,) and err.shape == (0, 9)


def _step(m, e):
    packed, scale, new_error = K.sign_compress(m, e)
    return K.unpackbits(packed, m.shape[0]) * scale, new_error


@pytest.mark.parametrize("batched", [False, True])
def test_compile_fullgraph_no_recompile(batched):
    counter = CompileCounter()
    fn = torch.func.vmap(_step) if batched else _step
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    shape = (3, 1000) if batched else (1000,)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        m, e = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        got, want = compiled(m, e), fn(m, e)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert counter.frame_count == 1


def test_compile_aot_quantize_roundtrip():
    def roundtrip(x):
        q, scales = K.quantize(x, 4, 32)
        return K.dequantize(q, scales, 4, x.shape[0])

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    x = torch.randn(300)
    assert torch.equal(compiled(x), roundtrip(x))
    assert torch.equal(compiled(x + 1), roundtrip(x + 1))


def test_compile_changing_lengths():
    def step(m, e):
        packed, scale, new_error = K.sign_compress(m, e)
        q, scales = K.quantize(new_error, 4, 16)
        n = m.shape[0]
        return K.unpackbits(packed, n) * scale, K.dequantize(q, scales, 4, n)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for n in (1000, 2000, 4001):
        m, e = torch.randn(n), torch.randn(n)
        assert all(torch.equal(a, b) for a, b in zip(compiled(m, e), step(m, e), strict=True))
