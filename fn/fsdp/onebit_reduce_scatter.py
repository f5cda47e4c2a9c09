"""The reduce-scatter of an FSDP2 module under a 1-bit optimizer: dense in the warmup, the
error-compensated 1-bit allreduce of the module's momentum once compressed (chunk ``j`` rank
``j``'s shard), its result kept full size as packed signs. It never raises inside FSDP2's
backward: what it finds waits for ``step()`` (docs/algorithms.md, "1-bit Adam and 1-bit LAMB
on FSDP2"). Once a collective has failed, the later modules of that backward send nothing over
its group (docs/guides/policies.md, "Failures inside FSDP2's backward")."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fn.collectives import CollectiveTimeoutError, PackedSigns, ProcessGroup, init_error_feedback
from fn.collectives.onebit import (
    compressed_allreduce,
    compressed_allreduce_exchange,
    write_errors,
)
from fn.errors import NonFiniteError
from fn.fsdp._fsdp2 import SynchronousReduceScatter
from fn.fsdp.onebit_layout import ModuleLayout, row_of
from fn.fsdp.onebit_masks import mask_values
from fn.fsdp.reduce_scatter import reduce_scale

__all__ = [
    "CompressedModule",
    "FailedCollectives",
    "OnebitReduceScatter",
    "OnebitReduceScatters",
    "dense_reduce_scatter",
]


class CompressedModule:
    """One module's compressed state on this rank: the momentum (all ``W`` chunks' packed signs
    and scales, ``None`` before the freeze), the worker and server errors, and whether its
    reduce-scatter has run for the coming update."""

    def __init__(self) -> None:
        self.signs: PackedSigns | None = None
        self.errors: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pending = False  # its momentum holds this backward's gradient; step() consumes it


class OnebitReduceScatter(SynchronousReduceScatter):
    """The reduce-scatter of one FSDP2 module under a :class:`ShardedOnebitOptimizer`
    (installed by it): dense in the warmup, the 1-bit allreduce of the momentum once
    compressed."""

    def __init__(self, optimizer: OnebitReduceScatters, layout: ModuleLayout) -> None:
        self.optimizer = optimizer
        self.layout = layout

    def reduce_scatter(self, out: Tensor, x: Tensor, group: dist.ProcessGroup, op: Any) -> None:
        """Writes this rank's shard into ``out`` (see :class:`OnebitAdam`).

        It never raises (FSDP2 stops reduce-scattering after an exception in its backward): a
        problem is recorded, the output filled with NaN, and the next ``step()`` raises it.
        """
        started = time.monotonic()
        try:
            self.optimizer._reduce_scatter(self.layout, out, x, group, op)
        except Exception as problem:  # noqa: BLE001 (every problem goes to step())
            self.optimizer._record(problem, self.layout, started)
            out.fill_(torch.nan)

    def all_reduce_hook(self, output: Tensor) -> None:
        """The same, for HSDP with one rank per node: on a one-rank shard mesh FSDP2 runs no
        reduce-scatter, and its reduce output (``output``, the module's gradient, all of it)
        goes to this hook (``set_all_reduce_hook``), which writes the mean over the nodes (or
        the new momentum) into it."""
        group = self.layout.slots[0].param.device_mesh.get_group(0)
        self.reduce_scatter(output, output.clone(), group, dist.ReduceOp.AVG)


class FailedCollectives:
    """The collectives of one update (a backward and its ``step()``) that failed on this rank:
    their process groups, unusable from then on, and the first one's module and start."""

    def __init__(self) -> None:
        self.groups: list[dist.ProcessGroup | None] = []
        self.first: tuple[str, float] | None = None  # (module, time.monotonic() at its start)
        self.skipped = 0  # the later modules that sent nothing over a failed group

    def add(self, error: CollectiveTimeoutError, module: str, started: float) -> None:
        """Records ``error``, raised by the reduce-scatter of ``module`` started at
        ``started`` (``time.monotonic()``)."""
        self.groups.append(error.group)
        if self.first is None:
            self.first = (module, started)

    def failed(self, comm: ProcessGroup | None) -> bool:
        """Whether a collective over ``comm`` (``None``: no comm) failed in this update."""
        return comm is not None and any(group is comm.group for group in self.groups)

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


class OnebitReduceScatters:
    """The reduce-scatters of a :class:`~fn.fsdp.ShardedOnebitOptimizer` (a part of it: it
    reads the optimizer's ``_comms``, ``_replicas``, ``_rule``, ``_state``, ``_compressed``,
    ``_masks``, ``_problems``, ``_failed``, ``rank``, ``error_dtype`` and ``_b1``, and calls
    its ``_own_row``)."""

    def _record(self, problem: Exception, layout: ModuleLayout, started: float) -> None:
        """Keeps what module ``layout``'s reduce-scatter (started at ``started``) raised for
        ``step()``; a failed collective marks its group as failed for the rest of the update."""
        self._problems.append(problem)
        if isinstance(problem, CollectiveTimeoutError):
            self._failed.add(problem, layout.name, started)

    def _reduce_scatter(
        self,
        layout: ModuleLayout,
        output: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
    ) -> None:
        """The reduce-scatter of one module (:class:`OnebitReduceScatter`). On HSDP (the
        optimizer's ``_replicas``, fn's comm over the replicate group) the shard group's
        dense reduce-scatter is followed by the replicate group's dense mean (warmup) or 1-bit
        allreduce of this rank's row (compressed)."""
        comm = self._comms(group)
        world_size = comm.world_size
        if input_tensor.numel() != world_size * layout.row:  # FSDP2 left a param out
            raise RuntimeError(
                f"{self.name}: module {layout.name} reduce-scatters "
                f"{input_tensor.numel()} values, not the {world_size * layout.row} of all its "
                "trainable params, though every one is asked for "
                "(set_reduce_scatter_unused_params); nothing was updated"
            )
        rows = input_tensor.view(world_size, layout.row)
        replicas = self._replicas
        if self._failed.failed(comm) or self._failed.failed(replicas):
            # A collective of this backward failed on a group, which is unusable after that:
            # each later module would wait out the failure's diagnosis again. On HSDP with the
            # node's group intact its ranks still make the same collectives there, so that
            # step() meets them whichever of them saw the replicate group fail.
            if not self._failed.failed(comm):
                comm.reduce_scatter(rows, "sum")
            self._failed.skipped += 1
            output.fill_(torch.nan)
            return
        if not self._rule.is_compressed(self.count + 1, self._state):
            dense = dense_reduce_scatter(comm, rows, op)
            # across the nodes: the sum, then / N, whatever op FSDP2 asked of the node
            output.copy_(dense if replicas is None else replicas.all_reduce(dense, "mean"))
            return
        held = self._compressed[layout.name]
        if held.pending:
            raise RuntimeError(
                f"{self.name}: module {layout.name} was reduce-scattered twice before "
                "step() in the compressed phase (its momentum takes one gradient an update); "
                "accumulate gradients with set_requires_gradient_sync(False); nothing was "
                "updated"
            )
        momentum = self._previous_momentum(layout, held, comm, input_tensor.device)
        if replicas is not None:  # the node's mean gradient, this rank's row (fp32)
            over = replicas
            grad = torch.zeros_like(momentum)
            grad[: layout.row] = comm.reduce_scatter(rows, "mean")
        elif layout.padded_row == layout.row and input_tensor.dtype == torch.float32:
            over, grad = comm, input_tensor.view(-1)
        else:
            over, grad = comm, torch.zeros_like(momentum)
            grad.view(world_size, layout.padded_row)[:, : layout.row] = rows
        if held.errors is None:
            held.errors = tuple(
                init_error_feedback(
                    momentum.numel(), comm=over, device=momentum.device, dtype=self.error_dtype
                )
            )
        x, grad, beta = self._momentum_input(layout, held, over, momentum, grad)
        try:
            held.signs = self._compressed_mean(held, over, x, grad, beta)
        except NonFiniteError:  # raised on every rank, before anything was written
            raise NonFiniteError(
                f"{self.name}: non-finite values in the momentum of some rank (its local "
                f"gradient) in module {layout.name}; no param changed (the modules "
                "reduce-scattered before it in this backward have advanced their momentum "
                "and errors)"
            ) from None
        held.pending = True
        shard = self._own_row(held.signs).values(layout.row)
        output.copy_(shard.mul_(reduce_scale(op, world_size)))

    def _previous_momentum(
        self, layout: ModuleLayout, held: CompressedModule, comm: ProcessGroup, device: torch.device
    ) -> torch.Tensor:
        """The module's momentum before this update, flat in the layout of ``X`` (on HSDP:
        this rank's row of it), zero at its padding positions: unpacked from its signs, or at
        the freeze from the shards' warmup momentum (all-gathered on a 1-D mesh; on HSDP the
        row is this rank's own)."""
        hsdp = self._replicas is not None
        if held.signs is None:
            row = row_of(layout, self._state.exp_avg, device)
            return row if hsdp else comm.all_gather(row).view(-1)
        first, count = (self.rank, 1) if hsdp else (0, comm.world_size)
        momentum = held.signs.values(count * layout.padded_row).clone()
        for j in range(count):
            base = j * layout.padded_row
            for start, stop in layout.row_padding(first + j):
                momentum[base + start : base + stop] = 0.0
        mask = self._masks[layout.name]
        if mask is not None:  # the rule's momentum: the allreduce's result times the mask
            momentum.mul_(mask_values(mask, first * layout.padded_row, momentum.numel()))
        return momentum

    def _compressed_mean(
        self,
        held: CompressedModule,
        comm: ProcessGroup,
        x: torch.Tensor,
        grad: torch.Tensor | None,
        beta: float,
    ) -> PackedSigns:
        """The 1-bit allreduce of a module's compressed vector (``beta x + (1 - beta) grad``
        with ``grad``, else ``x``), its errors written into ``held`` after every rank's check:
        the in-place exchange for fp32 and bf16 errors, the allocating collective (which
        rounds the fp16 errors once) for fp16 ones.

        Raises:
            fn.NonFiniteError: on every rank, with nothing written.
        """
        if self.error_dtype == torch.float16:
            if grad is not None:  # rounded as the rule's moving average
                x = (beta * x).add_((1 - beta) * grad)
            mean, *errors = compressed_allreduce(x, *held.errors, comm=comm, packed=True)
            held.errors = tuple(errors)
            return mean
        exchange = compressed_allreduce_exchange(x, *held.errors, comm=comm, grad=grad, beta=beta)
        if exchange is None:  # not on this path's tensors (e.g. under torch.compile)
            raise NotImplementedError(
                f"{self.name}: the 1-bit exchange runs eagerly on contiguous fp32 tensors"
            )
        write_errors(exchange, *held.errors)
        return PackedSigns(exchange.packed, exchange.scales)

    def _momentum_input(
        self,
        layout: ModuleLayout,
        held: CompressedModule,
        comm: ProcessGroup,
        momentum: torch.Tensor,
        grad: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """What a module compresses, from its momentum before this update
        (:meth:`_previous_momentum`) and this rank's gradient, both flat in the layout of
        ``X``: ``(x, grad, beta)`` for :meth:`_compressed_mean`. 1-bit Adam's: the momentum
        ``b1 m + (1 - b1) g_r``, formed inside the exchange."""
        return momentum, grad, self._b1


def dense_reduce_scatter(comm: ProcessGroup, rows: torch.Tensor, op: Any) -> torch.Tensor:
    """``dist.reduce_scatter_tensor``'s result for ``op``: the sum of the ranks' rows (fn's
    ``ProcessGroup``), divided by ``W`` for ``AVG``, times ``f`` for ``PREMUL_SUM(f)``."""
    total = comm.reduce_scatter(rows, "sum")
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return total / comm.world_size
    if kind == dist.ReduceOp.PREMUL_SUM:
        return total * op.factor
    if kind == dist.ReduceOp.SUM:
        return total
    raise ValueError(f"op must be ReduceOp.AVG, SUM or PREMUL_SUM, got {kind}")
