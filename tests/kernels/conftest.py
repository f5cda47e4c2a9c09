"""Shared fixtures: every test that touches the accelerator table gets it back unchanged."""

import pytest

from fn.kernels import _cpu, _table


@pytest.fixture
def clean_table(monkeypatch):
    """A private copy of the table, no explicit selections and no FN_* overrides."""
    monkeypatch.setattr(_table, "_TABLE", dict(_table._TABLE))
    monkeypatch.setattr(_table, "_SELECTED", None)
    monkeypatch.setattr(_table, "_KERNEL_SETS", {})
    monkeypatch.delenv("FN_ACCELERATOR", raising=False)
    monkeypatch.delenv("FN_KERNELS", raising=False)
    return _table._TABLE


@pytest.fixture(scope="module")
def c_kernels():
    """The C kernel set (``fn.kernels._cpu``); skips where no C compiler works."""
    if _cpu.library() is None:
        pytest.skip("no working C compiler: the CPU kernels fall back to the reference")
    return _cpu
