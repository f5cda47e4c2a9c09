"""The Triton kernels without a GPU.

- Under ``TRITON_INTERPRET=1`` (CPU tensors): every kernel against the reference, bit for bit,
  for fp32/fp16/bf16, edge values and strided inputs; the fp64-free sign kernel and its fp64
  emulation against IEEE fp64.
- Without the interpreter: every kernel compiled ahead of time for sm80, sm90 and gfx942, and
  their index arithmetic checked in the compiled IR (no i32 bound can wrap near 2^31).
- Always: one warning and the reference when Triton's import or a launch fails; every launch
  under its tensor's device.

Run the interpreted part with ``TRITON_INTERPRET=1 python3 -m pytest -q tests/kernels``.
"""

import contextlib
import importlib.util
import os
import re
import sys
import types
import warnings

import numpy as np
import pytest
import torch

from fn.kernels import _reference, _triton

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRETED), reason="needs triton installed and TRITON_INTERPRET=1"
)
compiled = pytest.mark.skipif(
    not HAS_TRITON or INTERPRETED,
    reason="needs triton installed and TRITON_INTERPRET unset (compiles for GPU targets)",
)

_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
_SIZES = [0, 1, 1025, (1 << 16) + 3]  # the interpreter pays per program, not per element


@pytest.fixture
def strict_triton(monkeypatch):
    """Triton on, and a Triton failure raised instead of falling back to the reference."""
    monkeypatch.setattr(_triton, "_FAILURES", [])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fn.kernels: Triton", category=RuntimeWarning)
        yield


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point:
        ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[a.element_size()]
        a, b = a.view(ints), b.view(ints)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _edge_values(n: int, seed: int) -> torch.Tensor:
    """Random values with zeros of both signs, subnormals, huge values, inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 40, (n,), generator=g))
    specials = [0.0, -0.0, 1e-45, -1e-45, 1e-39, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan]
    if n > 100:
        positions = torch.randperm(n, generator=g)[: len(specials)]
        x[positions] = torch.tensor(specials)
    return x


def _finite(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 12, (n,), generator=g))
    if n > 10:
        x[1], x[2], x[3] = 0.0, -0.0, 1e-45
    return x.to(dtype)


@interpreted
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_sign_kernels_bit_exact(strict_triton, dtype):
    for n in _SIZES:
        x = _edge_values(2 * n, n)
        for v in (x[:n].to(dtype), x.to(dtype)[::2]):  # contiguous and strided
            packed = _triton.packbits(v)
            assert _same_bits(packed, _reference.packbits(v)), n
            unpacked = _triton.unpackbits(packed, n, dtype)
            assert _same_bits(unpacked, _reference.unpackbits(packed, n, dtype)), n
            got, want = _triton.sign_compress(v), _reference.sign_compress(v)
            assert _same_bits(got[0], want[0]) and got[2] is None, n
            if torch.isfinite(v).all():
                assert _same_bits(got[1], want[1]), n
            else:  # NaN payloads are not specified; the public op rejects the scale
                assert not torch.isfinite(got[1]) and not torch.isfinite(want[1])
        m, e = _finite(n, n + 1, dtype), _finite(n, n + 2, torch.float32)
        got, want = _triton.sign_compress(m, e), _reference.sign_compress(m, e)
        assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True)), n


@interpreted
@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_kernels_bit_exact(strict_triton, dtype, bits):
    for n in (0, 1, 5, 1000, 10001):
        x = _finite(2 * n, n, dtype)
        for v in (x[:n], x[::2]):
            for group_size in (2, 6, 64, 2048, 8194):  # 8194: three chunks of one group
                q, scales = _triton.quantize(v, bits, group_size)
                want_q, want_scales = _reference.quantize(v, bits, group_size)
                assert _same_bits(q, want_q), (n, group_size)
                assert _same_bits(scales, want_scales), (n, group_size)
                back = _triton.dequantize(q, scales, bits, n)
                assert _same_bits(back, _reference.dequantize(q, scales, bits, n))


@interpreted
def test_quantize_rejects_non_finite_like_the_reference(strict_triton):
    x = torch.tensor([1.0, np.nan, 2.0, 3.0, np.inf, 1.0])
    scales = _triton.quantize(x, 8, 2)[1]
    want = _reference.quantize(x, 8, 2)[1]
    assert torch.equal(torch.isfinite(scales), torch.isfinite(want))
    assert torch.isnan(scales[0]) and torch.isinf(scales[2])


@interpreted
def test_fp64_free_sign_kernel_bit_exact(strict_triton, monkeypatch):
    # few calls: the emulation is slow in the interpreter; test_fp64_emulation_matches_ieee
    # checks its arithmetic on many more values
    monkeypatch.setattr(_triton, "_has_fp64", lambda device: False)
    m = _edge_values((1 << 16) + 3, 5)
    m = m[torch.isfinite(m)]
    got, want = _triton.sign_compress(m), _reference.sign_compress(m)
    assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1])
    m, e = _finite(1025, 6, torch.bfloat16), _finite(1025, 7, torch.float32)
    got, want = _triton.sign_compress(m, e), _reference.sign_compress(m, e)
    assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True))
    inf = _triton.sign_compress(torch.tensor([1.0, np.inf]))[1]
    nan = _triton.sign_compress(torch.tensor([np.nan, np.inf]))[1]
    assert torch.isinf(inf) and torch.isnan(nan)


def _f64_bits(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64).view(np.int64))


@interpreted
def test_fp64_emulation_matches_ieee():
    from tests.kernels import _triton_probes as probes

    rng = np.random.default_rng(0)
    # squares: fp32 bit patterns of every exponent, subnormals, zeros, inf, NaN
    patterns = rng.integers(0, 1 << 32, 1 << 15, dtype=np.uint64).astype(np.uint32)
    patterns[:6] = [0, 0x80000000, 1, 0x7FFFFF, 0x7F800000, 0x7FC00000]
    x = torch.from_numpy(patterns.view(np.float32).copy())
    out = torch.empty(x.numel(), dtype=torch.int64)
    probes.square_f64_probe[(x.numel() // 1024,)](x, out, x.numel(), BLOCK=1024)
    with np.errstate(all="ignore"):
        want = patterns.view(np.float32).astype(np.float64) ** 2
    nan = np.isnan(want)
    assert torch.equal(out[~nan], _f64_bits(want[~nan]))
    assert np.isnan(out.numpy()[nan].view(np.float64)).all()

    # sums of non-negative values: close exponents (rounding, ties, carries) and far ones
    a = np.abs(rng.standard_normal(1 << 15)) * 2.0 ** rng.integers(-300, 300, 1 << 15)
    b = a * 2.0 ** -rng.integers(0, 70, a.size) * rng.uniform(0.5, 2, a.size)
    b[:1000] = np.floor(a[:1000] * 2**20) / 2**72  # many exact ties against 53 bits
    b[1000:1100] = 0.0
    a[1100:1110], b[1100:1110] = np.inf, 1.0
    a[1110:1120], b[1110:1120] = np.nan, np.inf
    a[1120:1130] = np.nextafter(2.0, 0.0)
    b[1120:1130] = 2.0**-53  # a carry into a new exponent after rounding up
    out = torch.empty(a.size, dtype=torch.int64)
    ta, tb = _f64_bits(a), _f64_bits(b)
    probes.add_f64_probe[(a.size // 1024,)](ta, tb, out, a.size, BLOCK=1024)
    want = a + b
    nan = np.isnan(want)
    assert torch.equal(out[~nan], _f64_bits(want[~nan]))
    assert np.isnan(out.numpy()[nan].view(np.float64)).all()
    probes.add_f64_probe[(a.size // 1024,)](tb, ta, out, a.size, BLOCK=1024)  # symmetric
    assert torch.equal(out[~nan], _f64_bits(want[~nan]))


# -- ahead-of-time compilation -------------------------------------------------------------

_TARGETS = [("cuda", 80, 32), ("cuda", 90, 32), ("hip", "gfx942", 64)]


def _variants():
    """(kernel, signature, constexprs) of every launch configuration of fn.kernels._triton."""
    from fn.kernels import _triton_kernels as k

    c = "constexpr"
    sign = {"x_ptr": "*fp32", "bits_ptr": "*u8", "sums_ptr": "*fp64", "n": "i32"}
    sign |= {"nbytes": "i32", "nblocks": "i32", "GROUP": c, "BLOCK": c, "FP64": c}
    quant = {"x_ptr": "*bf16", "q_ptr": "*u8", "scales_ptr": "*fp32", "n": "i32"}
    quant |= {"groups": "i32", "group_size": "i32", "chunks": "i32"}
    quant |= {"ROWS": c, "CHUNK": c, "BITS": c}
    dequant = {"q_ptr": "*u8", "scales_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"}
    dequant |= {"per_group": "i32", "BITS": c, "BLOCK": c}
    block = {"GROUP": _triton._GROUP, "BLOCK": _reference.SUMSQ_BLOCK}
    return {
        "packbits": (
            k.packbits_kernel,
            {"x_ptr": "*bf16", "bits_ptr": "*u8", "n": "i32", "nbytes": "i32", "BYTES": c},
            {"BYTES": _triton._BYTES},
        ),
        "unpackbits": (
            k.unpackbits_kernel,
            {"bits_ptr": "*u8", "out_ptr": "*bf16", "n": "i32", "BLOCK": c},
            {"BLOCK": _triton._UNPACK},
        ),
        "sign": (k.sign_blocks_kernel, sign, {**block, "FP64": True}),
        "sign-fp64-free": (
            k.sign_blocks_kernel,
            {**sign, "x_ptr": "*bf16", "sums_ptr": "*i64"},
            {**block, "FP64": False},
        ),
        "quantize-4": (k.quantize_kernel, quant, {"ROWS": 16, "CHUNK": 256, "BITS": 4}),
        "quantize-8": (k.quantize_kernel, quant, {"ROWS": 1, "CHUNK": 4096, "BITS": 8}),
        "dequantize-4": (k.dequantize_kernel, dequant, {"BITS": 4, "BLOCK": _triton._UNPACK}),
        "dequantize-8": (k.dequantize_kernel, dequant, {"BITS": 8, "BLOCK": _triton._UNPACK}),
    }


_COMPILED = {}


def _compile(variant: str, target: tuple):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    key = (variant, target)
    if key not in _COMPILED:
        kernel, signature, constexprs = _variants()[variant]
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        _COMPILED[key] = triton.compile(source, target=GPUTarget(*target))
    return _COMPILED[key]


def _i32_arguments_not_widened(ttir: str, signature: dict) -> list[str]:
    """The lines using an i32 scalar argument other than by sign-extending it to i64 (or as a
    loop bound): i32 arithmetic on a size could wrap."""
    bad = []
    for name in (a for a, t in signature.items() if t == "i32"):
        use = re.compile(rf"%{name}(?![\w])")
        widen = re.compile(rf"arith\.extsi %{name} : i32 to i64|scf\.for .* to %{name} step")
        for line in ttir.splitlines():
            if "tt.func" not in line and use.search(line) and not widen.search(line):
                bad.append(line.strip())
    return bad


@compiled
@pytest.mark.slow
@pytest.mark.parametrize("variant", list(_variants()) if HAS_TRITON else [])
def test_index_arithmetic_is_int64(variant):
    compiled_kernel = _compile(variant, _TARGETS[0])
    signature = _variants()[variant][1]
    assert _i32_arguments_not_widened(compiled_kernel.asm["ttir"], signature) == []
    if variant == "sign-fp64-free":
        assert "f64" not in compiled_kernel.asm["ttir"]


@compiled
def test_index_check_rejects_an_i32_bound():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.kernels import _triton_probes as probes

    signature = {"x_ptr": "*i32", "n": "i32", "BLOCK": "constexpr"}
    source = ASTSource(fn=probes.i32_bound_kernel, signature=signature, constexprs={"BLOCK": 64})
    ttir = triton.compile(source, target=GPUTarget(*_TARGETS[0])).asm["ttir"]
    assert _i32_arguments_not_widened(ttir, signature)


@compiled
@pytest.mark.slow
@pytest.mark.parametrize("target", _TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
def test_compiles_ahead_of_time(target):
    import triton.backends

    backend = {"cuda": "nvidia", "hip": "amd"}[target[0]]
    if backend not in triton.backends.backends:
        pytest.skip(f"this triton wheel has no {backend} backend")
    binary = {"cuda": "cubin", "hip": "hsaco"}[target[0]]
    for variant in _variants():
        assert len(_compile(variant, target).asm[binary]) > 0, variant


# -- failures and devices (no interpreter needed) ------------------------------------------


class _FailingKernel:
    """A kernel whose compilation fails, as with a broken driver or a wrong Triton build."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.calls.append(grid)
            raise RuntimeError("PTX assembly failed: ptxas fatal error")

        return launch


def _fake_kernel_module(kernel) -> types.SimpleNamespace:
    names = ("packbits", "unpackbits", "sign_blocks", "quantize", "dequantize")
    return types.SimpleNamespace(**{f"{name}_kernel": kernel for name in names})


def _every_kernel_matches_the_reference():
    x = _finite(3000, 1, torch.float32)
    packed = _reference.packbits(x)
    assert _same_bits(_triton.packbits(x), packed)
    assert _same_bits(_triton.unpackbits(packed, 3000), _reference.unpackbits(packed, 3000))
    got, want = _triton.sign_compress(x, x), _reference.sign_compress(x, x)
    assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True))
    q, scales = _triton.quantize(x, 4, 64)
    assert _same_bits(q, _reference.quantize(x, 4, 64)[0])
    assert _same_bits(
        _triton.dequantize(q, scales, 4, 3000), _reference.dequantize(q, scales, 4, 3000)
    )


def test_compile_failure_warns_once_and_runs_the_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(_triton, "_FAILURES", [])
    monkeypatch.setattr(
        _triton, "_import_kernels", lambda: _fake_kernel_module(_FailingKernel(calls))
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _every_kernel_matches_the_reference()
    messages = [str(w.message) for w in caught if "fn.kernels: Triton" in str(w.message)]
    assert len(messages) == 1 and "ptxas fatal error" in messages[0], messages
    assert len(calls) == 1  # no kernel is launched again after the failure


def test_import_failure_warns_once_and_runs_the_reference(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("needs triton installed (its import is made to fail)")
    monkeypatch.setattr(_triton, "_FAILURES", [])
    monkeypatch.delitem(sys.modules, "fn.kernels._triton_kernels", raising=False)
    monkeypatch.setitem(sys.modules, "triton.language", None)  # the import raises
    _triton._import_kernels.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                _every_kernel_matches_the_reference()
    finally:
        _triton._import_kernels.cache_clear()
    messages = [str(w.message) for w in caught if "fn.kernels: Triton" in str(w.message)]
    assert len(messages) == 1 and "import failed" in messages[0], messages


def test_every_launch_runs_under_the_tensors_device(monkeypatch):
    current = ["cuda:0"]
    seen = []

    @contextlib.contextmanager
    def device(d):
        previous, current[0] = current[0], str(d)
        try:
            yield
        finally:
            current[0] = previous

    class RecordingKernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append(current[0])

    fake_cuda = types.SimpleNamespace(device=device)
    monkeypatch.setattr(torch, "get_device_module", lambda device_type: fake_cuda)
    assert _triton._launch(RecordingKernel(), (1,), torch.device("cuda", 1))
    assert seen == ["cuda:1"] and current == ["cuda:0"]

    guarded = []
    monkeypatch.setattr(_triton, "_FAILURES", [])
    monkeypatch.setattr(_triton, "_import_kernels", lambda: _fake_kernel_module(RecordingKernel()))
    monkeypatch.setattr(
        _triton, "_device_guard", lambda d: guarded.append(d) or contextlib.nullcontext()
    )
    x = torch.ones(16)
    _triton.packbits(x)
    _triton.unpackbits(torch.ones(2, dtype=torch.uint8), 16)
    _triton.sign_compress(x)
    _triton.quantize(x, 8, 4)
    _triton.dequantize(torch.ones(16, dtype=torch.uint8), torch.ones(4), 8, 16)
    assert guarded == [x.device] * 5
