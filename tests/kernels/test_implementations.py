"""Every (device, implementation) pair against the CPU reference, bit for bit.

Pairs that cannot run here are skipped with the reason. The reference is device-independent
(only IEEE elementwise operations decide its bits), so device results are compared with the
CPU reference.
"""

import importlib.util
import os

import pytest
import torch

from fn.kernels import _cpu, _reference, _table

_SIZES = [0, 1, 7, 8, 9, 63, 1023, 1024, 1025, 4097, 70001]


def _table_impls(device: str):
    return lambda name: _table.kernel(device, name)


def _cpu_c(name):
    if _cpu.library() is None:
        pytest.skip("no working C compiler: the CPU kernels fall back to the reference")
    return getattr(_cpu, name)


def _triton_interpreted(name):
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        pytest.skip("Triton on CPU needs triton installed and TRITON_INTERPRET=1")
    from fn.kernels import _triton

    return getattr(_triton, name)


def _device_available(device: str) -> bool:
    return _table._TABLE[device].is_available()


PAIRS = [
    pytest.param("cpu", lambda name: getattr(_reference, name), id="cpu-reference"),
    pytest.param("cpu", _cpu_c, id="cpu-c"),
    pytest.param("cpu", _triton_interpreted, id="cpu-triton-interpreter"),
    *[
        pytest.param(
            device,
            _table_impls(device),
            id=f"{device}-table",
            marks=pytest.mark.skipif(
                not _device_available(device), reason=f"no {device} device on this machine"
            ),
        )
        for device in ("cuda", "xpu", "npu", "hpu", "mps")
    ],
    *[
        pytest.param(
            device,
            lambda name: getattr(_reference, name),
            id=f"{device}-reference",
            marks=pytest.mark.skipif(
                not _device_available(device), reason=f"no {device} device on this machine"
            ),
        )
        for device in ("cuda", "xpu", "npu", "hpu", "mps")
    ],
]


def _inputs(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if n > 10:
        x[::7] *= 1e-30
        x[::11] *= 1e25
        x[3] = -0.0
        x[5] = 0.0
        x[9] = -1e-45
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("device, impls", PAIRS)
def test_sign_kernels_bit_exact(device, impls):
    packbits, unpackbits, sign_compress = (
        impls(name) for name in ("packbits", "unpackbits", "sign_compress")
    )
    for n in _SIZES:
        m, e = _inputs(n, n), _inputs(n, n + 1)
        special = [torch.zeros(n), torch.full((n,), -0.0), -torch.rand(n) - 1]
        for x in (m, *special):
            bits = packbits(x.to(device))
            assert _same_bits(bits, _reference.packbits(x)), n
            assert _same_bits(unpackbits(bits, n), _reference.unpackbits(bits.cpu(), n)), n
            got = sign_compress(x.to(device))
            want = _reference.sign_compress(x)
            assert got[2] is None
            assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1]), n
        for m_dtype in (torch.float32, torch.bfloat16):
            got = sign_compress(m.to(device, m_dtype), e.to(device))
            want = _reference.sign_compress(m.to(m_dtype), e)
            assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True)), (n, m_dtype)


@pytest.mark.parametrize("device, impls", PAIRS)
def test_quantize_kernels_bit_exact(device, impls):
    quantize, dequantize = impls("quantize"), impls("dequantize")
    for n in _SIZES:
        x = _inputs(n, n + 2)
        for bits in (4, 8):
            for group_size in (2, 6, 128, 2048):
                q, scales = quantize(x.to(device), bits, group_size)
                want_q, want_scales = _reference.quantize(x, bits, group_size)
                assert _same_bits(q, want_q) and _same_bits(scales, want_scales), (n, bits)
                back = dequantize(q, scales, bits, n)
                assert _same_bits(back, _reference.dequantize(want_q, want_scales, bits, n))


@pytest.mark.parametrize("device, impls", PAIRS)
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_any_codes_and_group_sizes_bit_exact(device, impls, bits):
    # Every code, and groups of odd size (a group may start on a low nibble), which quantize
    # never makes but dequantize accepts.
    gen = torch.Generator().manual_seed(11)
    for group_size, groups in ((3, 10), (5, 2), (7, 4), (6, 5), (256, 1)):
        values = group_size * groups
        q = torch.randint(0, 256, (values * bits // 8,), dtype=torch.uint8, generator=gen)
        q[:16] = (torch.arange(16, dtype=torch.uint8) * 17)[: q.numel()]  # every nibble
        scales = torch.rand(groups, generator=gen) * 4 - 2
        for n in (values, values - 1, values // 2):
            got = impls("dequantize")(q.to(device), scales.to(device), bits, n)
            want = _reference.dequantize(q, scales, bits, n)
            assert _same_bits(got, want), (group_size, groups, n)


_LARGE = (1 << 21) + 13  # several work chunks (threads on the CPU), outputs >= 8 MiB


@pytest.mark.parametrize("device, impls", PAIRS)
def test_large_sign_kernels_bit_exact(device, impls):
    m, e = _inputs(_LARGE, 7), _inputs(_LARGE, 8)
    got = impls("sign_compress")(m.to(device), e.to(device))
    want = _reference.sign_compress(m, e)
    assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True))
    assert _same_bits(impls("packbits")(m.to(device)), _reference.packbits(m))
    unpacked = impls("unpackbits")(want[0].to(device), _LARGE)
    assert _same_bits(unpacked, _reference.unpackbits(want[0], _LARGE))


@pytest.mark.parametrize("device, impls", PAIRS)
def test_large_quantize_bit_exact(device, impls):
    x = _inputs(_LARGE, 9)
    q, scales = impls("quantize")(x.to(device), 4, 256)
    want_q, want_scales = _reference.quantize(x, 4, 256)
    assert _same_bits(q, want_q) and _same_bits(scales, want_scales)
    back = impls("dequantize")(q, scales, 4, _LARGE)
    assert _same_bits(back, _reference.dequantize(want_q, want_scales, 4, _LARGE))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(ln for ln in f if ln.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        return set()


OLDER_CPUS = pytest.mark.parametrize(
    "march, needs", [("haswell", {"avx2", "fma"}), ("x86-64", set())], ids=["avx2", "generic"]
)


def use_c_kernels_built_for(march: str, needs: set[str], tmp_path, monkeypatch) -> None:
    """Makes ``_cpu.library()`` the C source built with ``-march=march`` (skips the test where
    no compiler works or that code cannot run here)."""
    if _cpu.library() is None:
        pytest.skip("no working C compiler")
    flags = _cpu_flags()
    if "avx2" not in flags or not needs <= flags:
        pytest.skip(f"-march={march} code does not run on this CPU (x86-64 with AVX2 needed)")
    out = tmp_path / "kernels.so"
    _cpu._compile(
        os.environ.get("CC", "cc"),
        out,
        tuple(f"-march={march}" if f.startswith("-march") else f for f in _cpu._FLAGS),
    )
    lib = _cpu._load(out)
    monkeypatch.setattr(_cpu, "library", lambda: lib)


@OLDER_CPUS
def test_other_c_code_paths_bit_exact(march, needs, tmp_path, monkeypatch):
    """The AVX2 and plain-C branches of the C source, built for an older CPU."""
    use_c_kernels_built_for(march, needs, tmp_path, monkeypatch)
    for n in (*_SIZES, _LARGE):
        m, e = _inputs(n, n + 3), _inputs(n, n + 4)
        got, want = _cpu.sign_compress(m, e), _reference.sign_compress(m, e)
        assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True)), n
        assert _same_bits(_cpu.sign_compress(m)[1], _reference.sign_compress(m)[1]), n
        assert _same_bits(_cpu.packbits(m), _reference.packbits(m)), n
        v = m.square()
        assert _same_bits(_cpu.sqrt_rn(v), _reference.sqrt_rn(v)), n
        q, scales = _cpu.quantize(m, 8, 6)
        want_q, want_scales = _reference.quantize(m, 8, 6)
        assert _same_bits(q, want_q) and _same_bits(scales, want_scales), n
