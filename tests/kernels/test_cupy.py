"""The CuPy kernel set: its place in the accelerator table, its glue code run on a CPU stand-in
for CuPy (numpy, whose packbits/unpackbits CuPy mirrors), and on a CUDA device where one
exists."""

import importlib.util
import sys
import types
import warnings

import numpy as np
import pytest
import torch

import fn.kernels as K
from fn.kernels import _cupy, _reference, _spec, _table, _triton


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
        a, b = a.view(ints), b.view(ints)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.fixture
def no_cached_cupy():
    _cupy._cupy.cache_clear()
    yield
    _cupy._cupy.cache_clear()


@pytest.fixture
def numpy_cupy(monkeypatch, no_cached_cupy):
    """``cupy`` replaced by numpy's packbits/unpackbits/from_dlpack, counting the calls."""
    calls = []
    fake = types.ModuleType("cupy")
    fake.from_dlpack = np.from_dlpack
    fake.packbits = lambda a: calls.append("packbits") or np.packbits(a)
    fake.unpackbits = lambda a: calls.append("unpackbits") or np.unpackbits(a)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return calls


def test_cupy_is_a_second_cuda_kernel_set(clean_table, monkeypatch):
    cuda = K.get_accelerator("cuda")
    assert cuda.kernel_set_names() == ("triton", "cupy", "reference")
    assert _table.kernel("cuda", "packbits") is _triton.packbits  # the default set
    monkeypatch.setenv("FN_KERNELS", "cupy")
    assert K.kernel_set("cuda") == "cupy" and K.kernel_set("cpu") == "c"
    assert _table.kernel("cuda", "packbits") is _cupy.packbits
    assert _table.kernel("cuda", "sign_compress") is _cupy.sign_compress
    assert _table.kernel("cuda", "quantize") is _reference.quantize  # not in the set
    monkeypatch.delenv("FN_KERNELS")
    K.select_kernels("cuda", "cupy")
    assert _table.kernel("cuda", "unpackbits") is _cupy.unpackbits
    K.select_kernels("cuda", None)
    assert K.kernel_set("cuda") == "triton"


def test_cupy_kernels_on_a_cpu_stand_in(clean_table, numpy_cupy):
    K.register_kernels("cpu", "cupy", _spec.implementations(_cupy))
    K.select_kernels("cpu", "cupy")
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 8, 9, 1023, 1025, 70001):
        x = torch.randn(n, generator=g)
        if n > 10:
            x[1], x[2], x[3] = 0.0, -0.0, float("nan")
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            v = x.to(dtype)
            packed = K.packbits(v)
            assert _same_bits(packed, _reference.packbits(v)), n
            got = K.unpackbits(packed, n, dtype)
            assert _same_bits(got, _reference.unpackbits(packed, n, dtype)), n
        m, e = torch.randn(n, generator=g), torch.randn(n, generator=g)
        got, want = K.sign_compress(m, e), _reference.sign_compress(m, e)
        assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True)), n
    assert numpy_cupy.count("packbits") == 8 * 4 and numpy_cupy.count("unpackbits") == 8 * 3


def test_missing_cupy_warns_once_and_runs_the_reference(monkeypatch, no_cached_cupy):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    x = torch.randn(100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert _same_bits(_cupy.packbits(x), _reference.packbits(x))
            assert _same_bits(_cupy.sign_compress(x)[1], _reference.sign_compress(x)[1])
    assert [str(w.message)[:31] for w in caught] == ["fn.kernels: CuPy is unavailable"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed")
def test_cupy_kernels_on_cuda():
    g = torch.Generator().manual_seed(1)
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # not the current device
    for n in (0, 1, 9, 1025, (1 << 20) + 3):
        x, e = torch.randn(n, generator=g), torch.randn(n, generator=g)
        packed = _cupy.packbits(x.to(device))
        assert packed.device == device and _same_bits(packed, _reference.packbits(x))
        assert _same_bits(_cupy.unpackbits(packed, n), _reference.unpackbits(packed.cpu(), n))
        got = _cupy.sign_compress(x.to(device), e.to(device))
        want = _reference.sign_compress(x, e)
        assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True)), n
