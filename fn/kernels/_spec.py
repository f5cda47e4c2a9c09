"""How a kernel is declared: one :func:`declare` per ``torch.library`` op, one :func:`eager`
per kernel without an op.

A declaration names the op and its schema (its signature, ``torch.library``'s syntax), the
shape rule of its outputs (the fake that ``torch.compile`` traces with), its vmap rule and its
readable reference (``fn.kernels._reference``, the oracle of every implementation). From it
come the custom op ``fn::<name>`` (which runs, for a tensor of device type ``D``, the kernel of
that name from ``D``'s kernel set in the accelerator table), its fake and vmap rule, the
reference entry of every kernel set (:data:`REFERENCES`) and the checked public function. A
device implementation is a function of the kernel's name and the reference's signature in the
module of its kernel set (:func:`implementations`), made by :func:`implementation`, which runs
the reference for the inputs it does not take.

The op stays one opaque node under ``torch.compile`` (no graph breaks, no data-dependent
guards, and a change of kernel set needs no recompilation). Under ``torch.func.vmap`` every row
is an independent call (its own scale, its own error; the non-finite check sees concrete data),
except for elementwise ops, whose batch is one call.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fn.errors import NonFiniteError
from fn.kernels import _reference

ROWS = "rows"  # vmap: one call per row, the results stacked along dim 0
ELEMENTWISE = "elementwise"  # vmap: the batch is one call

# kernel name -> its reference, in declaration order (KERNEL_NAMES)
REFERENCES: dict[str, Callable[..., Any]] = {}
# (device type, kernel name) -> implementation: the accelerator table's lookup, which the table
# (built from the declarations, so after them) passes in (dispatch_through)
_lookup: Callable[[str, str], Callable[..., Any]] | None = None


def dispatch_through(lookup: Callable[[str, str], Callable[..., Any]]) -> None:
    """Makes ``lookup(device type, kernel name)`` the table that :func:`kernel` asks."""
    global _lookup
    _lookup = lookup


def kernel(name: str, device: torch.device) -> Callable[..., Any]:
    """The implementation of kernel ``name`` that tensors on ``device`` run (the table's)."""
    return _lookup(device.type, name)


def implementations(module: types.ModuleType) -> dict[str, Callable[..., Any]]:
    """The kernel set of ``module``: its functions named as a kernel, under that name."""
    return {name: getattr(module, name) for name in REFERENCES if hasattr(module, name)}


def implementation(
    backend: Callable[[], Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Makes the decorated ``impl`` the kernel of its name in a device kernel set: a function
    with the signature of the reference of that name (``fn.kernels._reference``), which runs
    ``impl`` and, where ``impl`` cannot, the reference.

    The kernel calls ``impl(handle, *args)`` with the handle that ``backend()`` gives (a
    compiled library, an imported module), or ``impl(*args)`` without a backend. It runs the
    reference instead when the handle is ``None`` (the backend is unavailable) or ``impl``
    returns ``None`` (an input it does not take, before it writes anything); an ``impl`` that
    writes into an argument returns ``True``.

    Args:
        backend: gives the handle, or ``None`` when it is unavailable; called on every call.

    Returns:
        The decorator.

    Raises:
        TypeError: (when decorating) ``impl``'s parameters after the handle are not the
            reference's: names, kinds and defaults.

    Example:
        >>> import torch
        >>> @implementation()
        ... def packbits(x):
        ...     return None if x.dtype == torch.float16 else _reference.packbits(x)
        >>> packbits(torch.tensor([1.0, -2.0], dtype=torch.float16)).tolist()  # the reference
        [128]
    """

    def decorate(impl: Callable[..., Any]) -> Callable[..., Any]:
        reference = getattr(_reference, impl.__name__)
        wanted = inspect.signature(reference).parameters.values()
        given = list(inspect.signature(impl).parameters.values())[backend is not None :]
        if [(p.name, p.kind, p.default) for p in given] != [
            (p.name, p.kind, p.default) for p in wanted
        ]:
            raise TypeError(f"{impl.__name__}: the parameters are not the reference's")

        def run(*args: Any, **kwargs: Any) -> Any:
            if backend is None:
                result = impl(*args, **kwargs)
            else:
                handle = backend()
                result = None if handle is None else impl(handle, *args, **kwargs)
            if result is None:  # looked up now: a test may replace the reference
                return getattr(_reference, impl.__name__)(*args, **kwargs)
            return result

        run.__name__ = run.__qualname__ = impl.__name__
        run.__module__, run.__doc__ = impl.__module__, impl.__doc__
        run.__signature__ = inspect.signature(reference)  # type: ignore[attr-defined]
        return run

    return decorate


def eager(reference: Callable[..., Any]) -> str:
    """Declares a kernel that has no op (eager tensors only), with its reference; its name."""
    REFERENCES.setdefault(reference.__name__, reference)
    return reference.__name__


class Op:
    """A declared op, called with its schema's arguments (``torch.ops.fn.<name>``)."""

    def __init__(
        self,
        schema: str,
        *,
        fake: Callable[..., Any] | None = None,
        vmap: str = ROWS,
        reference: Callable[..., Any],
        call: Callable[..., Any] | None = None,
        finite: int | None = None,
    ) -> None:
        self.name = schema[: schema.index("(")]
        self.reference = reference
        self.kernel_name = eager(reference)
        self.finite = finite
        self._call = call
        signature = schema[len(self.name) :]
        arguments, results = signature.split("->")
        mutates = tuple(a.split()[-1] for a in arguments.strip("() ").split(", ") if "!" in a)
        self._returns = results.strip() != "()"
        self.custom_op = torch.library.custom_op(
            f"fn::{self.name}", self._run, mutates_args=mutates, schema=signature
        )
        self.argument_names = [a.name for a in self.custom_op._opoverload._schema.arguments]
        self.custom_op.register_fake(fake or (lambda *args: None))
        if vmap == ELEMENTWISE:
            self.custom_op.register_vmap(lambda info, in_dims, *args: (self(*args), in_dims[0]))
        elif mutates:
            self.custom_op.register_vmap(_per_row_into(self, self.argument_names.index(mutates[0])))
        else:
            self.custom_op.register_vmap(_per_row(self))
        self.overload = getattr(torch.ops.fn, self.name).default

    def __call__(self, *args: Any) -> Any:
        return self.overload(*args)

    def _run(self, *args: Any) -> Any:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        impl = kernel(self.kernel_name, device)
        result = impl(*args) if self._call is None else self._call(impl, *args)
        if not self._returns:
            return None
        if self.finite is not None and not bool(torch.isfinite(result[self.finite]).all()):
            raise NonFiniteError(
                f"{self.kernel_name}: the scale is non-finite (NaN or Inf in the input); refusing "
                "to produce compressed garbage"
            )
        return result


def declare(
    schema: str, *, returns: str | None = None, **options: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declares the op of ``schema`` (``"name(args) -> results"``; mutated arguments marked
    ``(a!)``) and makes the decorated checks its public function.

    The decorated function has the public signature and docstring, raises for bad
    arguments and returns ``None`` or a dict of the op's arguments to pass instead of the public
    ones (by name). The public function then calls the op with its arguments by name and returns
    the op's result, or the argument named ``returns``.

    Args (``options`` are :class:`Op`'s):
        schema: the op's name and signature; the kernel of that name takes the same arguments.
        fake: the shape rule: empty outputs of the right shapes from the arguments (ops that
            only write into arguments need none).
        vmap: :data:`ROWS` (one call per row; ops that write into an argument write that
            argument's row, which must then be batched) or :data:`ELEMENTWISE`.
        reference: the readable reference, the kernel name's entry in every kernel set.
        call: how the op calls its kernel, ``call(kernel, *arguments)``, where the kernel takes
            other arguments (default: ``kernel(*arguments)``).
        finite: the index of the result that must be finite (a scale), else ``NonFiniteError``.
        returns: the argument the public function returns (``None``: the op's result).
    """
    op = Op(schema, **options)

    def decorate(check: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(check)
        parameters = signature.parameters.values()
        positional = [p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]
        defaults = {p.name: p.default for p in parameters if p.default is not p.empty}

        @functools.wraps(check)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if len(args) > len(positional) or any(n in kwargs for n in positional[: len(args)]):
                signature.bind(*args, **kwargs)  # raises the TypeError of the bad call
            values = {**defaults, **dict(zip(positional, args, strict=False)), **kwargs}
            values.update(check(**values) or {})  # a missing or unknown argument raises here
            result = op(*(values[name] for name in op.argument_names))
            return result if returns is None else values[returns]

        checked.op = op
        return checked

    return decorate


def _per_row(op: Op) -> Callable[..., Any]:
    """A vmap rule that calls ``op`` once per row and stacks the results along dim 0."""

    def rule(info: Any, in_dims: Sequence[int | None], *args: Any) -> tuple[Any, Any]:
        def row(b: int | None) -> list[Any]:
            if b is None:  # a zero-filled row, for the output shapes of an empty batch
                return [
                    a if d is None else a.new_zeros(a.shape[:d] + a.shape[d + 1 :])
                    for a, d in zip(args, in_dims, strict=True)
                ]
            return [a if d is None else a.select(d, b) for a, d in zip(args, in_dims, strict=True)]

        count = info.batch_size
        rows = [op(*row(b)) for b in range(count)] if count else [op(*row(None))]
        rows = [r if isinstance(r, tuple) else (r,) for r in rows]
        stacked = tuple(torch.stack(column)[:count] for column in zip(*rows, strict=True))
        if len(stacked) == 1:
            return stacked[0], 0
        return stacked, (0,) * len(stacked)

    return rule


def _per_row_into(op: Op, out_index: int) -> Callable[..., Any]:
    """The vmap rule of an op that writes into its argument ``out_index``: one call per row,
    each writing its row of that argument (which must be batched when any input is)."""

    def rule(info: Any, in_dims: Sequence[int | None], *args: Any) -> tuple[None, None]:
        if in_dims[out_index] is None:
            raise ValueError(f"fn::{op.name}: under vmap, out must be batched like the inputs")
        for b in range(info.batch_size):
            op(*(a if d is None else a.select(d, b) for a, d in zip(args, in_dims, strict=True)))
        return None, None

    return rule
