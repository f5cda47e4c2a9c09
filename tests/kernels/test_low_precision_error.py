"""The error of the feedback ops (worker and server) stored in bf16 (or fp16): read as fp32, the
new error computed in fp32 and rounded once to ``out``'s dtype, bit for bit the fp32 path then
``.to(dtype)``, for the reference and the C kernels (which read and write fp32 and bf16)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn.kernels as K
from fn.kernels import _cpu, _reference


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _values(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 values over many magnitudes, with +0.0, -0.0 and a denormal among them."""
    x = torch.randn(n, generator=gen) * torch.pow(10.0, torch.randint(-6, 6, (n,), generator=gen))
    for i, special in zip(range(0, n, 5), (0.0, -0.0, -1e-45, 0.0, -0.0), strict=False):
        x[i] = special
    return x


@contextlib.contextmanager
def _threads(threads: int):
    previous = torch.get_num_threads(), _cpu._CHUNK
    torch.set_num_threads(threads)
    _cpu._CHUNK = 2048  # C jobs of two blocks
    try:
        yield
    finally:
        torch.set_num_threads(previous[0])
        _cpu._CHUNK = previous[1]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 5000),
    pad=st.integers(0, 2100),
    source=st.sampled_from(["x", "momentum", "signs"]),
    error_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_feedback_with_a_low_precision_error_rounds_once(
    c_kernels, n, pad, source, error_dtype, out_dtype, threads, seed
):
    gen = torch.Generator().manual_seed(seed)
    error = _values(n + pad, gen).to(error_dtype)
    grad = None if source == "x" else _values(n, gen)
    x, signs = _values(n, gen), None
    if source == "signs":
        packed = torch.randint(0, 256, (3, -(-n // 24) or 1), dtype=torch.uint8, generator=gen)
        signs, x = (packed, torch.rand(3, generator=gen)), None
    args = (grad, 0.9, signs)
    want_packed, want_scale = _reference.feedback_sign_compress(x, error.float(), *args)
    want = torch.empty(n + pad)
    _reference.feedback_apply_error(x, error.float(), want_scale, want, *args)
    want = want.to(out_dtype)
    with _threads(threads):
        for impl in (_reference, c_kernels):
            packed, scale = impl.feedback_sign_compress(x, error, *args)
            assert torch.equal(packed, want_packed), impl.__name__
            assert torch.equal(_bits(scale), _bits(want_scale)), impl.__name__
            out = torch.full((n + pad,), float("nan"), dtype=out_dtype)
            impl.feedback_apply_error(x, error, scale, out, *args)
            assert torch.equal(_bits(out), _bits(want)), impl.__name__
            if out_dtype == error_dtype:
                in_place = error.clone()
                impl.feedback_apply_error(x, in_place, scale, in_place, *args)
                assert torch.equal(_bits(in_place), _bits(want)), impl.__name__


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.integers(1, 9),
    chunk_bytes=st.integers(1, 600),
    error_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    out_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_server_error_in_low_precision_rounds_once(
    c_kernels, ranks, chunk_bytes, error_dtype, out_dtype, threads, seed
):
    """The server's phases (``sign_sum_compress`` / ``sign_sum_apply_error``) likewise."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 256, (ranks, chunk_bytes), dtype=torch.uint8, generator=gen)
    weights = torch.rand(ranks, generator=gen) * torch.logspace(-3, 3, ranks)
    error = _values(8 * chunk_bytes, gen).to(error_dtype)
    want_packed, want_scale = _reference.sign_sum_compress(signs, weights, error.float())
    want = torch.empty(8 * chunk_bytes)
    _reference.sign_sum_apply_error(signs, weights, error.float(), want_scale, want)
    want = want.to(out_dtype)
    with _threads(threads):
        for impl in (_reference, c_kernels):
            packed, scale = impl.sign_sum_compress(signs, weights, error)
            assert torch.equal(packed, want_packed), impl.__name__
            assert torch.equal(_bits(scale), _bits(want_scale)), impl.__name__
            out = torch.full((8 * chunk_bytes,), float("nan"), dtype=out_dtype)
            impl.sign_sum_apply_error(signs, weights, error, scale, out)
            assert torch.equal(_bits(out), _bits(want)), impl.__name__


def test_bf16_rounding_of_the_c_kernel_is_torchs():
    """Ties to even, values that round up to the next binade and to infinity, and subnormals:
    the new error of an all-zero source with scale 0 is the error itself, rounded to bf16."""
    if _cpu.library() is None:
        pytest.skip("no working C compiler: the CPU kernels fall back to the reference")
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3FFFFFFF, 0x7F7FFFFF, 0x7F7F7FFF, 0x00008000,
         0x00018000, 0x80008001, 0xBF808001],
        dtype=torch.int64,
    ).to(torch.int32)  # fmt: skip
    values = bits.view(torch.float32).repeat(205)[:2048]  # full blocks and a short one
    error = torch.cat([values, values[:5]])
    out = torch.empty(error.numel(), dtype=torch.bfloat16)
    _cpu.feedback_apply_error(torch.zeros(0), error, torch.tensor(0.0), out)
    assert torch.equal(_bits(out), _bits(error.to(torch.bfloat16)))


def test_error_dtype_errors():
    with pytest.raises(ValueError, match="error must be a 1-D fp32, bf16 or fp16 tensor"):
        K.feedback_sign_compress(torch.zeros(4), torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be a 1-D fp32, bf16 or fp16 tensor of 8"):
        K.feedback_apply_error(
            torch.zeros(4), torch.zeros(8), torch.tensor(1.0), torch.zeros(8, dtype=torch.int32)
        )
    signs, weights = torch.zeros(1, 1, dtype=torch.uint8), torch.ones(1)
    with pytest.raises(ValueError, match="error must be a 1-D fp32, bf16 or fp16 tensor of 8"):
        K.sign_sum_compress(signs, weights, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be a 1-D fp32, bf16 or fp16 tensor of 8"):
        K.sign_sum_apply_error(signs, weights, torch.zeros(8), torch.tensor(1.0), torch.zeros(9))
    error = torch.zeros(8, dtype=torch.bfloat16)
    out = K.feedback_apply_error(torch.ones(4), error, torch.tensor(1.0), error)
    assert out is error and out.tolist() == [0.0] * 4 + [-1.0] * 4
