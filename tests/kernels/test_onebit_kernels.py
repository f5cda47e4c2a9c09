"""The allocation-free 1-bit kernels: the C kernels against the reference, and the reference
against the pure path it replaces (sign_compress of a padded copy, torch's sum of unpacked
signs, onebit_adam's update expression), bit for bit; the public ops under vmap and compile."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn.kernels as K
from fn.kernels import _cpu, _reference, _table
from fn.transforms._leafwise import moving_average

NEW_KERNELS = (
    "feedback_sign_compress",
    "feedback_apply_error",
    "sign_sum_compress",
    "sign_sum_apply_error",
    "unpack_scaled",
    "adam_direction",
)


def _values(n: int, seed: int, special: bool = True) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x *= torch.logspace(-3, 3, n) if n else 1.0
    if special and n >= 4:
        x[0], x[1], x[2] = 0.0, -0.0, 1e-30
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 5000),
    pad=st.integers(0, 2100),
    momentum=st.booleans(),
    beta=st.sampled_from([0.0, 0.5, 0.9, 0.999]),
    seed=st.integers(0, 2**16),
)
def test_feedback_matches_the_padded_pure_path(c_kernels, n, pad, momentum, beta, seed):
    x, error = _values(n, seed), _values(n + pad, seed + 1)
    grad = _values(n, seed + 2) if momentum else None
    source = moving_average(x, beta, grad) if momentum else x
    padded = torch.nn.functional.pad(source, (0, pad))
    want_packed, want_scale, want_error = _reference.sign_compress(padded, error)
    for impl in (_reference, c_kernels):
        packed, scale = impl.feedback_sign_compress(x, error, grad, beta)
        assert torch.equal(packed, want_packed) and torch.equal(_bits(scale), _bits(want_scale))
        out = torch.full_like(error, float("nan"))
        impl.feedback_apply_error(x, error, scale, out, grad, beta)
        assert torch.equal(_bits(out), _bits(want_error))
        in_place = error.clone()
        impl.feedback_apply_error(x, in_place, scale, in_place, grad, beta)
        assert torch.equal(_bits(in_place), _bits(want_error))


def _pure_server_sum(signs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The pure path's server reduction, as compressed_allreduce computes it."""
    ranks, chunk = signs.shape[0], signs.shape[1] * 8
    unpacked = K.unpackbits(signs.reshape(-1), ranks * chunk).view(ranks, chunk)
    return K.sum_ranks(unpacked.mul_((scales / ranks)[:, None]))


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=40, deadline=None)
@given(
    ranks=st.sampled_from([1, 2, 3, 4, 5, 8, 16, 17, 18, 31, 33, 64, 100]),
    chunk_bytes=st.sampled_from([1, 2, 3, 4, 5, 17, 128, 129, 1000, 4097]),
    seed=st.integers(0, 2**16),
)
def test_sign_sum_adds_in_rank_order(c_kernels, threads, ranks, chunk_bytes, seed):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 256, (ranks, chunk_bytes), dtype=torch.uint8, generator=gen)
        scales = torch.rand(ranks, generator=gen) * torch.logspace(-4, 4, ranks)
        if ranks > 2:
            scales[1] = 0.0  # -0.0 terms
        error = _values(chunk_bytes * 8, seed)
        v = _pure_server_sum(signs, scales) + error
        want_packed, want_scale, want_error = _reference.sign_compress(v, torch.zeros_like(v))
        want_error = v - torch.where(v >= 0, want_scale, -want_scale)
        weights = scales / ranks
        for impl in (_reference, c_kernels):
            packed, scale = impl.sign_sum_compress(signs, weights, error)
            assert torch.equal(packed, want_packed) and torch.equal(scale, want_scale)
            out = error.clone()
            impl.sign_sum_apply_error(signs, weights, out, scale, out)
            assert torch.equal(_bits(out), _bits(want_error))
    finally:
        torch.set_num_threads(previous)


def test_sign_sum_full_and_short_blocks_agree(c_kernels):
    """A full block (its sums in registers) and a short one (the scalar path) add the ranks in
    the same order: the same values for the same columns."""
    gen = torch.Generator().manual_seed(0)
    ranks = 7
    signs = torch.randint(0, 256, (ranks, 256), dtype=torch.uint8, generator=gen)
    weights = torch.rand(ranks, generator=gen) * torch.logspace(-4, 4, ranks)
    error, scale = _values(2048, 1), torch.tensor(0.5)

    def run(columns: slice) -> tuple[torch.Tensor, torch.Tensor]:
        part = signs[:, columns.start // 8 : columns.stop // 8].contiguous()
        packed, _ = c_kernels.sign_sum_compress(part, weights, error[columns])
        out = torch.empty(columns.stop - columns.start)
        c_kernels.sign_sum_apply_error(part, weights, error[columns], scale, out)
        return packed, out

    packed, out = run(slice(0, 2048))
    short_packed, short_out = run(slice(1024, 1152))
    assert torch.equal(packed[128:144], short_packed)
    assert torch.equal(_bits(out[1024:1152]), _bits(short_out))


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.integers(1, 9),
    chunk_bytes=st.integers(1, 700),
    cut=st.integers(0, 7),
    seed=st.integers(0, 2**16),
)
def test_unpack_scaled_matches_unpack_then_scale(c_kernels, ranks, chunk_bytes, cut, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (ranks, chunk_bytes), dtype=torch.uint8, generator=gen)
    scales = torch.rand(ranks, generator=gen)
    scales[0] = 0.0
    n = max(0, ranks * chunk_bytes * 8 - cut)
    y = K.unpackbits(packed.reshape(-1), ranks * chunk_bytes * 8).view(ranks, -1)
    want = y.mul_(scales[:, None]).reshape(-1)[:n]
    for impl in (_reference, c_kernels):
        out = torch.full((n,), float("nan"))
        impl.unpack_scaled(packed, scales, out)
        assert torch.equal(_bits(out), _bits(want))


def _onebit_adam_update(m, v, p, eta, eps, bound, weight_decay):
    """The expression of onebit_adam's leaf rule, with numpy's fp32 square root (IEEE 754's,
    correctly rounded)."""
    u = m / torch.from_numpy(np.sqrt(v.numpy())).add_(eps)
    if bound is not None:
        u = u.clamp(-bound, bound)
    if weight_decay > 0:
        u = u.add_(weight_decay * p.float())
    return u.mul_(-eta)


def test_sqrt_rn_is_the_correctly_rounded_square_root():
    """fp64 then fp32 against numpy's fp32 sqrt (the hardware's, IEEE 754) on every exponent
    and on the values torch's own CPU sqrt rounds the other way."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800000, (1 << 20,), generator=gen, dtype=torch.int32)
    special = torch.tensor([0.0, -0.0, float("inf"), 1e-45, 1.1754942e-38, 3.4028235e38])
    v = torch.cat([bits.view(torch.float32), special])
    want = torch.from_numpy(np.sqrt(v.numpy()))
    assert torch.equal(_bits(_reference.sqrt_rn(v)), _bits(want))
    assert torch.isnan(_reference.sqrt_rn(torch.tensor([float("nan"), -1.0]))).all()


def _nan_or_equal_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bits wherever ``want`` is a number, NaN wherever it is NaN (payloads unpromised)."""
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(_bits(got[~nan]), _bits(want[~nan]))


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 70_000), shift=st.integers(0, 15), seed=st.integers(0, 2**16))
def test_sqrt_rn_kernel_matches_the_reference(c_kernels, threads, n, shift, seed):
    """Every fp32 bit pattern (subnormals, infinities, negatives, NaN), vector bodies and tails,
    inputs off alignment, threaded chunks."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randint(-(2**31), 2**31, (n + shift,), generator=gen, dtype=torch.int64)
    v = v.to(torch.int32).view(torch.float32)[shift:]
    previous = torch.get_num_threads(), c_kernels._CHUNK
    torch.set_num_threads(threads)
    c_kernels._CHUNK = 4096  # several chunks per call
    try:
        got = c_kernels.sqrt_rn(v)
    finally:
        torch.set_num_threads(previous[0])
        c_kernels._CHUNK = previous[1]
    assert got.shape == v.shape and (n == 0 or got.data_ptr() != v.data_ptr())
    assert _nan_or_equal_bits(got, _reference.sqrt_rn(v))


def test_sqrt_rn_op_keeps_shapes_dtypes_and_runs_under_vmap_and_compile():
    v = torch.rand(3, 5, 7) * 100
    want = _reference.sqrt_rn(v)
    assert torch.equal(K.sqrt_rn(v), want)
    assert torch.equal(K.sqrt_rn(v.transpose(0, 2)), want.transpose(0, 2))  # not contiguous
    assert torch.equal(torch.func.vmap(K.sqrt_rn, in_dims=1)(v), want.transpose(0, 1))
    compiled = torch.compile(lambda x: K.sqrt_rn(x) + 1.0, fullgraph=True)
    assert torch.equal(compiled(v), want + 1.0)
    half = v.to(torch.bfloat16)
    assert K.sqrt_rn(half).dtype == torch.bfloat16 and torch.equal(K.sqrt_rn(half), half.sqrt())
    assert _table.kernel("cpu", "sqrt_rn") is _cpu.sqrt_rn


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 3000),
    bound=st.sampled_from([None, 7.27, float("inf")]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    seed=st.integers(0, 2**16),
)
def test_adam_direction_matches_onebit_adam(c_kernels, n, bound, weight_decay, seed):
    m, p = _values(n, seed), _values(n, seed + 1)
    v = _values(n, seed + 2).square()
    if n > 5:
        v[3] = 0.0
        m[4] = float("nan")
    eta = torch.tensor(3e-4)
    want = _onebit_adam_update(m, v, p, eta, 1e-8, bound, weight_decay)
    for impl in (_reference, c_kernels):
        out = torch.empty(n)
        impl.adam_direction(m, v, p if weight_decay else None, eta, out, 1e-8, bound, weight_decay)
        assert torch.equal(_bits(out), _bits(want))


@contextlib.contextmanager
def _stream_min(nbytes: int):
    """Outputs from ``nbytes`` on are written with non-temporal stores, in this block."""
    previous = _cpu._STREAM_MIN
    _cpu._STREAM_MIN = nbytes
    try:
        yield
    finally:
        _cpu._STREAM_MIN = previous


def _buffer(n: int, shift: int) -> torch.Tensor:
    """A NaN-filled fp32[n] starting ``shift`` elements after a 64-byte aligned allocation."""
    return torch.full((n + shift,), float("nan"))[shift:]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 5000),
    pad=st.integers(0, 2100),
    momentum=st.booleans(),
    shift=st.sampled_from([0, 1, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_streamed_outputs_match_the_reference(c_kernels, n, pad, momentum, shift, seed):
    x, error = _values(n, seed), _values(n + pad, seed + 1)
    grad = _values(n, seed + 2) if momentum else None
    scale = torch.tensor(0.75)
    ranks = 1 + seed % 5
    packed = torch.randint(0, 256, (ranks, 1 + seed % 300), dtype=torch.uint8)
    scales = torch.rand(ranks)
    weights = scales / ranks
    signs_error = _values(packed.shape[1] * 8, seed + 3)
    want_error = torch.empty_like(error)
    _reference.feedback_apply_error(x, error, scale, want_error, grad, 0.9)
    want_server = torch.empty_like(signs_error)
    _reference.sign_sum_apply_error(packed, weights, signs_error, scale, want_server)
    want_y = torch.empty(packed.numel() * 8)
    _reference.unpack_scaled(packed, scales, want_y)
    with _stream_min(0):
        out = _buffer(error.numel(), shift)
        c_kernels.feedback_apply_error(x, error, scale, out, grad, 0.9)
        assert torch.equal(_bits(out), _bits(want_error))
        out = _buffer(signs_error.numel(), shift)
        c_kernels.sign_sum_apply_error(packed, weights, signs_error, scale, out)
        assert torch.equal(_bits(out), _bits(want_server))
        out = _buffer(want_y.numel(), shift)
        c_kernels.unpack_scaled(packed, scales, out)
        assert torch.equal(_bits(out), _bits(want_y))
        bits = packed.reshape(-1)
        count = max(0, bits.numel() * 8 - seed % 8)
        assert torch.equal(c_kernels.unpackbits(bits, count), _reference.unpackbits(bits, count))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("stream_min", [0, None, 1 << 62])
def test_streamed_outputs_of_threaded_calls(c_kernels, threads, stream_min):
    """Calls of several chunks (threads claim them in turn), below and above the default
    threshold of non-temporal stores (half the last-level cache), forced on and off."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    minimum = _cpu._STREAM_MIN if stream_min is None else stream_min
    try:
        for n in (3 * _cpu._CHUNK + 1000, _cpu._STREAM_MIN // 4 + 5 * _cpu._CHUNK + 8):
            x, grad, error = _values(n, 1), _values(n, 2), _values(n + 24, 3)
            scale = torch.tensor(0.5)
            want = torch.empty_like(error)
            _reference.feedback_apply_error(x, error, scale, want, grad, 0.9)
            packed = _reference.packbits(want).view(4, -1)
            scales = torch.tensor([0.0, 1.0, 2.0, 3.0])
            want_y = torch.empty(packed.numel() * 8)
            _reference.unpack_scaled(packed, scales, want_y)
            with _stream_min(minimum):
                for shift in (0, 1):
                    out = _buffer(error.numel(), shift)
                    c_kernels.feedback_apply_error(x, error, scale, out, grad, 0.9)
                    assert torch.equal(_bits(out), _bits(want)), (n, shift)
                    out = _buffer(want_y.numel(), shift)
                    c_kernels.unpack_scaled(packed, scales, out)
                    assert torch.equal(_bits(out), _bits(want_y)), (n, shift)
                bits = packed.reshape(-1)
                got = c_kernels.unpackbits(bits, n + 21)
                assert torch.equal(got, _reference.unpackbits(bits, n + 21)), n
    finally:
        torch.set_num_threads(previous)


def test_public_ops_write_their_buffers_and_vmap_per_row():
    x, error = torch.randn(3, 10), torch.randn(3, 16)
    packed, scale = torch.func.vmap(K.feedback_sign_compress)(x, error)
    out = torch.empty(3, 16)

    def apply(x, error, scale, out):
        return K.feedback_apply_error(x, error, scale, out)

    torch.func.vmap(apply)(x, error, scale, out)
    for r in range(3):
        p_r, s_r = K.feedback_sign_compress(x[r], error[r])
        assert torch.equal(packed[r], p_r) and torch.equal(scale[r], s_r)
        assert torch.equal(out[r], K.feedback_apply_error(x[r], error[r], s_r, torch.empty(16)))
    with pytest.raises(ValueError, match="out must be batched"):
        torch.func.vmap(apply, in_dims=(0, 0, 0, None))(x, error, scale, torch.empty(16))


def test_public_ops_compile():
    def step(x, error, signs, weights):
        packed, scale = K.feedback_sign_compress(x, error)
        K.feedback_apply_error(x, error, scale, error)
        s_packed, s_scale = K.sign_sum_compress(signs, weights, error[:8])
        y = K.unpack_scaled(s_packed.view(1, 1), s_scale.view(1), torch.empty(8))
        return packed, scale, error, y

    x, error = torch.randn(10), torch.randn(16)
    signs, weights = torch.tensor([[5], [250]], dtype=torch.uint8), torch.tensor([0.5, 2.0])
    want = step(x, error.clone(), signs, weights)
    got = torch.compile(step, fullgraph=True)(x, error.clone(), signs, weights)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_argument_errors():
    with pytest.raises(ValueError, match="more than error"):
        K.feedback_sign_compress(torch.zeros(9), torch.zeros(8))
    with pytest.raises(ValueError, match="grad shape"):
        K.feedback_sign_compress(torch.zeros(4), torch.zeros(8), grad=torch.zeros(5))
    with pytest.raises(ValueError, match="out must be a 1-D fp32, bf16 or fp16 tensor of 8"):
        K.feedback_apply_error(torch.zeros(4), torch.zeros(8), torch.tensor(1.0), torch.zeros(9))
    with pytest.raises(ValueError, match="weights must have shape"):
        K.sign_sum_compress(torch.zeros(2, 1, dtype=torch.uint8), torch.ones(3), torch.zeros(8))
    with pytest.raises(ValueError, match="out must be fp32"):
        K.unpack_scaled(torch.zeros(1, 1, dtype=torch.uint8), torch.ones(1), torch.zeros(9))


@pytest.mark.parametrize("name", NEW_KERNELS)
def test_every_new_kernel_is_in_the_tables(clean_table, name):
    assert _table.kernel("cpu", name) is getattr(_cpu, name)
    on_cuda = _table.kernel("cuda", name)
    if name.startswith("sign_sum"):  # torch's CUDA sum order: the reference runs
        assert on_cuda is getattr(_reference, name)
    else:
        assert on_cuda.__name__ == name and on_cuda is not getattr(_reference, name)


@pytest.fixture(scope="module")
def triton_interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        pytest.skip("Triton on CPU needs triton installed and TRITON_INTERPRET=1")
    from fn.kernels import _triton

    return _triton


@pytest.mark.parametrize("n, pad", [(0, 8), (1, 15), (1000, 24), (3000, 2100), (4096, 0)])
@pytest.mark.parametrize("momentum", [False, True])
def test_triton_interpreted_feedback(triton_interpreted, n, pad, momentum):
    x, error = _values(n, n), _values(n + pad, n + 1)
    grad = _values(n, n + 2) if momentum else None
    want = _reference.feedback_sign_compress(x, error, grad, 0.9)
    got = triton_interpreted.feedback_sign_compress(x, error, grad, 0.9)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    out_want, out_got = torch.empty_like(error), error.clone()
    _reference.feedback_apply_error(x, error, want[1], out_want, grad, 0.9)
    triton_interpreted.feedback_apply_error(x, out_got, got[1], out_got, grad, 0.9)
    assert torch.equal(_bits(out_got), _bits(out_want))


@pytest.mark.parametrize("ranks, chunk_bytes, cut", [(1, 1, 0), (3, 5, 3), (4, 700, 7)])
def test_triton_interpreted_unpack_scaled(triton_interpreted, ranks, chunk_bytes, cut):
    gen = torch.Generator().manual_seed(ranks)
    packed = torch.randint(0, 256, (ranks, chunk_bytes), dtype=torch.uint8, generator=gen)
    scales = torch.rand(ranks, generator=gen)
    scales[0] = 0.0
    n = ranks * chunk_bytes * 8 - cut
    want, got = torch.empty(n), torch.empty(n)
    _reference.unpack_scaled(packed, scales, want)
    triton_interpreted.unpack_scaled(packed, scales, got)
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("bound", [None, 7.27])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_triton_interpreted_adam_direction(triton_interpreted, bound, weight_decay):
    m, p, v = _values(5000, 1), _values(5000, 2), _values(5000, 3).square()
    v[3], m[4] = 0.0, float("nan")
    eta = torch.tensor(3e-4)
    want = _onebit_adam_update(m, v, p, eta, 1e-8, bound, weight_decay)
    out = torch.empty(5000)
    decayed = p if weight_decay else None
    triton_interpreted.adam_direction(m, v, decayed, eta, out, 1e-8, bound, weight_decay)
    assert torch.equal(_bits(out), _bits(want))


def _aot_variants():
    from fn.kernels import _triton
    from fn.kernels import _triton_kernels as k

    c = "constexpr"
    feedback = {"x_ptr": "*fp32", "g_ptr": "*fp32", "e_ptr": "*fp32"}
    signs = {**feedback, "bits_ptr": "*u8", "sums_ptr": "*fp64", "n_valid": "i32"}
    signs |= {"length": "i32", "nbytes": "i32", "nblocks": "i32", "beta": "fp32"}
    signs |= {"one_minus_beta": "fp32", "GROUP": c, "BLOCK": c, "FP64": c, "MOMENTUM": c}
    error = {**feedback, "scale_ptr": "*fp32", "out_ptr": "*fp32", "n_valid": "i32"}
    error |= {"length": "i32", "beta": "fp32", "one_minus_beta": "fp32", "BLOCK": c}
    error |= {"MOMENTUM": c}
    unpack = {"bits_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    unpack |= {"chunk": "i32", "BLOCK": c}
    adam = {"m_ptr": "*fp32", "v_ptr": "*fp32", "p_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    adam |= {"eps": "fp32"}
    adam |= {"bound": "fp32", "weight_decay": "fp32", "neg_eta": "fp32", "BLOCK": c}
    adam |= {"CLAMP": c, "DECAY": c}
    block = {"GROUP": _triton._GROUP, "BLOCK": _reference.SUMSQ_BLOCK}
    return {
        "feedback-signs": (
            k.feedback_blocks_kernel,
            signs,
            {**block, "FP64": True, "MOMENTUM": True},
        ),
        "feedback-signs-fp64-free": (
            k.feedback_blocks_kernel,
            {**signs, "sums_ptr": "*i64"},
            {**block, "FP64": False, "MOMENTUM": False},
        ),
        "feedback-error": (
            k.feedback_error_kernel,
            error,
            {"BLOCK": _triton._UNPACK, "MOMENTUM": True},
        ),
        "unpack-scaled": (k.unpack_scaled_kernel, unpack, {"BLOCK": _triton._UNPACK}),
        "adam-direction": (
            k.adam_direction_kernel,
            adam,
            {"BLOCK": _triton._UNPACK, "CLAMP": True, "DECAY": True},
        ),
    }


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs triton installed and TRITON_INTERPRET unset (compiles for GPU targets)",
)
@pytest.mark.parametrize(
    "variant",
    [
        "feedback-signs",
        "feedback-signs-fp64-free",
        "feedback-error",
        "unpack-scaled",
        "adam-direction",
    ],
)
def test_triton_kernels_compile_for_cuda(variant):
    import triton
    import triton.backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton wheel has no nvidia backend")
    kernel, signature, constexprs = _aot_variants()[variant]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}
    )
    assert len(compiled.asm["cubin"]) > 0
    if variant == "feedback-signs-fp64-free":
        assert "f64" not in compiled.asm["ttir"]
