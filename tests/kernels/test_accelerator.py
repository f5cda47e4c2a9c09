"""The accelerator table: records, the accelerator in use (explicit > FN_ACCELERATOR >
detection > cpu), and dispatch: which kernel set runs for a device type (select_kernels >
FN_KERNELS > the record's default), changed by registering records and kernel sets. The
``clean_table`` fixture restores the table."""

import subprocess
import sys
import warnings

import pytest
import torch

import fn.kernels as K
from fn.kernels import _cpu, _reference, _table

_BUILTIN = ("cpu", "cuda", "xpu", "npu", "hpu", "mps")


def _missing_package():
    raise ImportError("fakepkg is not installed")


def _counting_set(calls):
    """A kernel set that records each call (kernel name, length) and runs the reference."""

    def counted(name):
        def impl(x, *args):
            calls.append((name, x.numel()))
            return getattr(_reference, name)(x, *args)

        return impl

    return {name: counted(name) for name in K.KERNEL_NAMES}


def _run_every_kernel():
    x = torch.randn(20)
    K.packbits(x)
    K.unpackbits(K.packbits(x), 20)
    K.sign_compress(x)
    K.sign_compress(x, torch.zeros(20))
    q, scales = K.quantize(x, 4, 4)
    K.dequantize(q, scales, 4, 20)


_EVERY_KERNEL_CALLS = [
    ("packbits", 20),
    ("packbits", 20),
    ("unpackbits", 3),
    ("sign_compress", 20),
    ("sign_compress", 20),
    ("quantize", 20),
    ("dequantize", 10),
]


def test_builtin_records(clean_table):
    assert set(_BUILTIN) <= set(clean_table)
    backends = {name: clean_table[name].communication_backend_name() for name in _BUILTIN}
    assert backends["cpu"] == "gloo" and backends["cuda"] == "nccl"
    assert backends["npu"] == backends["hpu"] == "hccl" and backends["mps"] is None
    assert backends["xpu"] in ("xccl", "ccl")
    sets = {name: clean_table[name].kernel_set_names() for name in _BUILTIN}
    assert sets == {
        "cpu": ("c", "reference"),
        "cuda": ("triton", "cupy", "reference"),
        "xpu": ("triton", "reference"),
        "npu": ("torch_npu", "reference"),
        "hpu": ("reference",),
        "mps": ("reference",),
    }
    cpu = clean_table["cpu"]
    assert cpu.is_available()
    cpu.synchronize()
    assert cpu.kernel("packbits") is _cpu.packbits
    assert cpu.kernel("packbits", "reference") is _reference.packbits
    assert clean_table["hpu"].kernel("quantize") is _reference.quantize
    with pytest.raises(ValueError, match="unknown kernel set 'nonesuch'.*'c', 'reference'"):
        cpu.kernel("packbits", "nonesuch")
    with pytest.raises(ValueError, match="unknown kernel 'fft'"):
        cpu.kernel("fft")


def test_record_checks_its_kernel_sets():
    with pytest.raises(ValueError, match="unknown kernel names"):
        K.Accelerator("x", lambda: True, kernel_sets={"fast": {"fft": _reference.packbits}})
    with pytest.raises(ValueError, match="implicit"):
        K.Accelerator("x", lambda: True, kernel_sets={"reference": {}})
    kernels = {"packbits": _reference.packbits}
    record = K.Accelerator("x", lambda: True, kernel_sets={"fast": kernels})
    kernels["unpackbits"] = _reference.unpackbits
    assert set(record.kernel_sets["fast"]) == {"packbits"}  # a frozen copy


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
    assert not K.Accelerator("fakedev", _missing_package).is_available()
    for name in ("npu", "hpu"):
        if not clean_table[name].is_available():
            with pytest.raises(ImportError):
                clean_table[name].available()


def test_detection_default_and_env(clean_table, monkeypatch):
    available = [n for n in ("cuda", "xpu", "npu", "hpu", "mps") if clean_table[n].is_available()]
    assert K.get_accelerator().name == (available[0] if available else "cpu")
    monkeypatch.setenv("FN_ACCELERATOR", "cpu")
    assert K.get_accelerator() is clean_table["cpu"]


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
    record = K.Accelerator("fakedev", lambda: True, "fakeccl")
    monkeypatch.setenv("FN_ACCELERATOR", "cpu")
    K.set_accelerator(record)
    assert K.get_accelerator() is record and K.get_accelerator("fakedev") is record
    assert K.get_accelerator().communication_backend_name() == "fakeccl"
    assert "fakedev" not in clean_table
    K.set_accelerator(None)
    assert K.get_accelerator() is clean_table["cpu"]
    K.set_accelerator("cpu")
    monkeypatch.setenv("FN_ACCELERATOR", "tpu9")  # the explicit choice wins
    assert K.get_accelerator() is clean_table["cpu"]
    with pytest.raises(ValueError, match="unknown accelerator"):
        K.set_accelerator("nonesuch")
    with pytest.raises(ValueError, match="not available"):
        K.set_accelerator(K.Accelerator("gone", _missing_package))
    with pytest.raises(ValueError, match="unknown device type 'tpu9'"):
        K.get_accelerator("tpu9")


def test_set_accelerator_record_serves_its_device_type(clean_table):
    calls = []
    record = K.Accelerator("cpu", lambda: True, "gloo", {"counting": _counting_set(calls)})
    K.set_accelerator(record)
    assert K.get_accelerator("cpu") is record and K.kernel_set("cpu") == "counting"
    _run_every_kernel()
    assert calls == _EVERY_KERNEL_CALLS
    assert clean_table["cpu"].kernel_set_names() == ("c", "reference")
    K.set_accelerator(None)
    assert K.get_accelerator("cpu") is clean_table["cpu"] and K.kernel_set("cpu") == "c"
    _run_every_kernel()
    assert calls == _EVERY_KERNEL_CALLS


def test_register_accelerator_replaces_the_device_record(clean_table):
    calls = []
    builtin = clean_table["cpu"]
    record = K.Accelerator("cpu", lambda: True, "gloo", {"counting": _counting_set(calls)})
    assert K.register_accelerator(record) is builtin
    K.packbits(torch.randn(9))
    assert calls == [("packbits", 9)]
    assert K.register_accelerator(builtin) is record
    K.packbits(torch.randn(9))
    assert calls == [("packbits", 9)]
    with pytest.raises(TypeError):
        K.register_accelerator("cpu")


def test_registered_device_is_detected_after_builtins(clean_table):
    if any(clean_table[n].is_available() for n in ("cuda", "xpu", "npu", "hpu", "mps")):
        pytest.skip("a built-in accelerator is available and takes precedence")
    impl = lambda x: _reference.packbits(x)  # noqa: E731
    record = K.Accelerator("fakedev", lambda: True, kernel_sets={"fast": {"packbits": impl}})
    assert K.register_accelerator(record) is None
    assert K.get_accelerator() is record
    assert _table.kernel("fakedev", "packbits") is impl
    assert _table.kernel("fakedev", "quantize") is _reference.quantize
    assert _table.kernel("meta", "quantize") is _reference.quantize  # no record: the reference


def test_selected_kernel_set_changes_dispatch(clean_table):
    calls = []
    assert K.register_kernels("cpu", "counting", _counting_set(calls)) is None
    assert clean_table["cpu"].kernel_set_names() == ("c", "counting", "reference")
    _run_every_kernel()
    assert calls == []  # registered, not selected: the default set runs
    K.select_kernels("cpu", "counting")
    assert K.kernel_set("cpu") == "counting"
    _run_every_kernel()
    assert calls == _EVERY_KERNEL_CALLS
    K.select_kernels("cpu", None)
    assert K.kernel_set("cpu") == "c" and _table.kernel("cpu", "packbits") is _cpu.packbits
    _run_every_kernel()
    assert calls == _EVERY_KERNEL_CALLS


def test_selected_kernel_set_runs_under_vmap_and_compile(clean_table):
    calls = []
    K.register_kernels("cpu", "counting", _counting_set(calls))
    K.select_kernels("cpu", "counting")
    m, e = torch.randn(2, 5), torch.randn(2, 5)
    want = [_reference.sign_compress(m[i], e[i]) for i in range(2)]
    got = torch.func.vmap(K.sign_compress)(m, e)
    assert calls == [("sign_compress", 5)] * 2
    assert all(
        torch.equal(g, torch.stack(w)) for g, w in zip(got, zip(*want, strict=True), strict=True)
    )
    compiled = torch.compile(K.sign_compress, backend="aot_eager", fullgraph=True)
    got = compiled(m[0], e[0])
    assert calls[2:] == [("sign_compress", 5)]
    assert all(torch.equal(g, w) for g, w in zip(got, want[0], strict=True))
    K.select_kernels("cpu", None)
    compiled(m[0], e[0])  # the op is opaque to the graph: selection applies without recompiling
    assert len(calls) == 3


def test_fn_kernels_selects_by_name(clean_table, monkeypatch):
    calls = []
    K.register_kernels("cpu", "counting", _counting_set(calls))
    for value in ("counting", "cpu:counting", "cuda:triton,cpu:counting", "reference,cpu:counting"):
        monkeypatch.setenv("FN_KERNELS", value)
        assert K.kernel_set("cpu") == "counting", value
    # A plain name applies to the device types that offer it.
    monkeypatch.setenv("FN_KERNELS", "counting")
    assert K.kernel_set("cuda") == "triton"
    K.packbits(torch.randn(4))
    assert calls == [("packbits", 4)]
    monkeypatch.setenv("FN_KERNELS", "reference")
    assert K.kernel_set("cpu") == K.kernel_set("cuda") == "reference"
    assert _table.kernel("cpu", "sign_compress") is _reference.sign_compress
    K.select_kernels("cpu", "counting")  # the explicit choice wins
    K.packbits(torch.randn(4))
    assert calls == [("packbits", 4)] * 2


def test_fn_kernels_reference_bypasses_the_default_set(clean_table, monkeypatch):
    calls = []
    K.register_accelerator(K.Accelerator("cpu", lambda: True, "gloo", {"c": _counting_set(calls)}))
    _run_every_kernel()
    assert len(calls) == len(_EVERY_KERNEL_CALLS)
    monkeypatch.setenv("FN_KERNELS", "reference")
    _run_every_kernel()
    assert len(calls) == len(_EVERY_KERNEL_CALLS)


@pytest.mark.parametrize(
    "value, match",
    [
        ("fastest", "no device type offers a kernel set 'fastest'"),
        ("cpu:fastest", "unknown kernel set 'fastest' for device type 'cpu'"),
        ("tpu9:reference", r"unknown device types \['tpu9'\]"),
        (":reference", "expected comma-separated entries"),
        ("cpu:", "expected comma-separated entries"),
    ],
)
def test_fn_kernels_errors(clean_table, monkeypatch, value, match):
    monkeypatch.setenv("FN_KERNELS", value)
    with pytest.raises(ValueError, match=f"FN_KERNELS={value!r}.*{match}"):
        K.packbits(torch.randn(8))


def test_kernel_set_errors(clean_table):
    with pytest.raises(ValueError, match="select_kernels: unknown kernel set 'nonesuch'"):
        K.select_kernels("cpu", "nonesuch")
    with pytest.raises(ValueError, match="unknown device type 'tpu9'"):
        K.select_kernels("tpu9", "reference")
    with pytest.raises(ValueError, match="unknown device type 'tpu9'"):
        K.register_kernels("tpu9", "counting", {})
    with pytest.raises(ValueError, match="unknown kernel names"):
        K.register_kernels("cpu", "counting", {"fft": _reference.packbits})
    with pytest.raises(TypeError, match=r"the implementations of \['packbits'\] are not callable"):
        K.register_kernels("cpu", "counting", {"packbits": 42})
    with pytest.raises(ValueError, match="implicit"):
        K.register_kernels("cpu", "reference", {})
    K.register_kernels("cpu", "counting", {})
    K.select_kernels("cpu", "counting")
    assert K.register_kernels("cpu", "counting", None) == {}
    with pytest.raises(ValueError, match="unknown kernel set 'counting' for device type 'cpu'"):
        K.packbits(torch.randn(8))


def test_table_is_restored_between_tests():
    assert set(_table._TABLE) == set(_BUILTIN) and _table._SELECTED is None
    assert _table._KERNEL_SETS == {}
    assert _table._TABLE["cpu"].kernel_sets["c"]["packbits"] is _cpu.packbits


def test_cpu_source_is_package_data():
    import importlib.resources

    resource = importlib.resources.files("fn.kernels").joinpath("_cpu.c")
    assert resource.is_file()
    assert _cpu.source() == resource.read_text(encoding="utf-8")
    assert "fn_work" in _cpu.source()


def test_cpu_library_name_follows_the_source(monkeypatch, tmp_path):
    monkeypatch.setenv("FN_CACHE_DIR", str(tmp_path))
    path = _cpu.library_path("cc")
    assert path.parent == tmp_path and path == _cpu.library_path("cc")
    assert _cpu.library_path("gcc") != path
    text = _cpu.source()
    monkeypatch.setattr(_cpu, "source", lambda: text + "\n/* edited */\n")
    assert _cpu.library_path("cc") != path


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
