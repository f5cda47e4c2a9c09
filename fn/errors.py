"""What fn refuses, and how it says so: the exceptions fn raises and the checks that raise them.

Arguments: hyperparameters are checked when a transform is built, by name, so the error says
which argument is wrong; shapes, params and the update count when it is called. A hyperparameter
of the wrong form (``betas`` that is not a pair, a string, ``None``) is a ``ValueError`` as well as
one out of range, so that one ``except ValueError`` catches every rejected setting.

Finiteness: a check that can raise from inside ``torch.func.vmap`` and ``torch.compile``. A
Python ``if`` on a tensor value fails under vmap (``Simulated`` runs every rank under vmap), so
there the check is a custom op: its vmap rule sees the whole batch as a plain tensor and checks
it. The op returns a copy of its input that the caller goes on with, so a compiled graph cannot
drop it. On eager plain tensors the check runs directly and returns the input itself (no copy).

Writes: torch's zip writer (``torch.save``, DCP's files) reports a write that failed (a full disk)
as ``unexpected pos ...``, naming neither the disk's error nor the file. fn writes its files
through a :class:`RecordingFile`, which keeps the ``OSError``, and raises that.
"""

from __future__ import annotations

import io
import math
import numbers
import os
import sys
from itertools import pairwise
from typing import Any

import torch

__all__ = [
    "NonFiniteError",
    "RecordingFile",
    "all_finite",
    "check_betas",
    "check_closed_fraction",
    "check_finite",
    "check_finite_nonnegative",
    "check_fraction",
    "check_lr",
    "check_int",
    "check_nonnegative",
    "check_ordered",
    "check_shapes",
    "check_step",
    "check_step_or_plan",
    "finite_or_raise",
    "real_value",
    "require_params",
    "user_stacklevel",
]


class NonFiniteError(ValueError):
    """Non-finite values (NaN or Inf) where fn refuses them: a gradient, a compression scale,
    an error-feedback buffer. Raised before anything is written, so the state it would have
    updated is unchanged.

    A ``ValueError``: code that catches ``ValueError`` catches it too.

    Example:
        >>> import torch, fn
        >>> tx = fn.onebit_adam(freeze_step=2, comm=fn.collectives.Local())
        >>> state = tx.init({"w": torch.zeros(2)})
        >>> try:
        ...     tx.update({"w": torch.tensor([1.0, float("nan")])}, state, step=1)
        ... except fn.NonFiniteError as err:
        ...     print(type(err).__name__, isinstance(err, ValueError))
        NonFiniteError True
    """


class RecordingFile(io.FileIO):
    """A file opened for writing that keeps each ``OSError`` of opening it or writing to it in
    ``failures`` (its ``filename`` set to the file's) before raising it.

    torch's zip writer reports a failed write as a ``RuntimeError`` (``unexpected pos ...``);
    code that writes through this file raises ``failures[0]`` instead, which says what the disk
    said (``errno.ENOSPC``, "No space left on device") and names the file.

    Args:
        path: the file.
        mode: an ``io.FileIO`` mode that writes (``"wb"``).
        failures: the list the errors are appended to (shared, e.g., by a checkpoint's files).

    Example:
        ``/dev/full`` fails every write as a full disk does:

        >>> import errno
        >>> failures = []
        >>> try:
        ...     with fn.errors.RecordingFile("/dev/full", "wb", failures) as file:
        ...         torch.save(torch.zeros(4), file)
        ... except (OSError, RuntimeError):  # what torch raises depends on where the write fails
        ...     pass
        >>> failures[0].errno == errno.ENOSPC, failures[0].strerror, failures[0].filename
        (True, 'No space left on device', '/dev/full')
    """

    def __init__(self, path: str | os.PathLike, mode: str, failures: list[OSError]) -> None:
        self.failures = failures
        try:
            super().__init__(path, mode)
        except OSError as error:
            failures.append(error)
            raise

    def write(self, data: Any) -> int | None:
        try:
            return super().write(data)
        except OSError as error:
            if error.filename is None:
                error.filename = os.fspath(self.name)
            self.failures.append(error)
            raise


def real_value(value: Any) -> float | None:
    """``value`` as a Python float if it is a real number, else ``None``.

    Real numbers: Python ``int`` and ``float`` and numpy's real scalars (``numbers.Real``), and
    one-element tensors of a real dtype; not ``bool`` (``True`` is no learning rate), complex
    numbers, strings, ``None`` or sequences.

    Example:
        >>> from fn.errors import real_value
        >>> real_value(0.5), real_value(torch.tensor(2)), real_value("0.5"), real_value(True)
        (0.5, 2.0, None, None)
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            return None
        try:
            return float(value.item())
        except (RuntimeError, NotImplementedError):  # a meta tensor holds no value
            return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def check_betas(name: str, betas: Any) -> tuple[float, float]:
    """``betas`` as two Python floats.

    Raises:
        ValueError: naming ``name`` and ``betas``, unless ``betas`` is a pair ``(b1, b2)`` (any
            iterable of two items) of real numbers (:func:`real_value`) in [0, 1).
    """
    items = None
    if not isinstance(betas, (str, bytes)):
        try:
            items = tuple(betas)
        except TypeError:  # not iterable
            items = None
    values = None if items is None else [real_value(b) for b in items]
    if values is None or len(values) != 2 or None in values:
        raise ValueError(
            f"{name}: betas must be a pair (b1, b2) of real numbers in [0, 1), got {betas!r}"
        )
    for i, b in enumerate(values):
        if not 0.0 <= b < 1.0:  # also rejects NaN
            raise ValueError(f"{name}: betas[{i}] must be in [0, 1), got {b}")
    return values[0], values[1]


def _real_or_raise(name: str, key: str, value: Any, wanted: str) -> float:
    """``value`` as a float (:func:`real_value`); raises ``ValueError`` naming ``key`` unless it
    is a real number (``wanted`` describes the range)."""
    number = real_value(value)
    if number is None:
        wanted = f" {wanted}" if wanted else ""
        raise ValueError(f"{name}: {key} must be a real number{wanted}, got {value!r}")
    return number


def check_nonnegative(name: str, **values: Any) -> None:
    """Raises ``ValueError`` naming the argument unless every value is a real number
    (:func:`real_value`) >= 0."""
    for key, v in values.items():
        number = _real_or_raise(name, key, v, ">= 0")
        if not number >= 0.0:  # also rejects NaN
            raise ValueError(f"{name}: {key} must be >= 0, got {v}")


def check_finite_nonnegative(name: str, **values: Any) -> None:
    """Raises ``ValueError`` naming the argument unless every value is a finite real number
    (:func:`real_value`) >= 0 (an ``lr`` or an ``eps``)."""
    check_nonnegative(name, **values)
    for key, v in values.items():
        if not math.isfinite(real_value(v)):
            raise ValueError(f"{name}: {key} must be finite (a real number >= 0), got {v}")


def check_lr(name: str, lr: Any) -> None:
    """Raises ``ValueError`` naming ``lr`` unless it is a schedule (a callable, read at update
    time) or a finite real number >= 0 (:func:`check_finite_nonnegative`)."""
    if callable(lr):
        return
    if real_value(lr) is None:
        raise ValueError(
            f"{name}: lr must be a real number >= 0 or a schedule (a function of the update "
            f"count), got {lr!r}"
        )
    check_finite_nonnegative(name, lr=lr)


def check_fraction(name: str, **values: Any) -> None:
    """Raises ``ValueError`` unless every value is a real number in [0, 1) (an EMA
    coefficient)."""
    for key, v in values.items():
        number = _real_or_raise(name, key, v, "in [0, 1)")
        if not 0.0 <= number < 1.0:  # also rejects NaN
            raise ValueError(f"{name}: {key} must be in [0, 1), got {v}")


def check_closed_fraction(name: str, **values: Any) -> None:
    """Raises ``ValueError`` unless every value is a real number in [0, 1] (a decay that may
    keep everything)."""
    for key, v in values.items():
        number = _real_or_raise(name, key, v, "in [0, 1]")
        if not 0.0 <= number <= 1.0:  # also rejects NaN
            raise ValueError(f"{name}: {key} must be in [0, 1], got {v}")


def check_ordered(name: str, **bounds: Any) -> None:
    """Raises ``ValueError`` unless the values, real numbers in the order given, do not decrease
    (e.g. ``min_coeff=a, max_coeff=b`` needs ``a <= b``)."""
    reals = {key: _real_or_raise(name, key, v, "") for key, v in bounds.items()}
    for (low_key, low), (high_key, high) in pairwise(reals.items()):
        if not low <= high:  # also rejects NaN
            raise ValueError(
                f"{name}: {low_key} ({bounds[low_key]}) must be <= {high_key} ({bounds[high_key]})"
            )


def check_int(name: str, value: int, minimum: int = 0, why: str = "") -> int:
    """``value``; raises ``ValueError`` (naming ``name``, then ``why``) unless it is an int (not a
    bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        reason = f": {why}" if why else ""
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}{reason}")
    return value


def check_step(step: Any) -> int:
    """``step``, the 1-based update count of a host-side schedule.

    Raises:
        TypeError: if ``step`` is a tensor (the schedule is decided on the host).
        ValueError: unless ``step`` is an int (not a bool) >= 1.
    """
    if isinstance(step, torch.Tensor):
        raise TypeError(
            "step must be a Python int (the schedule is decided on the host), got a tensor"
        )
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"step counts updates from 1, got {step!r}")
    return step


def check_step_or_plan(step: Any, plan: Any) -> int | None:
    """Checks that exactly one of ``step`` (the 1-based update count) and ``plan``
    (``opt.plan(t)``) is given, as a compressed optimizer's updates take them.

    Returns:
        ``step`` checked by :func:`check_step`, or ``None`` when ``plan`` is given.

    Raises:
        TypeError: if neither or both are given, or ``step`` is a tensor.
        ValueError: unless ``step`` is an int (not a bool) >= 1.
    """
    if (step is None) == (plan is None):
        raise TypeError(
            "pass exactly one of step=t (the 1-based update count) and plan=opt.plan(t)"
        )
    return None if step is None else check_step(step)


def check_shapes(name: str, like: torch.Tensor, update: torch.Tensor, what: str = "update") -> None:
    """Raises ``ValueError`` when ``update`` (described as ``what``, e.g. ``"gradient leaf
    'w'"``) and the state or param leaf ``like`` differ in shape (no broadcasting)."""
    if update.shape != like.shape:
        raise ValueError(
            f"{name}: {what} of shape {tuple(update.shape)} does not match the state's "
            f"{tuple(like.shape)}"
        )


def require_params(params: Any, why: str) -> None:
    """Raises ``ValueError`` when ``params`` is ``None`` (``why`` says what needs them)."""
    if params is None:
        raise ValueError(f"{why} needs the params: call update(grads, state, params, step=t)")


def all_finite(x: torch.Tensor) -> bool:
    """True if no element of ``x`` is NaN or infinite.

    One reduction in the common case: a sum is finite only if every element is (NaN and
    infinities propagate; ``inf + -inf`` is NaN). Only a non-finite sum, a NaN/Inf or finite
    values whose sum overflows, takes the elementwise test.
    """
    if bool(torch.isfinite(x.sum())):
        return True
    return bool(torch.isfinite(x).all())


def finite_or_raise(x: torch.Tensor, message: str) -> torch.Tensor:
    """``x`` (eager) or a copy of it (under vmap or ``torch.compile``); raises
    ``NonFiniteError(message)`` if any element (any rank's) is not finite."""
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return _finite_or_raise_op(x, message)
    if not all_finite(x):
        raise NonFiniteError(message)
    return x


def check_finite(x: torch.Tensor, what: str) -> torch.Tensor:
    """:func:`finite_or_raise` for an optimizer about to update its state: the message (which
    contains "non-finite") names ``what`` and says that nothing was updated."""
    return finite_or_raise(
        x,
        f"{what} contains non-finite values (NaN or Inf); no update was made and the "
        "optimizer state is unchanged",
    )


@torch.library.custom_op("fn::finite_or_raise", mutates_args=())
def _finite_or_raise_op(x: torch.Tensor, message: str) -> torch.Tensor:
    if not all_finite(x):
        raise NonFiniteError(message)
    return x.clone()


@_finite_or_raise_op.register_fake
def _(x, message):
    return torch.empty_like(x)


@_finite_or_raise_op.register_vmap
def _(info, in_dims, x, message):
    del info
    return _finite_or_raise_op(x, message), in_dims[0]


# fn's package and torch's: the frames that user_stacklevel skips.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__)
)


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` that names the caller's first frame outside fn
    and torch (e.g. the user's ``opt.step()`` line, however many wrappers torch adds).

    Example:
        Called from code outside fn and torch, it names that code's own frame:

        >>> def report():
        ...     return fn.errors.user_stacklevel()
        >>> report()
        1
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level
