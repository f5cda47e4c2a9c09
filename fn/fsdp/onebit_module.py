"""One FSDP2 module under a 1-bit optimizer, on this rank: its compressed state (the packed
momentum and the errors, its ``exp_avg_mask`` as bits) and the gradient its micro-batches
accumulate until ``step()``, as FSDP2 keeps an ``FSDPParamGroup`` per module
(docs/algorithms.md, "1-bit Adam and 1-bit LAMB on FSDP2", and its section on accumulation).

Each backward of a micro-batch calls ``OnebitModule.reduce_scatter``; ``step()`` then makes
the update's one exchange across the ranks that hold different gradients (the 1-D mesh's
ranks, or on HSDP the nodes): ``OnebitModule.exchange``. So the bytes an update sends
across nodes do not depend on how many micro-batches it accumulates.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fn import kernels
from fn.collectives import PackedSigns, ProcessGroup, init_error_feedback, local_shard
from fn.collectives.onebit import (
    compressed_allreduce,
    compressed_allreduce_exchange,
    write_errors,
)
from fn.fsdp.onebit_layout import ModuleLayout, row_of
from fn.fsdp.onebit_masks import mask_values, shard_masks
from fn.fsdp.onebit_mesh import ShardMesh
from fn.fsdp.reduce_scatter import reduce_scale

__all__ = ["OnebitModule", "dense_reduce_scatter"]


class OnebitModule:
    """One FSDP2 module's state under a 1-bit optimizer, on this rank: everything the optimizer
    keeps of it (its layout of ``X``, its packed momentum and errors, its ``exp_avg_mask`` as
    bits, ``exp_avg_mask="auto"``'s record of zero gradients, and the gradient its
    micro-batches accumulate).

    The gradient of an update accumulates over its micro-batches where it is linear to do so:

    - in the warmup, and on HSDP in both phases, the reduce-scatter inside the shard group is
      dense, and its output accumulates in FSDP2's own ``.grad`` shards (on HSDP: the node's
      gradient, this rank's row of it);
    - on a 1-D mesh in the compressed phase, the 1-bit allreduce needs this rank's whole local
      gradient: it accumulates here, full size (``W S'`` values of ``accumulate_dtype``), and
      ``.grad`` receives this rank's row of it.

    Args:
        layout: the module's layout of ``X``.
        mesh: the optimizer's mesh (``fn/fsdp/onebit_mesh.py``: 1-D or HSDP).
        rank: this rank in the shard group.
        accumulate_dtype: the dtype of the 1-D local gradient (``torch.float32`` or
            ``torch.bfloat16``).
        mask: its ``exp_avg_mask`` as bits in the layout of ``X`` (1: kept), or ``None``.
        record: ``exp_avg_mask="auto"`` until the freeze: this rank's row of ``X`` as bits, 1
            where the mean gradient was exactly 0 at every warmup update so far (padding
            positions 1); ``None`` otherwise.

    Attributes:
        layout: its layout of ``X``.
        backwards: the backwards that reduce-scattered it since the last ``step()`` (its
            micro-batches; with ``set_requires_gradient_sync(False)`` only the synchronized ones).
        local_gradient: the 1-D compressed phase's accumulated local gradient, ``[W, S']``, or
            ``None``.

    Example:
        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> from fn.fsdp.onebit_layout import fsdp_modules, module_layout
        >>> from fn.fsdp.onebit_mesh import ShardMesh
        >>> from fn.fsdp.onebit_module import OnebitModule
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(2, 1), mesh=init_device_mesh("cpu", (1,)))
        >>> (name, params), = fsdp_modules(model)
        >>> mesh = ShardMesh(fn.collectives.ProcessGroup())
        >>> module = OnebitModule(module_layout(name, params, 1), mesh, rank=0)
        >>> module.received, module.signed
        (False, False)
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        layout: ModuleLayout,
        mesh: ShardMesh,
        *,
        rank: int,
        accumulate_dtype: torch.dtype = torch.float32,
        mask: torch.Tensor | None = None,
        record: torch.Tensor | None = None,
    ) -> None:
        self.layout = layout
        self.mesh = mesh
        self.rank = rank
        self.accumulate_dtype = accumulate_dtype
        self._signs: PackedSigns | None = None  # the momentum, as its 1-bit exchange left it
        self._errors: tuple[torch.Tensor, torch.Tensor] | None = None  # worker, server
        self._mask, self._record = mask, record
        self.backwards = 0
        self.local_gradient: torch.Tensor | None = None
        self._written: torch.Tensor | None = None  # bf16 accumulation: what .grad got, fp32

    # ------------------------------------------------------------------ the micro-batches

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_tensor: torch.Tensor,
        comm: ProcessGroup,
        op: Any,
        compressed: bool,
    ) -> None:
        """One micro-batch's reduce-scatter of the module (FSDP2 adds ``output`` to
        ``.grad``): dense inside the shard group, or, on a 1-D mesh in the compressed phase,
        this rank's local gradient added to :attr:`local_gradient` and its own row written.

        Args:
            output: this rank's shard, ``S`` values.
            input_tensor: this rank's gradient of the module, ``W S`` values in FSDP2's layout.
            comm: fn's comm over the shard group.
            op: FSDP2's reduce op (``AVG``, ``SUM`` or ``PREMUL_SUM(f)``): in the compressed
                phase the local gradient is scaled to it, so the momentum follows the gradient
                ``op`` defines in both phases.
            compressed: whether the coming update is compressed.

        Raises:
            RuntimeError: FSDP2 left a param out of the reduce-scatter.
        """
        layout, world_size = self.layout, comm.world_size
        if input_tensor.numel() != world_size * layout.row:
            raise RuntimeError(
                f"module {layout.name} reduce-scatters {input_tensor.numel()} values, not the "
                f"{world_size * layout.row} of all its trainable params, though every one is "
                "asked for (set_reduce_scatter_unused_params): did a param's requires_grad "
                "change after the optimizer was built? FSDP2 reduce-scatters only the params "
                "that require grad: build the optimizer after freezing or unfreezing; nothing "
                "was updated"
            )
        rows = input_tensor.view(world_size, layout.row)
        if compressed and self.mesh.accumulates_locally:
            scale = reduce_scale(op, world_size)
            contribution = rows if scale == 1.0 else rows * scale
            self._accumulate(contribution)
            output.copy_(contribution[self.rank])
            if self.accumulate_dtype != torch.float32:
                mine = contribution[self.rank].to(torch.float32, copy=True)  # not a view
                self._written = mine if self._written is None else self._written.add_(mine)
        else:
            output.copy_(dense_reduce_scatter(comm, rows, op))

    def _accumulate(self, rows: torch.Tensor) -> None:
        layout = self.layout
        if self.local_gradient is not None:
            self.local_gradient[:, : layout.row] += rows
        elif rows.dtype == self.accumulate_dtype and layout.padded_row == layout.row:
            self.local_gradient = rows  # FSDP2's fresh buffer, not used again
        else:
            self.local_gradient = rows.new_zeros(
                (rows.shape[0], layout.padded_row), dtype=self.accumulate_dtype
            )
            self.local_gradient[:, : layout.row] = rows

    @property
    def received(self) -> bool:
        """Whether a backward reduce-scattered it since the last ``step()``."""
        return self.backwards > 0

    def count_backward(self) -> None:
        """Counts a backward's reduce-scatter of the module (or, with one rank per node, its
        all-reduce hook), whatever it delivers."""
        self.backwards += 1

    def discard(self) -> None:
        """Forgets what the backwards since the last ``step()`` delivered (``zero_grad``)."""
        self.backwards = 0
        self.local_gradient = None
        self._written = None

    def grad_shards(self) -> dict[str, torch.Tensor | None]:
        """This rank's ``.grad`` shard of every param of the module, by FQN."""
        return {
            slot.name: None if slot.param.grad is None else local_shard(slot.param.grad)
            for slot in self.layout.slots
        }

    def node_row(self, grads: dict[str, torch.Tensor | None]) -> torch.Tensor:
        """This rank's row of ``X`` (fp32) from the ``.grad`` shards ``grads`` (by FQN), zero
        at the padding positions: on HSDP the node's accumulated gradient."""
        return row_of(self.layout, grads, self._device())

    def written_row(self) -> torch.Tensor:
        """What the 1-D compressed phase's reduce-scatters wrote into ``.grad`` since the last
        ``step()``, accumulated as FSDP2 accumulates it (fp32): this rank's row of
        :attr:`local_gradient`, ``S`` values and the padding."""
        return self.local_gradient[self.rank].float() if self._written is None else self._written

    def grad_changed(self) -> bool:
        """On a 1-D mesh in the compressed phase ``.grad`` holds this rank's row of its own
        gradient, and the update reads the local gradient accumulated here: whether ``.grad``
        was changed since the backward (``clip_grad_norm_``, say), which then changes
        nothing."""
        written = self.written_row()
        for slot in self.layout.slots:
            grad = slot.param.grad
            mine = written[slot.offset : slot.offset + local_shard(slot.param).numel()]
            if grad is None or not torch.equal(local_shard(grad).reshape(-1), mine):
                return True
        return False

    # ---------------------------------------------------------------- the packed momentum

    @property
    def signed(self) -> bool:
        """Whether its momentum is kept as packed signs (after its first compressed update)."""
        return self._signs is not None

    @property
    def signs(self) -> PackedSigns | None:
        """Its momentum, all of ``X`` (on HSDP: this rank's row) as packed signs and scales;
        ``None`` before the freeze (read-only: :meth:`exchange` and :meth:`restore` set it)."""
        return self._signs

    @property
    def errors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The worker and server errors of its 1-bit allreduce, ``None`` until the first
        (read-only)."""
        return self._errors

    def own_row(self) -> PackedSigns:
        """This rank's row of the packed momentum: on a 1-D mesh its chunk of the whole ``X``,
        on HSDP all of :attr:`signs` (the ``N`` chunks of the row)."""
        return self.mesh.own_row(self._signs, self.rank)

    def previous_momentum(self, exp_avg: dict[str, torch.Tensor | None]) -> torch.Tensor:
        """The momentum before this update, flat in the layout of ``X`` (on HSDP: this rank's
        row of it), zero at its padding positions: unpacked from the packed signs times its
        mask, or at the freeze the shards' warmup momentum ``exp_avg`` (all-gathered on a 1-D
        mesh)."""
        layout = self.layout
        if self._signs is None:
            return self.mesh.gathered(row_of(layout, exp_avg, self._device()))
        first, count = self.mesh.rows(self.rank)
        momentum = self._signs.values(count * layout.padded_row).clone()
        for j in range(count):
            base = j * layout.padded_row
            for start, stop in layout.row_padding(first + j):
                momentum[base + start : base + stop] = 0.0
        if self._mask is not None:  # the rule's momentum: the allreduce's result times the mask
            momentum.mul_(mask_values(self._mask, first * layout.padded_row, momentum.numel()))
        return momentum

    def exchange(
        self,
        x: torch.Tensor,
        grad: torch.Tensor | None,
        beta: float,
        error_dtype: torch.dtype,
    ) -> torch.Tensor:
        """The update's 1-bit allreduce of the module's compressed vector over the mesh's
        exchange (the ranks, or on HSDP the nodes): ``beta x + (1 - beta) grad`` with ``grad``,
        else ``x``. The result becomes the packed momentum; the errors are written after every
        rank's check (the in-place exchange for fp32 and bf16 errors; the allocating
        collective, which rounds fp16 errors once, for fp16 ones).

        Returns:
            This rank's row of the new momentum, read exactly, times the mask.

        Raises:
            fn.NonFiniteError: on every rank, with nothing written.
        """
        comm = self.mesh.exchange
        if self._errors is None:
            self._errors = self.zero_errors(error_dtype)
        if error_dtype == torch.float16:
            if grad is not None:  # rounded as the rule's moving average
                x = (beta * x).add_((1 - beta) * grad)
            self._signs, *errors = compressed_allreduce(x, *self._errors, comm=comm, packed=True)
            self._errors = tuple(errors)
        else:
            exchange = compressed_allreduce_exchange(
                x, *self._errors, comm=comm, grad=grad, beta=beta
            )
            if exchange is None:  # not on this path's tensors (e.g. under torch.compile)
                raise NotImplementedError(
                    "the 1-bit exchange runs eagerly on contiguous fp32 tensors"
                )
            write_errors(exchange, *self._errors)
            self._signs = PackedSigns(exchange.packed, exchange.scales)
        return self.masked_row(self.own_row().values(self.layout.padded_row))

    def zero_errors(self, error_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Errors before the first compressed update: zeros, worker and server (for what this
        rank compresses, over the mesh's exchange)."""
        numel = self.mesh.rows(self.rank)[1] * self.layout.padded_row
        comm, device = self.mesh.exchange, self._device()
        return tuple(init_error_feedback(numel, comm=comm, device=device, dtype=error_dtype))

    def restore(
        self, signs: PackedSigns | None, errors: tuple[torch.Tensor, torch.Tensor] | None
    ) -> None:
        """Sets its packed momentum and errors (``None``: before the freeze, or restarted)
        and forgets what the backwards since the last ``step()`` delivered."""
        self.discard()
        self._signs, self._errors = signs, errors

    # ------------------------------------------------------------------------ the mask

    @property
    def mask(self) -> torch.Tensor | None:
        """Its ``exp_avg_mask`` as bits in the layout of ``X`` (1: kept), or ``None``."""
        return self._mask

    @property
    def record(self) -> torch.Tensor | None:
        """``exp_avg_mask="auto"``'s record of this rank's row until the freeze, or ``None``."""
        return self._record

    def set_mask(self, mask: torch.Tensor | None, record: torch.Tensor | None) -> None:
        """Sets its mask and ``exp_avg_mask="auto"``'s record."""
        self._mask, self._record = mask, record

    def shard_masks(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """This rank's values (0. or 1.) of its mask, shaped like its params' ``shards`` (by
        FQN); ``None`` for each without a mask."""
        return shard_masks(self.layout, self.rank, shards, self._mask)

    def masked_row(self, row: torch.Tensor) -> torch.Tensor:
        """This rank's row of its momentum in the layout of ``X`` times its mask (``row`` itself
        without one): a 0/1 mask's product is exact, so the rule gets the values it would
        compute itself."""
        if self._mask is None:
            return row
        padded = self.layout.padded_row
        return row * mask_values(self._mask, self.rank * padded, padded)

    def observe_zeros(self, grads: dict[str, torch.Tensor | None]) -> torch.Tensor:
        """``exp_avg_mask="auto"``'s record after a warmup update whose mean gradient shards are
        ``grads``: ANDed with the bits of this rank's row of ``X`` where the mean gradient is
        exactly 0 (``-|g| >= 0``, ``-0.0`` included, as ``fn.onebit_adam``'s record). Padding
        positions hold 0, so they stay 1; a param without a gradient keeps its bits (as a leaf
        without one keeps its record)."""
        row = row_of(self.layout, grads, self._record.device)
        return self._record & kernels.packbits(row.abs_().neg_())

    def frozen_mask(self) -> torch.Tensor:
        """``exp_avg_mask="auto"``'s mask at the freeze, as bits in the layout of ``X`` (1:
        kept): the ranks' records all-gathered over the shard group (``n / (8 W)`` bytes per
        rank, once) and inverted, 1 where the mean gradient was non-zero at some warmup update,
        0 where it was exactly 0 at every one and at the padding positions."""
        return self.mesh.shard.all_gather(self._record).view(-1).bitwise_not_()

    def _device(self) -> torch.device:
        return self.layout.slots[0].param.device


def dense_reduce_scatter(comm: ProcessGroup, rows: torch.Tensor, op: Any) -> torch.Tensor:
    """``dist.reduce_scatter_tensor``'s result for ``op``: the sum of the ranks' rows (fn's
    ``ProcessGroup``), divided by ``W`` for ``AVG``, times ``f`` for ``PREMUL_SUM(f)``.

    Args:
        comm: fn's comm over the group.
        rows: this rank's ``[W, S]`` input.
        op: the reduce op.

    Returns:
        This rank's ``S`` values.

    Raises:
        ValueError: an op other than ``AVG``, ``SUM`` or ``PREMUL_SUM``.
    """
    total = comm.reduce_scatter(rows, "sum")
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return total / comm.world_size
    if kind == dist.ReduceOp.PREMUL_SUM:
        return total * op.factor
    if kind == dist.ReduceOp.SUM:
        return total
    raise ValueError(f"op must be ReduceOp.AVG, SUM or PREMUL_SUM, got {kind}")
