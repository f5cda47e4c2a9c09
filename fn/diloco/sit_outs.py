"""The workers' sit-outs: counted per worker from the agreed participants, so that every rank
counts, warns and raises alike (docs/guides/diloco.md, "When a worker fails")."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from fn.errors import check_int, user_stacklevel

__all__ = ["SitOuts"]


class SitOuts:
    """Each worker's sit-outs, in all and in a row.

    Args:
        workers: ``W``.
        max_sit_outs: the sit-outs in a row that raise (``None``: never).
        buffers: whether a worker's buffers can make it sit out too (``DiLoCo(buffers="mean")``
            with floating buffers), for the messages.

    Attributes:
        total: per worker, the outer steps it sat out.
        in_a_row: per worker, the outer steps it sat out since it last took part.

    Example:
        >>> from fn.diloco.sit_outs import SitOuts
        >>> sit_outs = SitOuts(2, max_sit_outs=None)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     sit_outs.record([True, False], "the outer step", "its state was reset")
        >>> sit_outs.total, len(caught)
        ([0, 1], 1)
    """

    def __init__(self, workers: int, max_sit_outs: int | None, *, buffers: bool = False) -> None:
        if max_sit_outs is not None:
            check_int("DiLoCo: max_sit_outs", max_sit_outs, minimum=1)
        self.max_sit_outs = max_sit_outs
        self._checked = (
            "its pseudo-gradient, its inner optimizer's state or its buffers"
            if buffers
            else "its pseudo-gradient or its inner optimizer's state"
        )
        self.total = [0] * workers
        self.in_a_row = [0] * workers

    def record(self, participants: Sequence[bool], step: str, reset: str) -> None:
        """Counts an outer step's sit-outs; where some worker sat out, warns (``RuntimeWarning``,
        the same text on every rank) naming the workers, ``step`` and what the sitters lost
        (``reset``: what became of the inner optimizer's state); where one sat out
        ``max_sit_outs`` steps in a row, raises.

        Raises:
            RuntimeError: a worker sat out ``max_sit_outs`` outer steps in a row.
        """
        sitters = [w for w, taking in enumerate(participants) if not taking]
        for w, taking in enumerate(participants):
            self.total[w] += not taking
            self.in_a_row[w] = 0 if taking else self.in_a_row[w] + 1
        if not sitters:
            return
        warnings.warn(
            _message(sitters, len(participants), step, reset, self._checked),
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        limit = self.max_sit_outs
        over = [w for w in sitters if limit is not None and self.in_a_row[w] >= limit]
        if over:
            raise RuntimeError(
                f"DiLoCo: worker(s) {', '.join(map(str, over))} sat out {limit} outer steps in "
                f"a row (max_sit_outs={limit}): each time {self._checked} held NaN or Inf, so "
                "it no longer trains with the others. "
                "Every rank raises this once the step is applied: the anchor and the parameters "
                "are consistent. Check that worker's data, inner learning rate and loss scale, "
                "or pass max_sit_outs=None to go on"
            )

    def counts(self) -> dict[str, list[int]]:
        """The counts, for a state dict."""
        return {"sat_out": list(self.total), "sit_outs_in_a_row": list(self.in_a_row)}

    def load(self, counts: Mapping[str, Any]) -> None:
        """Restores :meth:`counts` (zeros where absent: a checkpoint of an older fn, or of
        another number of workers)."""
        workers = len(self.total)
        for name, attribute in (("sat_out", "total"), ("sit_outs_in_a_row", "in_a_row")):
            saved = counts.get(name)
            setattr(self, attribute, list(saved) if len(saved or ()) == workers else [0] * workers)


def _message(sitters: list[int], workers: int, step: str, reset: str, checked: str) -> str:
    if len(sitters) == workers:
        return (
            f"DiLoCo: every worker sat out {step} (on each one, {checked} held NaN or Inf, or "
            "the mean of their pseudo-gradients or its outer update overflowed): the step was "
            "skipped, the anchor and the outer state unchanged; every worker lost its "
            "inner steps since its last outer step (its parameters were reset to the anchors), "
            f"and {reset}"
        )
    names = ", ".join(map(str, sitters))
    return (
        f"DiLoCo: worker(s) {names} sat out {step} ({checked} held NaN or Inf): the mean of "
        f"the other {workers - len(sitters)} worker(s) was applied. Worker(s) {names} lost the "
        "inner steps since the last outer step (the parameters were reset to the anchors), "
        f"{reset}, and the error feedback was kept"
    )
