"""The accelerator table: device type -> :class:`Accelerator`, and the current selection.

Selection (:func:`get_accelerator`): an explicit :func:`set_accelerator` choice, else the
``FN_ACCELERATOR`` environment variable, else the first available of cuda, xpu, npu, hpu, mps
(then externally registered devices), else cpu.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from fn.kernels import _devices, _reference
from fn.kernels._accelerator import KERNEL_NAMES, Accelerator

_DETECTION_ORDER = ("cuda", "xpu", "npu", "hpu", "mps")
_TABLE: dict[str, Accelerator] = {record.name: record for record in _devices.builtin()}
_SELECTED: str | None = None


def register_accelerator(record: Accelerator) -> Accelerator | None:
    """Adds ``record`` to the table (replacing the record of the same device type).

    Returns:
        The record it replaced, or ``None``.
    """
    if not isinstance(record, Accelerator):
        raise TypeError(f"expected an Accelerator record, got {type(record).__name__}")
    previous = _TABLE.get(record.name)
    _TABLE[record.name] = record
    return previous


def register_kernel(
    device_type: str, name: str, impl: Callable[..., Any] | None
) -> Callable[..., Any] | None:
    """Replaces one kernel of a registered device (``impl=None`` removes it: the reference runs).

    ``impl`` must have the signature and bit-exact semantics of the reference kernel ``name``.

    Returns:
        The implementation it replaced, or ``None``.
    """
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {name!r}; valid: {KERNEL_NAMES}")
    record = _TABLE.get(device_type)
    if record is None:
        raise ValueError(f"unknown device type {device_type!r}; registered: {sorted(_TABLE)}")
    kernels = dict(record.kernels)
    previous = kernels.pop(name, None)
    if impl is not None:
        kernels[name] = impl
    _TABLE[device_type] = dataclasses.replace(record, kernels=kernels)
    return previous


def _available() -> list[str]:
    return [name for name, record in _TABLE.items() if record.is_available()]


def _lookup(name: str, source: str) -> Accelerator:
    record = _TABLE.get(name)
    if record is None:
        raise ValueError(f"{source}: unknown accelerator {name!r}; valid values: {sorted(_TABLE)}")
    if not record.is_available():
        raise ValueError(
            f"{source}: accelerator {name!r} is not available here; valid values on this "
            f"machine: {_available()}"
        )
    return record


def set_accelerator(accelerator: str | Accelerator | None) -> None:
    """Selects the accelerator explicitly (overrides ``FN_ACCELERATOR``); ``None`` goes back to
    detection. A record is registered first."""
    global _SELECTED
    if accelerator is None:
        _SELECTED = None
        return
    if isinstance(accelerator, Accelerator):
        if not accelerator.is_available():
            raise ValueError(f"set_accelerator: accelerator {accelerator.name!r} is not available")
        register_accelerator(accelerator)
        accelerator = accelerator.name
    _lookup(accelerator, "set_accelerator")
    _SELECTED = accelerator


def get_accelerator() -> Accelerator:
    """The accelerator in use: the explicit choice, else ``$FN_ACCELERATOR``, else the first
    available device (cuda, xpu, npu, hpu, mps, then externally registered ones), else cpu."""
    if _SELECTED is not None:
        return _TABLE[_SELECTED]
    env = os.environ.get("FN_ACCELERATOR")
    if env:
        return _lookup(env, "FN_ACCELERATOR")
    external = [name for name in _TABLE if name not in (*_DETECTION_ORDER, "cpu")]
    for name in (*_DETECTION_ORDER, *external):
        record = _TABLE.get(name)
        if record is not None and record.is_available():
            return record
    return _TABLE["cpu"]


def kernel(device_type: str, name: str) -> Callable[..., Any]:
    """The implementation of kernel ``name`` for tensors on ``device_type``: the table's entry,
    else the reference (always the reference when ``FN_KERNELS=reference``)."""
    mode = os.environ.get("FN_KERNELS", "auto")
    if mode not in ("auto", "reference"):
        raise ValueError(f"FN_KERNELS={mode!r}; valid values: 'auto', 'reference'")
    record = _TABLE.get(device_type)
    impl = None if mode == "reference" or record is None else record.kernels.get(name)
    return impl if impl is not None else getattr(_reference, name)
