"""The accelerator table: device type -> :class:`Accelerator`, the accelerator in use
(:func:`get_accelerator`), and the kernel set each device type runs.

Dispatch (:func:`kernel`): a kernel called on a tensor of device type ``D`` runs the
implementation of ``D``'s record (the record chosen by :func:`set_accelerator` when it is of
type ``D``, else the table's) from one of its kernel sets: the one chosen by
:func:`select_kernels`, else by ``FN_KERNELS``, else the record's default (first) set. Device
types without a record run the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from fn.kernels import _devices, _spec
from fn.kernels._accelerator import REFERENCE, Accelerator
from fn.kernels._spec import REFERENCES

_DETECTION_ORDER = ("cuda", "xpu", "npu", "hpu", "mps")
_TABLE: dict[str, Accelerator] = {record.name: record for record in _devices.builtin()}
_SELECTED: str | Accelerator | None = None  # set_accelerator's choice
_KERNEL_SETS: dict[str, str] = {}  # select_kernels' choices: device type -> kernel-set name


def register_accelerator(record: Accelerator) -> Accelerator | None:
    """Adds ``record`` to the table, replacing the record of the same device type.

    Args:
        record: the device type's record; from now on it serves that device type's kernels.

    Returns:
        The record it replaced, or ``None``.

    Example:
        >>> import dataclasses
        >>> import fn.kernels as K
        >>> cpu = K.get_accelerator("cpu")
        >>> reference_only = dataclasses.replace(cpu, kernel_sets={})
        >>> K.register_accelerator(reference_only) is cpu
        True
        >>> K.get_accelerator("cpu").kernel_set_names()
        ('reference',)
        >>> K.register_accelerator(cpu) is reference_only  # the built-in record again
        True
    """
    if not isinstance(record, Accelerator):
        raise TypeError(f"expected an Accelerator record, got {type(record).__name__}")
    previous = _TABLE.get(record.name)
    _TABLE[record.name] = record
    return previous


def register_kernels(
    device_type: str, name: str, kernels: Mapping[str, Callable[..., Any]] | None
) -> Mapping[str, Callable[..., Any]] | None:
    """Adds the kernel set ``name`` to the record of ``device_type`` (``None`` removes it).

    A new set comes after the record's default set; select it with :func:`select_kernels` or
    ``FN_KERNELS``. Each implementation must have the signature and the bit-exact results of
    the reference kernel of its name; kernels the set leaves out run the reference.

    Args:
        device_type: a device type of the table, e.g. ``"cpu"``.
        name: the kernel set's name (not ``"reference"``).
        kernels: kernel name (see ``KERNEL_NAMES``) -> implementation, or ``None``.

    Returns:
        The set of that name it replaced, or ``None``.

    Example:
        >>> import torch
        >>> import fn.kernels as K
        >>> reference_packbits = K.get_accelerator("cpu").kernel("packbits", "reference")
        >>> calls = []
        >>> def counting_packbits(x):
        ...     calls.append(x.numel())
        ...     return reference_packbits(x)
        >>> K.register_kernels("cpu", "counting", {"packbits": counting_packbits})
        >>> K.select_kernels("cpu", "counting")
        >>> K.packbits(torch.tensor([1.0, -2.0, 0.0])).tolist()
        [160]
        >>> calls
        [3]
        >>> K.select_kernels("cpu", None)  # the default set again
        >>> _ = K.register_kernels("cpu", "counting", None)
    """
    record = _TABLE.get(device_type)
    if record is None:
        raise ValueError(f"unknown device type {device_type!r}; registered: {sorted(_TABLE)}")
    sets = dict(record.kernel_sets)
    previous = sets.pop(name, None)
    if kernels is not None:
        sets[name] = kernels
    _TABLE[device_type] = dataclasses.replace(record, kernel_sets=sets)
    return previous


def _lookup(name: str, source: str) -> Accelerator:
    record = _TABLE.get(name)
    if record is None:
        raise ValueError(f"{source}: unknown accelerator {name!r}; valid values: {sorted(_TABLE)}")
    if not record.is_available():
        raise ValueError(
            f"{source}: accelerator {name!r} is not available here; valid values on this "
            f"machine: {[n for n, r in _TABLE.items() if r.is_available()]}"
        )
    return record


def set_accelerator(accelerator: str | Accelerator | None) -> None:
    """Selects the accelerator in use, over ``FN_ACCELERATOR`` and detection.

    Args:
        accelerator: a device type of the table; or a record, which also serves the kernels of
            its device type while it is selected (the table keeps its own record); or ``None``
            to go back to ``FN_ACCELERATOR`` and detection.

    Raises:
        ValueError: for an unknown device type or an accelerator not available here.

    Example:
        >>> import fn.kernels as K
        >>> K.set_accelerator("cpu")
        >>> K.get_accelerator().name, K.get_accelerator().communication_backend_name()
        ('cpu', 'gloo')
        >>> K.set_accelerator(None)  # FN_ACCELERATOR or detection again
    """
    global _SELECTED
    if isinstance(accelerator, Accelerator):
        if not accelerator.is_available():
            raise ValueError(f"set_accelerator: accelerator {accelerator.name!r} is not available")
    elif accelerator is not None:
        _lookup(accelerator, "set_accelerator")
    _SELECTED = accelerator


def get_accelerator(device_type: str | None = None) -> Accelerator:
    """The accelerator in use, or the record that serves ``device_type``.

    Args:
        device_type: ``None`` for the accelerator in use: the :func:`set_accelerator` choice,
            else ``$FN_ACCELERATOR``, else the first available device (cuda, xpu, npu, hpu,
            mps, then externally registered ones), else cpu. A device type for the record
            whose kernels tensors of that type run.

    Returns:
        The :class:`Accelerator` record.

    Raises:
        ValueError: for an unknown or unavailable ``FN_ACCELERATOR``, or an unknown
            ``device_type``.

    Example:
        >>> import fn.kernels as K
        >>> K.get_accelerator("cpu").communication_backend_name()
        'gloo'
        >>> K.get_accelerator("cpu").kernel_set_names()
        ('c', 'reference')
    """
    if device_type is not None:
        record = _serving(device_type)
        if record is None:
            raise ValueError(f"unknown device type {device_type!r}; registered: {sorted(_TABLE)}")
        return record
    if isinstance(_SELECTED, Accelerator):
        return _SELECTED
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


def select_kernels(device_type: str, name: str | None) -> None:
    """Selects the kernel set that tensors of ``device_type`` run, over ``FN_KERNELS``.

    Args:
        device_type: a device type of the table, e.g. ``"cpu"``.
        name: one of ``get_accelerator(device_type).kernel_set_names()``, or ``None`` to go
            back to ``FN_KERNELS`` and the record's default set.

    Raises:
        ValueError: for an unknown device type or kernel set.

    Example:
        >>> import fn.kernels as K
        >>> K.select_kernels("cpu", "reference")  # the pure-torch reference on the CPU
        >>> K.kernel_set("cpu")
        'reference'
        >>> K.select_kernels("cpu", None)
        >>> K.kernel_set("cpu")
        'c'
    """
    if name is None:
        _KERNEL_SETS.pop(device_type, None)
        return
    _check_offered(get_accelerator(device_type), name, "select_kernels")
    _KERNEL_SETS[device_type] = name


def _check_offered(record: Accelerator, name: str, source: str) -> None:
    if name not in record.kernel_set_names():
        raise ValueError(
            f"{source}: unknown kernel set {name!r} for device type {record.name!r}; "
            f"valid: {record.kernel_set_names()}"
        )


@functools.lru_cache(maxsize=8)
def _parse_fn_kernels(value: str) -> dict[str | None, str]:
    """``FN_KERNELS`` as {device type (``None``: every type) -> kernel-set name}."""
    choices: dict[str | None, str] = {}
    for entry in value.split(","):
        device_type, sep, name = entry.strip().rpartition(":")
        if not name or (sep and not device_type):
            raise ValueError(
                f"FN_KERNELS={value!r}: expected comma-separated entries NAME or "
                "DEVICE_TYPE:NAME, e.g. 'reference' or 'cpu:reference,cuda:triton'"
            )
        choices[device_type or None] = name
    return choices


def _env_kernel_set(device_type: str, record: Accelerator) -> str | None:
    """``FN_KERNELS``'s choice for ``device_type``: its ``DEVICE_TYPE:NAME`` entry (which the
    record must offer), else its plain ``NAME`` where the record offers it (a plain name must
    be offered by some device type), else ``None``."""
    env = os.environ.get("FN_KERNELS")
    if not env:
        return None
    choices = _parse_fn_kernels(env)
    unknown = sorted(t for t in choices if t is not None and _serving(t) is None)
    if unknown:
        raise ValueError(f"FN_KERNELS={env!r}: unknown device types {unknown}")
    if device_type in choices:
        _check_offered(record, choices[device_type], f"FN_KERNELS={env!r}")
        return choices[device_type]
    plain = choices.get(None)
    if plain is None or plain in record.kernel_set_names():
        return plain
    records = [*_TABLE.values(), *([_SELECTED] if isinstance(_SELECTED, Accelerator) else [])]
    if not any(plain in r.kernel_set_names() for r in records):
        raise ValueError(
            f"FN_KERNELS={env!r}: no device type offers a kernel set {plain!r}; "
            f"{record.name!r} offers {record.kernel_set_names()}"
        )
    return None


def kernel_set(device_type: str) -> str:
    """The name of the kernel set tensors of ``device_type`` run (module doc).

    Args:
        device_type: a torch device type, e.g. ``"cpu"``.

    Returns:
        The :func:`select_kernels` choice, else the ``FN_KERNELS`` one, else the record's
        default (its first kernel set); ``"reference"`` for a device type without a record.

    Example:
        >>> import fn.kernels as K
        >>> K.kernel_set("cpu")
        'c'
    """
    record = _serving(device_type)
    if record is None:
        return REFERENCE
    name = _KERNEL_SETS.get(device_type) or _env_kernel_set(device_type, record)
    return record.kernel_set_names()[0] if name is None else name


def _serving(device_type: str) -> Accelerator | None:
    """The record that serves ``device_type``: the selected record when it is of that type."""
    if isinstance(_SELECTED, Accelerator) and _SELECTED.name == device_type:
        return _SELECTED
    return _TABLE.get(device_type)


def kernel(device_type: str, name: str) -> Callable[..., Any]:
    """The implementation of kernel ``name`` that runs on tensors of ``device_type`` (module
    doc); the reference for device types without a record."""
    record = _serving(device_type)
    if record is None:
        return REFERENCES[name]
    return record.kernel(name, kernel_set(device_type))


_spec.dispatch_through(kernel)  # the ops declared in fn.kernels._ops dispatch here
