"""The previous momentum given as packed signs (``signs=(packed, scales)``, the rows that
``unpack_scaled`` decodes) to the error-feedback kernels and ``adam_apply``: bit for bit the
fp32 path fed with ``unpack_scaled`` of them, for the reference and the C kernels; the
argument errors of the public ops."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn.kernels as K
from fn.kernels import _cpu, _reference


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32)


def _values(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 values over many magnitudes, with +0.0, -0.0 and a denormal among them."""
    x = torch.randn(n, generator=gen) * torch.pow(10.0, torch.randint(-6, 6, (n,), generator=gen))
    for i, special in zip(range(0, n, 5), (0.0, -0.0, -1e-45, 0.0, -0.0), strict=False):
        x[i] = special
    return x


def _momentum_signs(
    n: int, ranks: int, extra_bytes: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ranks`` rows of whole bytes holding at least ``n`` values, scales with a zero."""
    row_bytes = -(-n // (8 * ranks)) + extra_bytes or 1
    packed = torch.randint(0, 256, (ranks, row_bytes), dtype=torch.uint8, generator=gen)
    scales = torch.rand(ranks, generator=gen) * torch.logspace(-3, 2, ranks)
    scales[int(torch.randint(ranks, (), generator=gen))] = 0.0  # values +0.0 and -0.0
    return packed, scales


def _unpack(signs: tuple[torch.Tensor, torch.Tensor], n: int) -> torch.Tensor:
    x = torch.empty(n)
    _reference.unpack_scaled(*signs, x)
    return x


@contextlib.contextmanager
def _threaded(threads: int, chunk: int | None, stream_min: int | None):
    """``threads`` torch threads, C jobs of ``chunk`` elements, non-temporal stores from
    ``stream_min`` bytes on (``None``: unchanged)."""
    previous = torch.get_num_threads(), _cpu._CHUNK, _cpu._STREAM_MIN
    torch.set_num_threads(threads)
    _cpu._CHUNK = previous[1] if chunk is None else chunk
    _cpu._STREAM_MIN = previous[2] if stream_min is None else stream_min
    try:
        yield
    finally:
        torch.set_num_threads(previous[0])
        _cpu._CHUNK, _cpu._STREAM_MIN = previous[1:]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 5000),
    ranks=st.integers(1, 9),
    extra_bytes=st.integers(0, 40),
    pad=st.integers(0, 2100),
    beta=st.sampled_from([0.0, 0.5, 0.9, 0.999]),
    threads=st.sampled_from([1, 2]),
    stream=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_feedback_with_signs_matches_the_unpacked_momentum(
    c_kernels, n, ranks, extra_bytes, pad, beta, threads, stream, seed
):
    """n not a multiple of 8 or of the rows' chunk, rows of one byte (a row change inside every
    32 values) to many, short and full blocks, C jobs cut inside rows, streamed outputs."""
    gen = torch.Generator().manual_seed(seed)
    signs = _momentum_signs(n, ranks, extra_bytes, gen)
    grad, error = _values(n, gen), _values(n + pad, gen)
    x = _unpack(signs, n)
    want_packed, want_scale = _reference.feedback_sign_compress(x, error, grad, beta)
    want_error = torch.empty_like(error)
    _reference.feedback_apply_error(x, error, want_scale, want_error, grad, beta)
    with _threaded(threads, 2048, 0 if stream else None):
        for impl in (_reference, c_kernels):
            packed, scale = impl.feedback_sign_compress(None, error, grad, beta, signs)
            assert torch.equal(packed, want_packed), impl.__name__
            assert torch.equal(_bits(scale), _bits(want_scale)), impl.__name__
            out = torch.full_like(error, float("nan"))
            impl.feedback_apply_error(None, error, scale, out, grad, beta, signs)
            assert torch.equal(_bits(out), _bits(want_error)), impl.__name__
            in_place = error.clone()
            impl.feedback_apply_error(None, in_place, scale, in_place, grad, beta, signs)
            assert torch.equal(_bits(in_place), _bits(want_error)), impl.__name__


def test_feedback_with_signs_through_the_public_ops():
    """The public ops with ``signs`` (the C kernels on the CPU) equal the ``x`` path, also under
    ``torch.compile``; the signs and scales are only read."""
    gen = torch.Generator().manual_seed(0)
    signs = _momentum_signs(3000, 3, 2, gen)
    kept = tuple(t.clone() for t in signs)
    grad, error = _values(3000, gen), _values(3072, gen)
    x = _unpack(signs, 3000)

    def step(x, error, signs):
        packed, scale = K.feedback_sign_compress(x, error, grad=grad, beta=0.9, signs=signs)
        new_error = K.feedback_apply_error(
            x, error, scale, torch.empty_like(error), grad=grad, beta=0.9, signs=signs
        )
        return packed, scale, new_error

    want = step(x, error, None)
    for got in (step(None, error, signs), torch.compile(step, fullgraph=True)(None, error, signs)):
        assert torch.equal(got[0], want[0])
        assert torch.equal(_bits(got[1]), _bits(want[1]))
        assert torch.equal(_bits(got[2]), _bits(want[2]))
    assert all(torch.equal(a, b) for a, b in zip(signs, kept, strict=True))


def test_feedback_with_signs_argument_errors():
    packed, scales = torch.zeros(2, 1, dtype=torch.uint8), torch.ones(2)
    error, grad, x = torch.zeros(16), torch.zeros(10), torch.zeros(10)
    bad = {
        "not both": dict(x=x, grad=grad, signs=(packed, scales)),
        "x is required": dict(x=None, grad=grad),
        "signs need grad": dict(x=None, grad=None, signs=(packed, scales)),
        "signs must be a": dict(x=None, grad=grad, signs=[packed, scales]),
        "signs must be a 2-D uint8": dict(x=None, grad=grad, signs=(packed.view(-1), scales)),
        "2-D uint8 tensor": dict(x=None, grad=grad, signs=(packed.float(), scales)),
        "weights must have shape": dict(x=None, grad=grad, signs=(packed, torch.ones(3))),
        "scales must be fp32": dict(x=None, grad=grad, signs=(packed, scales.double())),
        "signs must hold grad's 17 values, got 16": dict(
            x=None, grad=torch.zeros(17), signs=(packed, scales)
        ),
        "grad must be a 1-D": dict(x=None, grad=grad.view(2, 5), signs=(packed, scales)),
        "more than error": dict(
            x=None, grad=torch.zeros(17), signs=(torch.zeros(3, 1, dtype=torch.uint8), grad[:3])
        ),
    }
    before = error.clone()
    for match, kwargs in bad.items():
        x_arg = kwargs.pop("x")
        with pytest.raises(ValueError, match=match):
            K.feedback_sign_compress(x_arg, error, beta=0.9, **kwargs)
        with pytest.raises(ValueError, match=match):
            K.feedback_apply_error(x_arg, error, torch.tensor(1.0), error, beta=0.9, **kwargs)
    assert torch.equal(error, before)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 3000),
    ranks=st.integers(1, 6),
    extra_bytes=st.integers(0, 20),
    bound=st.sampled_from([None, 7.27]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_adam_apply_without_m_matches_the_written_momentum(
    c_kernels, n, ranks, extra_bytes, bound, weight_decay, threads, seed
):
    """``m=None``: the params of the call that writes ``m`` from the signs, bit for bit, and
    nothing else written."""
    gen = torch.Generator().manual_seed(seed)
    signs = _momentum_signs(n, ranks, extra_bytes, gen)
    p, v = _values(n, gen), _values(n, gen).square()
    eta = torch.tensor(3e-4)
    want_m, want = torch.empty(n), p.clone()
    _reference.adam_apply(want_m, v, eta, want, None, 1e-8, bound, weight_decay, signs)
    with _threaded(threads, 1024, None):
        for impl in (_reference, c_kernels):
            got, v_before = p.clone(), v.clone()
            impl.adam_apply(None, v, eta, got, None, 1e-8, bound, weight_decay, signs)
            assert torch.equal(_bits(got), _bits(want)), impl.__name__
            assert torch.equal(_bits(v), _bits(v_before)), impl.__name__


def test_public_adam_apply_without_m():
    packed = torch.tensor([[0b10100000], [0b11111111]], dtype=torch.uint8)
    p, v = torch.ones(2, 4), torch.ones(2, 4)
    out = K.adam_apply(None, v, torch.tensor(0.5), p, eps=0.0, signs=(packed, torch.ones(2)))
    assert out is p and p.flatten().tolist() == [0.5, 1.5, 0.5, 1.5, 1.5, 1.5, 1.5, 1.5]
    with pytest.raises(ValueError, match="m is required unless"):
        K.adam_apply(None, v, torch.tensor(0.5), p, eps=0.0)
    with pytest.raises(ValueError, match="adam_apply: scales must be fp32"):
        K.adam_apply(None, v, torch.tensor(0.5), p, eps=0.0, signs=(packed, torch.ones(2).half()))
    assert p.flatten().tolist() == [0.5, 1.5, 0.5, 1.5, 1.5, 1.5, 1.5, 1.5]
