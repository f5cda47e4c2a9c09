"""Error feedback as a type: what a compressed collective carries from one call to the next.

Compressed collectives (the 1-bit allreduce, LoCo's quantized allreduce) keep, per rank, the part
of each message that compression lost and add it back into the next one. These buffers are
sized by the world size and belong to one rank, so whoever stores or restores a state (the
``torch.optim`` adapter, a checkpoint loader) must treat them differently from the rest: reset
them when the world size changes, never hand one rank's buffers to another.

Two ways mark a part of a state as error feedback, and both are read from types, not names:

- a value of type :class:`ErrorFeedback` (``init_error_feedback`` returns one);
- a state field annotated with :data:`ErrorFeedbackField` in its ``NamedTuple`` class, for
  states that keep the worker and server buffers as separate fields or per leaf::

      class MyState(NamedTuple):
          count: torch.Tensor
          residual: ErrorFeedbackField  # any pytree of buffers

:func:`error_feedback_leaves` finds both.

Most error feedback is laid out by the rank's place among ``W`` ranks: padded to a multiple of
``W``, or the chunk of the mean that rank ``r`` owns. It is meaningless once ``W`` or the rank
changes. Error feedback laid out as the params instead (top-k's accumulator: what this rank has
not sent of each value) is annotated :data:`ParamShapedErrorFeedbackField` and may carry over;
:func:`positional_leaves` finds the rest, for whoever re-lays a state out for other workers
(``fn.integrations.torchft.ElasticDiLoCo`` at a change of its quorum).
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from fn.base import marked_fields
from fn.tree import PyTree

__all__ = [
    "ErrorFeedback",
    "ErrorFeedbackField",
    "LaidOutAsParams",
    "ParamShapedErrorFeedbackField",
    "error_feedback_leaves",
    "positional_leaves",
]


class ErrorFeedback(NamedTuple):
    """The error-feedback buffers of one error-compensated 1-bit allreduce.

    Attributes:
        worker: ``e_w``, fp32[N]: what compressing this rank's input lost.
        server: ``e_s``, fp32[N / W]: what compressing this rank's chunk of the average lost.

    Example:
        >>> errors = fn.collectives.init_error_feedback(10, comm=fn.collectives.Simulated(2))
        >>> type(errors).__name__, errors.worker.shape, errors.server.shape
        ('ErrorFeedback', torch.Size([16]), torch.Size([8]))
        >>> fn.collectives.error_feedback_leaves(errors)
        [True, True]
    """

    worker: torch.Tensor
    server: torch.Tensor


ErrorFeedbackField = Annotated[PyTree, ErrorFeedback]
"""The annotation of a state field whose pytree holds error-feedback buffers.

Example:
    >>> from typing import NamedTuple
    >>> from fn.collectives import ErrorFeedbackField, error_feedback_leaves
    >>> class MyState(NamedTuple):
    ...     count: torch.Tensor
    ...     residual: ErrorFeedbackField
    >>> error_feedback_leaves(MyState(torch.zeros(()), {"w": torch.zeros(4)}))
    [False, True]
"""


class LaidOutAsParams:
    """The mark of error feedback laid out as the params: see
    :data:`ParamShapedErrorFeedbackField`.

    Example:
        >>> field = fn.collectives.ParamShapedErrorFeedbackField
        >>> fn.collectives.LaidOutAsParams in field.__metadata__
        True
    """


ParamShapedErrorFeedbackField = Annotated[PyTree, ErrorFeedback, LaidOutAsParams]
"""The annotation of a state field of error feedback laid out as the params, the same whatever
the number of ranks and this rank's place among them: error feedback (found by
:func:`error_feedback_leaves`) that :func:`positional_leaves` leaves out.

Example:
    >>> from typing import NamedTuple
    >>> from fn.collectives import (
    ...     ErrorFeedbackField, ParamShapedErrorFeedbackField, positional_leaves)
    >>> class MyState(NamedTuple):
    ...     accumulator: ParamShapedErrorFeedbackField
    ...     owned: ErrorFeedbackField
    >>> positional_leaves(MyState({"w": torch.zeros(4)}, torch.zeros(2)))
    [False, True]
"""


def _mark(node: Any, inside: bool, mark: type) -> Any:
    """``node`` with every leaf replaced by whether it lies in a part marked ``mark``: a field
    annotated with it, or (for :class:`ErrorFeedback`) a value of that type."""
    inside = inside or isinstance(node, mark)
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        marked = marked_fields(type(node), mark)
        return type(node)(
            *(_mark(getattr(node, f), inside or f in marked, mark) for f in node._fields)
        )
    if pytree.tree_is_leaf(node):
        return inside
    children, spec = pytree.tree_flatten(node, is_leaf=lambda x: x is not node)
    return pytree.tree_unflatten([_mark(c, inside, mark) for c in children], spec)


def error_feedback_leaves(state: PyTree) -> list[bool]:
    """Which leaves of ``state`` are error feedback, in ``torch.utils._pytree`` leaf order.

    Args:
        state: an optimizer or collective state (a pytree of NamedTuples, tuples, dicts).

    Returns:
        One bool per leaf of ``pytree.tree_leaves(state)``, ``True`` for a leaf inside an
        :class:`ErrorFeedback` value or a field annotated :data:`ErrorFeedbackField`.

    Example:
        >>> import fn
        >>> opt = fn.onebit_adam(lr=1e-3, freeze_step=10, comm=fn.collectives.Local())
        >>> state = opt.init({"w": torch.zeros(3)})
        >>> fn.collectives.error_feedback_leaves(state)  # count, lr, m, v, the errors, auto
        [False, False, False, False, True, True, False]
    """
    return pytree.tree_leaves(_mark(state, False, ErrorFeedback))


def positional_leaves(state: PyTree) -> list[bool]:
    r"""Which leaves of ``state`` are error feedback laid out by this rank's place among the
    ranks: all of it but the fields annotated :data:`ParamShapedErrorFeedbackField`.

    .. math::
        \text{positional}_i = \text{feedback}_i \wedge \neg\,\text{param-shaped}_i

    Args:
        state: an optimizer or collective state.

    Returns:
        One bool per leaf of ``pytree.tree_leaves(state)``.

    Example:
        >>> comm = fn.collectives.Simulated(2)
        >>> owner = fn.collectives.topk_allreduce(2, 8, comm=comm, exchange="owner")
        >>> fn.collectives.positional_leaves(owner.init({"w": torch.zeros(20)}))
        [False, True]
        >>> fn.collectives.positional_leaves(fn.collectives.onebit_allreduce(comm=comm).init(
        ...     {"w": torch.zeros(3)}))
        [True, True]
    """
    feedback = error_feedback_leaves(state)
    shaped = pytree.tree_leaves(_mark(state, False, LaidOutAsParams))
    return [f and not s for f, s in zip(feedback, shaped, strict=True)]
