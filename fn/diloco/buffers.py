"""The model's buffers at DiLoCo's outer steps (BatchNorm's running statistics): floating ones
averaged over the workers that take part, the others (``num_batches_tracked``) taken from the
first worker that takes part, so that every worker holds the same buffers after each outer
step, as DDP keeps them consistent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from fn.base import EmptyState
from fn.collectives import Comm, cast_allreduce

__all__ = ["BUFFER_POLICIES", "HEADER_INTS", "Buffers", "CapturedBuffers"]

BUFFER_POLICIES = ("mean", "local")
"""What ``DiLoCo(buffers=...)`` does with the model's buffers at an outer step: ``"mean"`` (the
default) makes them equal on every worker, ``"local"`` keeps each worker's own."""


class CapturedBuffers(NamedTuple):
    """The buffers taken with a fragment's pseudo-gradient: the model's tensors, to write back
    into, and copies of their values at that point."""

    targets: list[torch.Tensor]
    values: list[torch.Tensor]


class Buffers:
    """The buffers of ``model`` under ``policy`` (one of :data:`BUFFER_POLICIES`).

    With ``"mean"``, each outer step's exchange averages the floating buffers over the workers
    that take part, in fp32 (one ``fn.collectives.cast_allreduce`` exchange of all of them over
    the workers, then one over each dimension of a sharded worker's mesh: every rank of every
    worker ends with the same values; identical buffers may move by a rounding), and takes the
    other buffers (integer, bool) from the first worker that takes part (then from the first
    rank of each mesh dimension), in the same exchange's header; every worker, a sitter too,
    continues with them. The values
    are the ones taken with the pseudo-gradient (with a delay, what the ``tau`` steps changed
    in them is dropped, as in the parameters with ``mix=0``); where no worker takes part they
    stay as they are. A worker whose floating buffers hold NaN or Inf (a bad batch in a forward
    whose step was skipped) sits the step out (:meth:`finite`) and takes the others' mean.

    Example:
        >>> from fn.diloco.buffers import Buffers
        >>> Buffers(torch.nn.BatchNorm1d(3), "mean").layout()[2]
        ('num_batches_tracked', (), 'torch.int64')
    """

    def __init__(self, model: nn.Module, policy: str) -> None:
        if policy not in BUFFER_POLICIES:
            raise ValueError(
                f"DiLoCo: buffers must be one of {', '.join(BUFFER_POLICIES)}, got {policy!r}"
            )
        self.model = model
        self.policy = policy
        complex_ones = [name for name, b in model.named_buffers() if b.is_complex()]
        if complex_ones and policy == "mean":
            raise NotImplementedError(
                f"DiLoCo: complex buffers ({', '.join(complex_ones)}) are not averaged; pass "
                "buffers='local'"
            )

    def layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Every buffer's name, shape and dtype (what the workers must agree on)."""
        return [(name, tuple(b.shape), str(b.dtype)) for name, b in self.model.named_buffers()]

    def targets(self) -> list[torch.Tensor]:
        """The buffers an outer step exchanges: the model's non-empty ones under ``"mean"``,
        none under ``"local"``."""
        if self.policy == "local":
            return []
        return [b for b in self.model.buffers() if b.numel() > 0]

    def capture(self) -> CapturedBuffers | None:
        """The buffers now (``None`` where there are no :meth:`targets`)."""
        targets = self.targets()
        if not targets:
            return None
        return CapturedBuffers(targets, [b.detach().clone() for b in targets])

    def captured(self, values: list[torch.Tensor]) -> CapturedBuffers | None:
        """``values`` (one per :meth:`targets`, an in-flight exchange's from a checkpoint) as
        :meth:`capture` returned them when that exchange started."""
        targets = self.targets()
        return CapturedBuffers(targets, values) if targets else None

    def checked(self) -> bool:
        """Whether a worker's buffers can make it sit out (:meth:`finite`): ``"mean"`` and
        floating buffers."""
        return self.policy == "mean" and any(b.is_floating_point() for b in self.model.buffers())

    @staticmethod
    def finite(captured: CapturedBuffers | None, device: torch.device | None) -> torch.Tensor:
        """``[]`` bool on ``device``: whether the captured floating buffers hold only finite
        values (``True`` where none were captured). A worker whose buffers do not sits out,
        so that a bad batch's NaN statistics never reach the others' mean."""
        ok = torch.ones((), dtype=torch.bool, device=device)
        for value in [] if captured is None else captured.values:
            if value.is_floating_point():
                ok = ok & torch.isfinite(value).all().to(device)
        return ok

    @staticmethod
    @torch.no_grad()
    def exchange(
        captured: CapturedBuffers,
        comm: Comm,
        within: Sequence[Comm],
        participants: torch.Tensor,
        worker: int,
    ) -> list[torch.Tensor] | None:
        """The buffers every worker continues with (a collective over ``comm`` and ``within``,
        on the exchange's thread), or ``None`` where no worker took part.

        One ``fn.collectives.cast_allreduce`` exchange over ``comm`` (one collective, or two
        from 3 workers on), then one over each group of ``within``: the floating buffers as its
        values, this worker's participation as its flag, and the other buffers' int64 values
        in its header (two 32-bit halves each; more than ``HEADER_INTS`` of them go in an
        all-gather of their own). A worker whose floating buffers are not finite is left out of
        their mean; where every participant's are, they stay as they are."""
        taking = [bool(x) for x in participants.tolist()]
        if not any(taking):
            return None
        values = captured.values
        floats = [i for i, b in enumerate(values) if b.is_floating_point()]
        others = [i for i, b in enumerate(values) if not b.is_floating_point()]
        device = values[0].device
        ints = torch.cat(
            [values[i].reshape(-1).to(torch.int64) for i in others]
            or [torch.zeros(0, dtype=torch.int64, device=device)]
        )
        means = [values[i].float() for i in floats] or [torch.zeros(1, device=device)]
        flag = torch.tensor(taking[worker], device=device)
        means, ints = _exchanged(comm, means, ints, flag, taking.index(True))
        for group in within:
            means, ints = _exchanged(group, means, ints, torch.tensor(True, device=device), 0)
        out = list(values)
        for i, mean in zip(floats, means, strict=False):  # none: the placeholder dropped
            out[i] = mean.to(values[i].dtype)
        for i, piece in zip(others, ints.split([values[i].numel() for i in others]), strict=True):
            out[i] = piece.view(values[i].shape).to(values[i].dtype)
        return out

    @staticmethod
    @torch.no_grad()
    def write(captured: CapturedBuffers, values: list[torch.Tensor] | None) -> None:
        """Writes ``values`` (from :meth:`exchange`) into the model's buffers."""
        if values is None:
            return
        for target, value in zip(captured.targets, values, strict=True):
            target.copy_(value)


HEADER_INTS = 64
"""The most integer buffer values that ride in the header of the buffers' exchange; more go
in an all-gather of their own (the buffers' layout, which every worker shares, decides)."""


def _exchanged(
    comm: Comm, means: list[torch.Tensor], ints: torch.Tensor, flag: torch.Tensor, source: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``means`` averaged over the ranks of ``comm`` whose ``flag`` is set (kept where none
    with finite values is), and rank ``source``'s ``ints``."""
    riding = ints.numel() <= HEADER_INTS
    halves = ints.view(torch.int32).to(torch.int64) & 0xFFFFFFFF if riding else ints[:0]
    tx = cast_allreduce(comm=comm)
    exchanged = tx.exchange(means, EmptyState(), flag, extra=halves.tolist())
    if bool(exchanged.participants.any()):
        means = exchanged.updates
    if riding:
        halves = exchanged.extra[source]
        chosen = torch.where(halves >= 2**31, halves - 2**32, halves).to(torch.int32)
        chosen = chosen.view(torch.int64)
    else:
        chosen = comm.all_gather(ints)[source]
    return means, chosen.to(ints.device)
