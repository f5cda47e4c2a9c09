"""The exception fn raises for non-finite values."""

from __future__ import annotations

__all__ = ["NonFiniteError"]


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
