"""The reduce-scatter that a 1-bit optimizer installs on an FSDP2 module: each micro-batch's
gradient goes to the module's :class:`~fn.fsdp.onebit_module.OnebitModule`, which accumulates
it until ``step()``. It never raises inside FSDP2's backward: what it finds waits for
``step()`` (docs/algorithms.md, "1-bit Adam and 1-bit LAMB on FSDP2")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fn.collectives import ProcessGroup
from fn.fsdp._fsdp2 import SynchronousReduceScatter
from fn.fsdp.onebit_module import OnebitModule

__all__ = ["OnebitReduceScatter"]


class OnebitReduceScatter(SynchronousReduceScatter):
    """The reduce-scatter of one FSDP2 module under a 1-bit optimizer (installed by it).

    Args:
        module: the module's state on this rank.
        comms: fn's comm of an FSDP2 process group.
        compressed: whether the coming update is compressed (asked at every call).
        problems: where a problem found inside the backward goes, for ``step()``.
    """

    def __init__(
        self,
        module: OnebitModule,
        comms: Callable[[dist.ProcessGroup], ProcessGroup],
        compressed: Callable[[], bool],
        problems: list[Exception],
    ) -> None:
        self.module = module
        self.comms = comms
        self.compressed = compressed
        self.problems = problems

    def reduce_scatter(self, out: Tensor, x: Tensor, group: dist.ProcessGroup, op: Any) -> None:
        """Writes this rank's shard into ``out`` (:meth:`OnebitModule.reduce_scatter`).

        It never raises (FSDP2 stops reduce-scattering after an exception in its backward): a
        problem is recorded, the output filled with NaN, and the next ``step()`` raises it.
        """
        try:
            self.module.reduce_scatter(out, x, self.comms(group), op, self.compressed())
        except Exception as problem:  # noqa: BLE001 (every problem goes to step())
            self.problems.append(problem)
            out.fill_(torch.nan)

    def all_reduce_hook(self, output: Tensor) -> None:
        """HSDP with one rank per node: on a one-rank shard mesh FSDP2 runs no reduce-scatter,
        and its reduce output (``output``, the module's whole gradient: the node's) goes to
        this hook (``set_all_reduce_hook``) and then to ``.grad``, where it accumulates until
        ``step()`` averages it over the nodes."""
        del output
        self.module.received = True
