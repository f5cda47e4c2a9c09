"""Every implementation of every declared kernel against its declared reference, bit for bit.

The pairs come from the declarations (``fn.kernels._spec.REFERENCES``, and each kernel set's
functions named as a kernel): a kernel added to a set is tested here once its arguments have a
maker below. Results and every tensor argument after the call (the outputs written in place)
must equal the reference's bits.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn.kernels as K
from fn.kernels import _cpu, _reference, _spec

Maker = Callable[[int, torch.Generator, int], tuple[Any, ...]]


def _values(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 values over many magnitudes, with signed zeros and a denormal."""
    x = torch.randn(n, generator=gen) * torch.pow(10.0, torch.randint(-6, 6, (n,), generator=gen))
    if n > 9:
        x[1], x[2], x[9] = 0.0, -0.0, -1e-45
    return x


def _signs(ranks: int, nbytes: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (ranks, nbytes), dtype=torch.uint8, generator=gen)


def _weights(ranks: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(ranks, generator=gen) * torch.logspace(-3, 3, ranks)


def _feedback(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    length = n + variant  # x shorter than the error: zero padding
    grad = _values(n, gen) if variant % 2 else None
    x, signs = _values(n, gen), None
    if variant == 3:  # the momentum as the packed signs of two ranks' chunks
        x, signs = None, (_signs(2, -(-n // 16) or 1, gen), _weights(2, gen))
    error = _values(length, gen).to(torch.bfloat16 if variant == 2 else torch.float32)
    return x, error, grad, 0.9 if grad is not None else 0.0, signs


def _feedback_apply(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    x, error, grad, beta, signs = _feedback(n, gen, variant)
    _, scale = _reference.feedback_sign_compress(x, error, grad, beta, signs)
    return x, error, scale, torch.full_like(error, 7.0), grad, beta, signs


def _sign_sum(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    ranks, nbytes = variant + 1, -(-n // 8) or 1
    error = _values(8 * nbytes, gen).to(torch.bfloat16 if variant == 2 else torch.float32)
    return _signs(ranks, nbytes, gen), _weights(ranks, gen), error


def _sign_sum_apply(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    signs, weights, error = _sign_sum(n, gen, variant)
    _, scale = _reference.sign_sum_compress(signs, weights, error)
    return signs, weights, error, scale, torch.full_like(error, 7.0)


def _adam(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    m, v = _values(n, gen), _values(n, gen).square()
    p = _values(n, gen) if variant % 2 else None
    bound = 2.0 if variant >= 2 else None
    return m, v, p, torch.tensor(0.01), torch.empty(n), 1e-8, bound, 0.1 if p is not None else 0.0


def _adam_apply(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    m, v, _, eta, _, eps, bound, _ = _adam(n, gen, variant)
    signs = None
    if variant % 2:
        nbytes = -(-n // 16) or 1  # two ranks' chunks of whole bytes
        signs = (_signs(2, nbytes, gen), _weights(2, gen))
    if variant == 3:  # the momentum read from the signs only
        m = None
    return m, v, eta, _values(n, gen), None, eps, bound, 0.1 * (variant >= 2), signs


def _adamw(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    sizes = [n, variant * 7, 3]
    ps, gs, ms = ([_values(k, gen) for k in sizes] for _ in range(3))
    vs = [_values(k, gen).square() for k in sizes]
    m_outs = [torch.empty(k) for k in sizes] if variant % 2 else ms
    v_outs = [torch.empty(k) for k in sizes] if variant % 2 else vs
    return ps, gs, ms, vs, m_outs, v_outs, 3.0, 1e-3, (0.9, 0.3)[variant % 2], 0.999, 1e-8, 0.01


def _codes(n: int, gen: torch.Generator, variant: int, pieces: int = 1) -> tuple[Any, ...]:
    bits, group_size = (4, 8)[variant % 2], (2, 6, 32, 128)[variant]
    values = pieces * group_size * (-(-n // group_size) or 1)
    q, scales = _reference.quantize(_values(values, gen), bits, group_size)
    return q, scales, bits, values


def _loco(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    bits, group_size, numel = (4, 8)[variant % 2], 8, 8 * (-(-n // 8) or 1)
    error = _values(numel, gen) if variant >= 2 else None
    return _values(n, gen), error, bits, group_size, numel


def _loco_quantize(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    x, error, bits, group_size, numel = _loco(n, gen, variant)
    out = None
    if variant % 2:
        out = (torch.empty(numel * bits // 8, dtype=torch.uint8), torch.empty(numel // group_size))
    return x, error, bits, group_size, numel, out, None


def _loco_error(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    x, error, bits, group_size, numel = _loco(n, gen, variant)
    q, scales = _reference.loco_quantize(x, error, bits, group_size, numel)
    return x, error, q, scales, bits, 0.25, torch.full((numel,), 7.0), None


def _dequantize_sum(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    pieces = variant + 1
    q, scales, bits, values = _codes(n, gen, variant, pieces)
    return q, scales, bits, pieces, torch.full((values // pieces,), 7.0)


def _dequantize_into(n: int, gen: torch.Generator, variant: int) -> tuple[Any, ...]:
    chunks, local = (1, 2, 4, 4)[variant], (1, 1, 2, 4)[variant]
    q, scales, bits, values = _codes(n, gen, variant % 2, chunks)
    return q, scales, bits, torch.full((values - variant,), 7.0), chunks, local


MAKERS: dict[str, Maker] = {
    "packbits": lambda n, gen, variant: (_values(n, gen),),
    "unpackbits": lambda n, gen, variant: (_signs(1, n // 8 + 1, gen).view(-1), n, torch.float32),
    "sign_compress": lambda n, gen, variant: (
        _values(n, gen).to((torch.float32, torch.bfloat16)[variant // 2]),
        _values(n, gen) if variant % 2 else None,
    ),
    "feedback_sign_compress": _feedback,
    "feedback_apply_error": _feedback_apply,
    "sign_sum_compress": _sign_sum,
    "sign_sum_apply_error": _sign_sum_apply,
    "unpack_scaled": lambda n, gen, variant: (
        _signs(variant + 1, n // 8 + 1, gen),
        _weights(variant + 1, gen),
        torch.full(((variant + 1) * (n // 8 + 1) * 8 - variant,), 7.0),
    ),
    "adam_direction": _adam,
    "adam_apply": _adam_apply,
    "adamw_step": _adamw,
    "sqrt_rn": lambda n, gen, variant: (_values(n, gen).abs(),),
    "quantize": lambda n, gen, variant: (
        _values(n, gen),
        (4, 8)[variant % 2],
        (2, 6, 32, 128)[variant],
    ),
    "dequantize": lambda n, gen, variant: _codes(n, gen, variant)[:3] + (n,),
    "loco_quantize": _loco_quantize,
    "loco_error": _loco_error,
    "dequantize_sum": _dequantize_sum,
    "dequantize_into": _dequantize_into,
}


def _c_kernels() -> dict[str, Callable[..., Any]]:
    if _cpu.library() is None:
        pytest.skip("no working C compiler: the CPU kernels fall back to the reference")
    return _spec.implementations(_cpu)


def _triton_kernels() -> dict[str, Callable[..., Any]]:
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        pytest.skip("Triton on CPU needs triton installed and TRITON_INTERPRET=1")
    from fn.kernels import _triton

    return _spec.implementations(_triton)


SETS = {"c": _c_kernels, "triton": _triton_kernels}


def test_every_kernel_has_a_maker_and_a_reference():
    assert set(MAKERS) == set(_spec.REFERENCES) == set(K.KERNEL_NAMES)
    assert all(_spec.REFERENCES[name] is getattr(_reference, name) for name in K.KERNEL_NAMES)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(item) for item in x)
    return x


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    ta, tb = _tensors(a), _tensors(b)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(
            x.view(bits[x.element_size()]) if x.dtype.is_floating_point else x,
            y.view(bits[y.element_size()]) if y.dtype.is_floating_point else y,
        )
        for x, y in zip(ta, tb, strict=True)
    )


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("kernel_set", sorted(SETS))
@settings(max_examples=12, deadline=None)
@given(n=st.integers(0, 2100), seed=st.integers(0, 2**16), variant=st.integers(0, 3))
def test_implementation_matches_its_reference(kernel_set, name, n, seed, variant):
    impl = SETS[kernel_set]().get(name)
    if impl is None:
        pytest.skip(f"the kernel set {kernel_set!r} runs the reference for {name}")
    args = MAKERS[name](n, torch.Generator().manual_seed(seed), variant)
    got_args, want_args = _clone(args), _clone(args)
    got, want = impl(*got_args), _spec.REFERENCES[name](*want_args)
    if want is not None:  # a kernel that writes into its arguments returns nothing of note
        assert _same(got, want)
    assert _same(got_args, want_args)


# The kernels whose reference sums over ranks (fn.kernels.sum_ranks, directly or through
# _reference.sign_sum).
RANK_SUMS = ("sign_sum_compress", "sign_sum_apply_error", "dequantize_sum")


def test_accelerator_kernel_sets_sum_over_ranks_in_rank_order():
    """Only the C kernels have their own sums over ranks (tested above and in
    test_capabilities, bit for bit); every other built-in kernel set (Triton, CuPy, torch_npu)
    runs the reference's, which adds rank by rank as ``sum_ranks`` does. A set that gains its
    own must be added to ``SETS`` above to be tested against the reference."""
    for device_type in ("cuda", "xpu", "npu", "hpu", "mps"):
        record = K.get_accelerator(device_type)
        for kernel_set in record.kernel_set_names():
            for name in RANK_SUMS:
                assert record.kernel(name, kernel_set) is _spec.REFERENCES[name], (
                    device_type,
                    kernel_set,
                    name,
                )


def test_implementation_has_the_reference_signature_and_falls_back_to_it():
    """``_spec.implementation``: the reference's signature, checked when decorating; the
    reference runs where the implementation returns ``None`` or its backend is unavailable."""
    calls = []

    @_spec.implementation(lambda: calls)
    def dequantize(handle, q, scales, bits, n):
        handle.append(n)
        return None if n % 2 else torch.full((n,), 7.0)

    q, scales = K.quantize(torch.arange(8.0), 8, 4)
    assert dequantize(q, scales, 8, 4).tolist() == [7.0] * 4
    assert _same(dequantize(q, scales, 8, 3), _reference.dequantize(q, scales, 8, 3))
    assert calls == [4, 3]
    assert str(inspect.signature(dequantize)) == str(inspect.signature(_reference.dequantize))

    @_spec.implementation(lambda: None)
    def packbits(handle, x):
        raise AssertionError("called without its backend")

    assert _same(
        packbits(torch.tensor([1.0, -1.0])), _reference.packbits(torch.tensor([1.0, -1.0]))
    )
    with pytest.raises(TypeError, match="unpackbits: the parameters are not the reference's"):

        @_spec.implementation()
        def unpackbits(packed, n, dtype=torch.float16):
            return None
