"""The :class:`Accelerator` record: what the accelerator table knows about one device type.

A record says whether the device can be used here, names its ``torch.distributed`` backend and
holds its kernel sets. Device packages (``torch_npu``, ``habana_frameworks``, ...) are imported
only by the record's own calls, never when ``fn`` is imported.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fn.kernels import _ops  # noqa: F401  (declares the kernels)
from fn.kernels._spec import REFERENCES

KERNEL_NAMES = tuple(REFERENCES)  # in declaration order (fn.kernels._ops)
"""The names of the kernels, the keys of a kernel set (:class:`Accelerator`'s ``kernel_sets``,
:func:`register_kernels`): a kernel set maps some of them to implementations.

Example:
    >>> fn.kernels.KERNEL_NAMES[:3]
    ('packbits', 'unpackbits', 'sign_compress')
"""
REFERENCE = "reference"


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device type of the accelerator table.

    Args:
        name: the torch device type (``tensor.device.type``), e.g. ``"cuda"``. The kernels of
            every tensor on this device type come from this record's kernel sets.
        available: zero-argument callable, whether the device can be used on this machine. It
            may import the device's package; ``ImportError`` means the package is not
            installed (the device is unavailable).
        backend: the ``torch.distributed`` backend name for this device, ``None`` when there is
            none, or a zero-argument callable returning it (decided at call time).
        kernel_sets: kernel-set name -> {kernel name (one of ``KERNEL_NAMES``) ->
            implementation}, most preferred first: the first set is this device type's default.
            An implementation has the signature and the bit-exact results of the reference
            kernel of that name; a kernel a set leaves out runs the reference. Every record
            also has the set ``"reference"`` (implicit, so it cannot be given).

    Example:
        >>> import fn.kernels as K
        >>> record = K.Accelerator("fakedev", lambda: True, "fakeccl", {"fast": {}})
        >>> record.kernel_set_names()
        ('fast', 'reference')
        >>> record.communication_backend_name()
        'fakeccl'
    """

    name: str
    available: Callable[[], bool]
    backend: str | None | Callable[[], str | None] = None
    kernel_sets: Mapping[str, Mapping[str, Callable[..., Any]]] = dataclasses.field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        if REFERENCE in self.kernel_sets:
            raise ValueError(f"the kernel set {REFERENCE!r} is implicit; give the others only")
        for set_name, kernels in self.kernel_sets.items():
            unknown = set(kernels) - set(KERNEL_NAMES)
            if unknown:
                raise ValueError(
                    f"kernel set {set_name!r}: unknown kernel names {sorted(unknown)}; "
                    f"valid: {KERNEL_NAMES}"
                )
            uncallable = sorted(k for k, f in kernels.items() if not callable(f))
            if uncallable:
                raise TypeError(
                    f"kernel set {set_name!r}: the implementations of {uncallable} are not callable"
                )
        frozen = {k: types.MappingProxyType(dict(v)) for k, v in self.kernel_sets.items()}
        object.__setattr__(self, "kernel_sets", types.MappingProxyType(frozen))

    def is_available(self) -> bool:
        """Whether the device's package is installed and the device is usable here."""
        try:
            return bool(self.available())
        except ImportError:
            return False

    def communication_backend_name(self) -> str | None:
        """The ``torch.distributed`` backend for this device (``None`` when there is none)."""
        return self.backend() if callable(self.backend) else self.backend

    def synchronize(self) -> None:
        """Waits for the work queued on the current device of this type (through the device
        module torch registers, ``torch.get_device_module(name)``)."""
        torch.get_device_module(self.name).synchronize()

    def kernel_set_names(self) -> tuple[str, ...]:
        """The kernel sets this record offers, the default first, ``"reference"`` last."""
        return (*self.kernel_sets, REFERENCE)

    def kernel(self, name: str, kernel_set: str | None = None) -> Callable[..., Any]:
        """The implementation of kernel ``name`` in ``kernel_set`` (``None``: the default set).

        Args:
            name: one of :data:`KERNEL_NAMES`.
            kernel_set: one of :meth:`kernel_set_names`, or ``None``.

        Returns:
            The set's implementation of the kernel, or the reference where the set has none.

        Raises:
            ValueError: for an unknown kernel or kernel-set name.
        """
        if name not in KERNEL_NAMES:
            raise ValueError(f"unknown kernel {name!r}; valid: {KERNEL_NAMES}")
        if kernel_set is None:
            kernel_set = self.kernel_set_names()[0]
        if kernel_set == REFERENCE:
            return REFERENCES[name]
        kernels = self.kernel_sets.get(kernel_set)
        if kernels is None:
            raise ValueError(
                f"unknown kernel set {kernel_set!r} for device type {self.name!r}; "
                f"valid: {self.kernel_set_names()}"
            )
        return kernels.get(name) or REFERENCES[name]
