"""The accelerator table: records, selection (explicit > FN_ACCELERATOR > detection > cpu),
registration of devices and kernels, overrides. The ``clean_table`` fixture restores it."""

import subprocess
import sys
import types
import warnings

import pytest
import torch

import fn.kernels as K
from fn.kernels import _cpu, _reference, _table

_BUILTIN = ("cpu", "cuda", "xpu", "npu", "hpu", "mps")


def _fake_runtime():
    return types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 2,
        current_device=lambda: 1,
        synchronize=lambda device=None: None,
        empty_cache=lambda: None,
        memory_allocated=lambda device=None: 7,
        max_memory_allocated=lambda device=None: 9,
        manual_seed=lambda seed: None,
    )


def _missing_runtime():
    raise ImportError("fakepkg is not installed")


def test_builtin_records(clean_table):
    assert set(_BUILTIN) <= set(clean_table)
    backends = {name: clean_table[name].communication_backend_name() for name in _BUILTIN}
    assert backends["cpu"] == "gloo" and backends["cuda"] == "nccl"
    assert backends["npu"] == backends["hpu"] == "hccl" and backends["mps"] is None
    assert backends["xpu"] in ("xccl", "ccl")
    cpu = clean_table["cpu"]
    assert cpu.is_available() and cpu.device_count() == 1
    assert cpu.device_name() == "cpu" and cpu.device_name(1) == "cpu:1"
    assert cpu.current_device_name() == "cpu"
    x = torch.ones(3)
    assert cpu.on_accelerator(x) and not clean_table["cuda"].on_accelerator(x)
    assert cpu.pin_memory(x) is x
    assert 0 < cpu.memory_allocated() <= cpu.max_memory_allocated()
    cpu.manual_seed(3)
    a = torch.randn(2)
    cpu.manual_seed(3)
    assert torch.equal(a, torch.randn(2))
    assert clean_table["cuda"].device_name(0) == "cuda:0"


def test_xpu_backend_follows_oneccl_bindings(clean_table, monkeypatch):
    from fn.kernels import _devices

    real = _devices.importlib.util.find_spec
    for present, expected in ((True, "ccl"), (False, "xccl")):
        monkeypatch.setattr(
            _devices.importlib.util,
            "find_spec",
            lambda name, *a, p=present: (
                object() if name == "oneccl_bindings_for_pytorch" and p else real(name, *a)
            ),
        )
        assert clean_table["xpu"].communication_backend_name() == expected


def test_missing_package_means_unavailable(clean_table):
    assert not K.Accelerator("fakedev", _missing_runtime).is_available()
    for name in ("npu", "hpu"):
        if not clean_table[name].is_available():
            with pytest.raises(ImportError):
                clean_table[name].device_count()


def test_detection_default_and_env(clean_table, monkeypatch):
    available = [n for n in ("cuda", "xpu", "npu", "hpu", "mps") if clean_table[n].is_available()]
    assert K.get_accelerator().name == (available[0] if available else "cpu")
    monkeypatch.setenv("FN_ACCELERATOR", "cpu")
    assert K.get_accelerator().name == "cpu"


def test_env_invalid_and_unavailable(clean_table, monkeypatch):
    monkeypatch.setenv("FN_ACCELERATOR", "tpu9")
    with pytest.raises(ValueError, match="unknown accelerator 'tpu9'.*cpu.*cuda"):
        K.get_accelerator()
    missing = [n for n in _BUILTIN if not clean_table[n].is_available()]
    if not missing:
        pytest.skip("every built-in device is available")
    monkeypatch.setenv("FN_ACCELERATOR", missing[0])
    with pytest.raises(ValueError, match=f"'{missing[0]}' is not available.*'cpu'"):
        K.get_accelerator()


def test_set_accelerator_overrides_env(clean_table, monkeypatch):
    record = K.Accelerator("fakedev", _fake_runtime, "fakeccl")
    monkeypatch.setenv("FN_ACCELERATOR", "cpu")
    K.set_accelerator(record)
    chosen = K.get_accelerator()
    assert chosen is record and clean_table["fakedev"] is record
    assert chosen.current_device_name() == "fakedev:1"
    assert chosen.communication_backend_name() == "fakeccl"
    assert chosen.memory_allocated() == 7 and chosen.max_memory_allocated() == 9
    K.set_accelerator(None)
    assert K.get_accelerator().name == "cpu"
    with pytest.raises(ValueError, match="unknown accelerator"):
        K.set_accelerator("nonesuch")
    with pytest.raises(ValueError, match="not available"):
        K.set_accelerator(K.Accelerator("gone", _missing_runtime))
    assert "gone" not in clean_table


def test_registered_device_is_detected_after_builtins(clean_table):
    if any(clean_table[n].is_available() for n in ("cuda", "xpu", "npu", "hpu", "mps")):
        pytest.skip("a built-in accelerator is available and takes precedence")
    impl = lambda x: _reference.packbits(x)  # noqa: E731
    assert (
        K.register_accelerator(K.Accelerator("fakedev", _fake_runtime, kernels={"packbits": impl}))
        is None
    )
    assert K.get_accelerator().name == "fakedev"
    assert _table.kernel("fakedev", "packbits") is impl
    assert _table.kernel("fakedev", "quantize") is _reference.quantize
    with pytest.raises(TypeError):
        K.register_accelerator("fakedev")
    with pytest.raises(ValueError, match="unknown kernel"):
        K.Accelerator("x", _fake_runtime, kernels={"fft": impl})


def test_register_kernel_replaces_one_kernel(clean_table):
    calls = []

    def spy(x):
        calls.append(x.numel())
        return _reference.packbits(x)

    before = dict(clean_table["cpu"].kernels)
    previous = K.register_kernel("cpu", "packbits", spy)
    assert previous is before["packbits"]
    x = torch.randn(20)
    assert torch.equal(K.packbits(x), _reference.packbits(x)) and calls == [20]
    torch.func.vmap(K.packbits)(torch.randn(2, 5))
    assert calls == [20, 5, 5]
    assert clean_table["cpu"].kernels["quantize"] is before["quantize"]
    assert K.register_kernel("cpu", "packbits", None) is spy
    K.packbits(x)
    assert calls == [20, 5, 5]
    with pytest.raises(ValueError, match="unknown kernel"):
        K.register_kernel("cpu", "fft", spy)
    with pytest.raises(ValueError, match="unknown device type"):
        K.register_kernel("tpu9", "packbits", spy)


def test_fn_kernels_reference_override(clean_table, monkeypatch):
    calls = []
    K.register_kernel(
        "cpu", "sign_compress", lambda m, e=None: calls.append(1) or _reference.sign_compress(m, e)
    )
    K.sign_compress(torch.randn(8))
    monkeypatch.setenv("FN_KERNELS", "reference")
    K.sign_compress(torch.randn(8))
    assert calls == [1]
    monkeypatch.setenv("FN_KERNELS", "fastest")
    with pytest.raises(ValueError, match="FN_KERNELS"):
        K.sign_compress(torch.randn(8))


def test_table_is_restored_between_tests():
    assert set(_table._TABLE) == set(_BUILTIN) and _table._SELECTED is None
    assert _table._TABLE["cpu"].kernels["packbits"] is _cpu.packbits


def test_cpu_kernels_fall_back_without_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    _cpu.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="not found"):
            assert _cpu.library() is None
        x = torch.randn(100)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once only
            assert torch.equal(_cpu.sign_compress(x)[1], _reference.sign_compress(x)[1])
    finally:
        _cpu.library.cache_clear()


def test_cpu_kernels_built_into_fn_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FN_CACHE_DIR", str(tmp_path))
    _cpu.library.cache_clear()
    try:
        if _cpu.library() is None:
            pytest.skip("no working C compiler")
        assert [p.suffix for p in tmp_path.iterdir()] == [".so"]
    finally:
        _cpu.library.cache_clear()


@pytest.mark.timeout(120)
def test_import_does_not_touch_optional_packages():
    code = (
        "import sys, fn, fn.kernels as K; K.get_accelerator();"
        "bad = [m for m in ('torch_npu', 'habana_frameworks', 'triton', 'cupy',"
        " 'intel_extension_for_pytorch', 'oneccl_bindings_for_pytorch') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
