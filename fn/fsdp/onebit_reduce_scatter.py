"""The reduce-scatter that a 1-bit optimizer installs on an FSDP2 module: each micro-batch's
gradient goes to the module's ``OnebitModule`` (``fn/fsdp/onebit_module.py``), which accumulates
it until ``step()``. It never raises inside FSDP2's backward: what it finds waits for
``step()`` (docs/algorithms.md, "1-bit Adam and 1-bit LAMB on FSDP2"). Once a collective has
failed, the later modules of that backward send nothing over its group
(docs/guides/policies.md, "Failures inside FSDP2's backward")."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fn.collectives import CollectiveTimeoutError, ProcessGroup
from fn.fsdp._fsdp2 import SynchronousReduceScatter
from fn.fsdp.onebit_module import OnebitModule

__all__ = ["FailedCollectives", "OnebitReduceScatter"]


class FailedCollectives:
    """The collectives of one backward that failed on this rank: their process groups,
    unusable from then on, and the first one's module and start.

    Attributes:
        groups: the process groups of the failed collectives.
        first: ``(module, time.monotonic() at the start of its reduce-scatter)`` of the first
            failure, or ``None``.
        skipped: the later modules that sent nothing over a failed group.
    """

    def __init__(self) -> None:
        self.groups: list[dist.ProcessGroup | None] = []
        self.first: tuple[str, float] | None = None
        self.skipped = 0

    def add(self, error: CollectiveTimeoutError, module: str, started: float) -> None:
        """Records ``error``, raised by the reduce-scatter of ``module`` started at
        ``started`` (``time.monotonic()``)."""
        self.groups.append(error.group)
        if self.first is None:
            self.first = (module, started)

    def failed(self, comm: ProcessGroup) -> bool:
        """Whether a collective over ``comm``'s group failed in this backward."""
        return any(group is comm.group for group in self.groups)

    def take(self) -> FailedCollectives:
        """What was recorded, as a new record; this one starts over (``step()`` takes it)."""
        taken = FailedCollectives()
        taken.groups, taken.first, taken.skipped = self.groups, self.first, self.skipped
        self.__init__()
        return taken

    def dated(self, error: Exception) -> Exception:
        """``error``, the first a module recorded: a failed collective's message then ends
        with the seconds since that module's reduce-scatter started (its own count stops at
        its diagnosis) and the modules that sent nothing after it."""
        if self.first is None or not isinstance(error, CollectiveTimeoutError):
            return error
        module, started = self.first
        error.args = (
            f"{error.args[0]}; step() raises it {time.monotonic() - started:.1f} s after the "
            f"reduce-scatter of module {module} started (the {self.skipped} later module(s) of "
            "that backward sent nothing over the failed group; nothing was updated)",
        )
        return error


class OnebitReduceScatter(SynchronousReduceScatter):
    """The reduce-scatter of one FSDP2 module under a 1-bit optimizer (installed by it).

    Args:
        module: the module's state on this rank.
        comms: fn's comm of an FSDP2 process group.
        compressed: whether the coming update is compressed (asked at every call).
        problems: where a problem found inside the backward goes, for ``step()``.
        failed: the backward's failed collectives, shared by the model's reduce-scatters.
    """

    def __init__(
        self,
        module: OnebitModule,
        comms: Callable[[dist.ProcessGroup], ProcessGroup],
        compressed: Callable[[], bool],
        problems: list[Exception],
        failed: FailedCollectives,
    ) -> None:
        self.module = module
        self.comms = comms
        self.compressed = compressed
        self.problems = problems
        self.failed = failed

    def reduce_scatter(self, out: Tensor, x: Tensor, group: dist.ProcessGroup, op: Any) -> None:
        """Writes this rank's shard into ``out`` (``OnebitModule.reduce_scatter``).

        It never raises (FSDP2 stops reduce-scattering after an exception in its backward): a
        problem is recorded, the output filled with NaN, and the next ``step()`` raises it.
        After a failed collective on ``group`` in this backward it sends nothing (each module
        would otherwise wait out the failure's diagnosis again).
        """
        comm = self.comms(group)
        self.module.count_backward()
        if self.failed.failed(comm):
            self.failed.skipped += 1
            out.fill_(torch.nan)
            return
        started = time.monotonic()
        try:
            self.module.reduce_scatter(out, x, comm, op, self.compressed())
        except Exception as problem:  # noqa: BLE001 (every problem goes to step())
            self.problems.append(problem)
            if isinstance(problem, CollectiveTimeoutError):
                self.failed.add(problem, self.module.layout.name, started)
            out.fill_(torch.nan)

    def all_reduce_hook(self, output: Tensor) -> None:
        """A one-rank shard mesh (one rank alone, or HSDP with one rank per node): FSDP2 runs no
        reduce-scatter, and its reduce output (``output``, the module's whole gradient: on
        HSDP the node's) goes to this hook (``set_all_reduce_hook``) and then to ``.grad``,
        where it accumulates until ``step()`` (which on HSDP averages it over the nodes); the
        hook counts the backward."""
        del output
        self.module.count_backward()
