"""Classes that take a factory's hyperparameters, declared once, in the factory.

``fn.optim`` and ``fn.fsdp`` wrap each 1-bit factory of ``fn.transforms`` in a class whose
constructor takes the factory's hyperparameters (DeepSpeed's names, in the factory's order, with
its defaults) plus options of its own. Such a class holds a ``__signature__`` built by
:func:`signature_with` from the factory's, which ``help()``, ``inspect.signature`` and the API
reference show, and its constructor binds its arguments to it with :func:`bind_arguments`. The
defaults cannot drift apart: there is one copy of them.

Example:
    >>> import inspect
    >>> def factory(lr=1e-3, betas=(0.9, 0.999), *, comm=None):
    ...     ...
    >>> class Optimizer:
    ...     __signature__ = signature_with(
    ...         factory, "params", inspect.Parameter("flatten", inspect.Parameter.KEYWORD_ONLY,
    ...                                              default=True), leave_out=("comm",))
    ...     def __init__(self, *args, **kwargs):
    ...         self.arguments = bind_arguments("Optimizer", self.__signature__, args, kwargs)
    >>> inspect.signature(Optimizer)
    <Signature (params, lr=0.001, betas=(0.9, 0.999), *, flatten=True)>
    >>> Optimizer(["w"], 0.1).arguments
    {'params': ['w'], 'lr': 0.1, 'betas': (0.9, 0.999), 'flatten': True}
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection
from typing import Any

__all__ = ["bind_arguments", "option", "signature_with"]


def option(name: str, default: Any, annotation: str, keyword: bool = True) -> inspect.Parameter:
    """One of a class's own options, for :func:`signature_with`: keyword-only (``keyword``),
    else positional or keyword.

    Example:
        >>> option("flatten", True, "bool")
        <Parameter "flatten: 'bool' = True">
    """
    kind = inspect.Parameter.KEYWORD_ONLY if keyword else inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Parameter(name, kind, default=default, annotation=annotation)


def signature_with(
    factory: Callable[..., Any],
    first: str,
    *own: inspect.Parameter,
    leave_out: Collection[str] = (),
) -> inspect.Signature:
    """The signature of a class that takes ``factory``'s hyperparameters and options of its own.

    Args:
        factory: the function whose parameters the class takes.
        first: the name of the class's first, required argument (``"params"``, ``"model"``).
        own: the class's own parameters; one named like one of ``factory``'s takes its place
            (another kind, default or annotation), the others come after ``factory``'s of
            their kind.
        leave_out: names of ``factory``'s parameters the class does not take.

    Returns:
        ``first``, then the positional-or-keyword parameters, then the keyword-only ones, each
        in ``factory``'s order; no return annotation.
    """
    ours = {p.name: p for p in own}
    factory_parameters = inspect.signature(factory).parameters.values()
    merged = [ours.pop(p.name, p) for p in factory_parameters if p.name not in leave_out]
    merged += ours.values()
    merged.sort(key=lambda p: p.kind)  # stable: each kind keeps its order
    head = inspect.Parameter(first, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([head, *merged])


def bind_arguments(
    name: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A constructor's arguments bound to its class's signature, defaults filled in.

    Args:
        name: the class's public name, for the error.
        signature: the class's ``__signature__`` (from :func:`signature_with`).
        args, kwargs: the constructor's arguments (without ``self``).

    Returns:
        Every parameter's value, by name, in the signature's order.

    Raises:
        TypeError: arguments that do not fit the signature, naming the class.
    """
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{name}: {err}") from None
    bound.apply_defaults()
    return dict(bound.arguments)
