"""Streaming DiLoCo's host-side decisions: which parameters form each fragment, and what happens
to which fragment after inner step ``t``. Pure functions of the settings and ``t``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

from fn.errors import check_int

__all__ = ["StreamPlan", "StreamSchedule", "balanced_fragments", "fragment_indices"]


class StreamPlan(NamedTuple):
    """What :class:`fn.diloco.DiLoCo` does after one inner step; both ``None`` on most steps.

    Attributes:
        starts: the fragment whose pseudo-gradient is taken and whose exchange starts, or
            ``None``.
        applies: the fragment whose exchange result is applied, or ``None``. Where both are set
            (``delay=0``) they are the same fragment, started then applied.

    Example:
        >>> from fn.diloco.streaming import StreamSchedule
        >>> StreamSchedule(sync_every=4, fragments=2, delay=1).plan(3)
        StreamPlan(starts=1, applies=None)
    """

    starts: int | None
    applies: int | None


class StreamSchedule(NamedTuple):
    """The schedule of ``P`` fragments with outer steps every ``H`` inner steps and delay ``tau``.

    Fragment ``p`` is applied after the inner steps ``t`` with ``t = (p + 1) H / P (mod H)``
    and its exchange starts ``tau`` steps earlier, after step ``t - tau``. ``H`` must be a
    multiple of ``P`` and ``0 <= tau < H / P``, so that one exchange ends before the next
    starts. ``P = 1, tau = 0`` is DiLoCo: one outer step after every ``H``-th inner step.

    Attributes:
        sync_every: ``H``.
        fragments: ``P``.
        delay: ``tau``.

    Example:
        >>> from fn.diloco.streaming import StreamSchedule
        >>> schedule = StreamSchedule(sync_every=6, fragments=3, delay=1).checked()
        >>> [(t, *schedule.plan(t)) for t in range(1, 7) if schedule.plan(t) != (None, None)]
        [(1, 0, None), (2, None, 0), (3, 1, None), (4, None, 1), (5, 2, None), (6, None, 2)]
    """

    sync_every: int
    fragments: int
    delay: int

    def checked(self) -> StreamSchedule:
        """The schedule, checked.

        Raises:
            ValueError: ``H`` or ``P`` below 1, ``H`` not a multiple of ``P``, or ``tau``
                outside ``[0, H / P)``, naming the values.
        """
        check_int("DiLoCo: sync_every", self.sync_every, minimum=1)
        check_int("DiLoCo: fragments", self.fragments, minimum=1)
        check_int("DiLoCo: delay", self.delay, minimum=0)
        if self.sync_every % self.fragments:
            raise ValueError(
                f"DiLoCo: sync_every ({self.sync_every}) must be a multiple of the number of "
                f"fragments ({self.fragments}): one fragment syncs every sync_every / fragments "
                "inner steps"
            )
        if self.delay >= self.stride:
            raise ValueError(
                f"DiLoCo: delay ({self.delay}) must be below sync_every / fragments "
                f"({self.stride}), so that one fragment's exchange ends before the next starts"
            )
        return self

    @property
    def stride(self) -> int:
        """``H / P``: inner steps between two fragments' outer steps."""
        return self.sync_every // self.fragments

    def plan(self, t: int) -> StreamPlan:
        """The plan after inner step ``t`` (counted from 1)."""
        return StreamPlan(self._due(t + self.delay), self._due(t))

    def _due(self, t: int) -> int | None:
        """The fragment applied after step ``t``, if any."""
        phase = t % self.sync_every
        if t < 1 or phase % self.stride:
            return None
        return (phase // self.stride - 1) % self.fragments


def balanced_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Splits ``len(sizes)`` tensors, in order, into ``fragments`` contiguous runs of about equal
    element counts.

    The ``k``-th boundary is the prefix whose element count is nearest ``k / P`` of the total
    (ties to the shorter prefix), with at least one tensor in every run.

    Args:
        sizes: the tensors' element counts, in order.
        fragments: ``P``, at most ``len(sizes)``.

    Returns:
        ``P`` lists of indices into ``sizes``, each a contiguous run, together ``0 .. n - 1``.

    Raises:
        ValueError: fewer tensors than fragments.

    Example:
        >>> from fn.diloco.streaming import balanced_fragments
        >>> balanced_fragments([12, 3, 3, 6, 6, 6], 3)  # 12 values each
        [[0], [1, 2, 3], [4, 5]]
    """
    n = len(sizes)
    if fragments > n:
        raise ValueError(
            f"DiLoCo: fragments={fragments}, but the model has {n} trainable parameter "
            "tensor(s); a fragment holds whole tensors"
        )
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    total, bounds = prefix[-1], [0]
    for k in range(1, fragments):
        candidates = range(bounds[-1] + 1, n - (fragments - k) + 1)
        bounds.append(min(candidates, key=lambda b: abs(fragments * prefix[b] - k * total)))
    bounds.append(n)
    return [list(range(lo, hi)) for lo, hi in itertools.pairwise(bounds)]


def fragment_indices(
    params: Sequence[Any], fragments: int | Sequence[Sequence[Any]]
) -> list[list[int]]:
    """The fragments as lists of indices into ``params``.

    Args:
        params: the trainable parameters, in ``model.parameters()`` order.
        fragments: ``P`` (:func:`balanced_fragments` by element count), or lists of parameters
            (each of ``params`` in exactly one list, no list empty); each fragment's
            parameters are taken in ``params`` order.

    Returns:
        One sorted list of indices per fragment.

    Raises:
        ValueError: a list names a tensor that is not one of ``params``, names one twice, is
            empty, or leaves some of ``params`` out; or ``P`` is out of range.

    Example:
        >>> from fn.diloco.streaming import fragment_indices
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> params = list(model.parameters())
        >>> fragment_indices(params, [[model[1].weight, model[0].weight], [model[0].bias,
        ...     model[1].bias]])
        [[0, 2], [1, 3]]
    """
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        check_int("DiLoCo: fragments", fragments, minimum=1)
        return balanced_fragments([p.numel() for p in params], fragments)
    if isinstance(fragments, (str, bytes)) or not isinstance(fragments, Sequence):
        raise ValueError(
            f"DiLoCo: fragments must be an int or a list of lists of parameters, got "
            f"{type(fragments).__name__}"
        )
    index = {id(p): i for i, p in enumerate(params)}
    owner: dict[int, int] = {}
    out = []
    for f, group in enumerate(fragments):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or not group:
            raise ValueError(f"DiLoCo: fragment {f} must be a non-empty list of parameters")
        for p in group:
            i = index.get(id(p))
            if i is None:
                raise ValueError(
                    f"DiLoCo: fragment {f} holds a tensor of shape {tuple(p.shape)} that is not "
                    "one of the model's trainable parameters"
                )
            if i in owner:
                raise ValueError(
                    f"DiLoCo: parameter {i} (shape {tuple(params[i].shape)}) is in fragments "
                    f"{owner[i]} and {f}; each parameter belongs to one fragment"
                )
            owner[i] = f
        out.append(sorted(index[id(p)] for p in group))
    missing = [i for i in range(len(params)) if i not in owner]
    if missing:
        raise ValueError(
            f"DiLoCo: the fragments leave out parameter(s) {missing} (in model.parameters() "
            "order, trainable only); every trainable parameter belongs to one fragment"
        )
    return out
