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
from fn.collectives import Comm, Participation, cast_allreduce

__all__ = ["BUFFER_POLICIES", "Buffers", "CapturedBuffers"]

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
    that take part, in fp32 (one ``fn.collectives.cast_allreduce`` of all of them over the
    workers, then one over each dimension of a sharded worker's mesh: every rank of every
    worker ends with the same values; identical buffers may move by a rounding), and takes the
    other buffers (integer, bool) from the first worker that takes part (then from the first
    rank of each mesh dimension); every worker, a sitter too, continues with them. The values
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

    def capture(self) -> CapturedBuffers | None:
        """The buffers now (``None`` with ``"local"`` or none)."""
        targets = [b for b in self.model.buffers() if b.numel() > 0]
        if self.policy == "local" or not targets:
            return None
        return CapturedBuffers(targets, [b.detach().clone() for b in targets])

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
        on the exchange's thread), or ``None`` where no worker took part."""
        taking = [bool(x) for x in participants.tolist()]
        if not any(taking):
            return None
        floats = [i for i, b in enumerate(captured.values) if b.is_floating_point()]
        others = [i for i, b in enumerate(captured.values) if not b.is_floating_point()]
        out = list(captured.values)
        if floats:
            device = captured.values[floats[0]].device
            count = torch.tensor(sum(taking), device=device)
            part = Participation(torch.tensor(taking[worker], device=device), count)
            means = [captured.values[i].float() for i in floats]
            means = cast_allreduce(comm=comm).update(means, EmptyState(), participation=part)[0]
            for group in within:
                means = cast_allreduce(comm=group).update(means, EmptyState())[0]
            for i, mean in zip(floats, means, strict=True):
                out[i] = mean.to(captured.values[i].dtype)
        if others:
            flat = torch.cat([captured.values[i].reshape(-1).to(torch.int64) for i in others])
            chosen = comm.all_gather(flat)[taking.index(True)]
            for group in within:
                chosen = group.all_gather(chosen)[0]
            pieces = chosen.split([captured.values[i].numel() for i in others])
            for i, piece in zip(others, pieces, strict=True):
                out[i] = piece.view(captured.values[i].shape).to(captured.values[i].dtype)
        return out

    @staticmethod
    @torch.no_grad()
    def write(captured: CapturedBuffers, values: list[torch.Tensor] | None) -> None:
        """Writes ``values`` (from :meth:`exchange`) into the model's buffers."""
        if values is None:
            return
        for target, value in zip(captured.targets, values, strict=True):
            target.copy_(value)
