"""``QuantizedReduceScatter``: FSDP2's gradient reduce-scatter, sent blockwise-quantized.

One object serves one FSDP2 module (``FSDPModule.set_custom_reduce_scatter``). FSDP2 hands it
a flat buffer ``x`` of ``n`` values in the reduce dtype whose ``W`` rows (``x.view(W, n / W)``)
are the ``W`` ranks' shards, and an output of ``n / W`` values. Every row is zero-padded on its
own to whole quantization groups, the padded rows go through fn's quantized reduce-scatter
(:func:`fn.collectives.quantized_reduce_scatter_into`: one hop, or intra-node then inter-node with
``local_world_size``) in fp32, and this rank's row of the result is written back in the buffer's
dtype, scaled as ``dist.reduce_scatter_tensor`` would scale it:

- ``ReduceOp.AVG``: the mean ``(1 / W) sum_i x_i``;
- ``ReduceOp.SUM``: the sum ``sum_i x_i``;
- ``ReduceOp.PREMUL_SUM(f)`` (FSDP2's ``set_gradient_divide_factor``): ``f sum_i x_i``.

With ``err_beta`` set, every quantization hop keeps LoCo error feedback for this rank (fp32,
padded layout; one buffer per hop), reset to zero every ``reset_T`` calls:

.. math::
    v = x + e, \\quad q = Q(v), \\quad e' = \\beta e + (1 - \\beta) (v - DQ(q))

so that, from ``e = 0`` and with one hop, ``sum_t DQ(q_t) + e_T / (1 - beta) = sum_t x_t``: what
compression held back is sent later. A new layout (a different ``n`` or world size, e.g. when
some parameters have no gradient) resets the buffers with a logged warning. A non-finite input
on any rank makes every rank's output NaN and leaves the error feedback unchanged. Ranks whose
``n`` differ raise the same ``ValueError`` (the collective's size records), before any chunk
is sent, with the output, the buffers, the count and the layout unchanged.

Eager calls allocate no full-size tensor: fn's fused kernels read the padded (and, with two
hops, reordered) rows in place (``fn.kernels.loco_quantize(..., rows=...)``), the sum goes
straight into the output (fp32 rows of whole groups; else through a workspace) and the errors
are updated in place, never in buffers :meth:`state_dict` handed out. Under ``torch.compile``
the padded copy is made. The results are the same bits either way.

References:
    Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
    Training", 2023 (arXiv:2306.10209), qgZ.
    Xie et al., "LoCo: Low-Bit Communication Adaptor for Large-scale Model Training", 2024
    (arXiv:2407.04480).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fn.collectives import ProcessGroup, quantized_reduce_scatter_into
from fn.errors import NonFiniteError
from fn.fsdp._fsdp2 import SynchronousReduceScatter
from fn.fsdp.agreement import integer
from fn.kernels import check_quant_args

__all__ = ["CommCache", "QuantizedReduceScatter", "reduce_scale"]

logger = logging.getLogger(__name__)


def reduce_scale(op: Any, world_size: int) -> float:
    """The factor that turns the mean over ``world_size`` ranks into ``op``'s result.

    Args:
        op: a ``torch.distributed.ReduceOp`` (``AVG``, ``SUM`` or ``PREMUL_SUM(f)``).
        world_size: ``W``.

    Returns:
        ``1`` for ``AVG``, ``W`` for ``SUM``, ``f W`` for ``PREMUL_SUM(f)``.

    Raises:
        ValueError: for any other op (max, min, product, bitwise).

    Example:
        >>> import torch.distributed as dist
        >>> from fn.fsdp import reduce_scale
        >>> reduce_scale(dist.ReduceOp.AVG, 4), reduce_scale(dist.ReduceOp.SUM, 4)
        (1.0, 4.0)
        >>> reduce_scale(dist.ReduceOp.PREMUL_SUM(0.125), 4)
        0.5
    """
    kind = getattr(op, "op", op)  # a ReduceOp object, or a bare RedOpType
    if kind == dist.ReduceOp.AVG:
        return 1.0
    if kind == dist.ReduceOp.SUM:
        return float(world_size)
    if kind == dist.ReduceOp.PREMUL_SUM:
        return float(op.factor) * world_size
    raise ValueError(f"op must be ReduceOp.AVG, SUM or PREMUL_SUM, got {kind}")


class CommCache:
    """fn's communicator for each FSDP2 process group, with its two-hop split made once.

    Args:
        local_world_size: ranks per node: split every new group for the two-hop mode (a
            collective call), or ``None``.

    Example:
        >>> import torch.distributed as dist
        >>> from fn.fsdp import CommCache
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> comms = CommCache(local_world_size=None)
        >>> comms(dist.group.WORLD) is comms(dist.group.WORLD), comms.bytes_sent
        (True, 0)
        >>> dist.destroy_process_group()
    """

    def __init__(self, local_world_size: int | None) -> None:
        self.local_world_size = local_world_size
        self.comms: dict[dist.ProcessGroup, ProcessGroup] = {}

    def __call__(self, group: dist.ProcessGroup) -> ProcessGroup:
        """The communicator of ``group`` (created on first use)."""
        if group not in self.comms:
            comm = ProcessGroup(group)
            if self.local_world_size is not None:
                comm.split(self.local_world_size)  # collective: every rank, same order
            self.comms[group] = comm
        return self.comms[group]

    @property
    def bytes_sent(self) -> int:
        """Bytes sent through all these communicators."""
        return sum(comm.bytes_sent for comm in self.comms.values())


class QuantizedReduceScatter(SynchronousReduceScatter):
    """One FSDP2 module's reduce-scatter: quantized (ZeRO++ qgZ), optionally LoCo-compensated.

    Args:
        bits: 4 or 8.
        group_size: values per quantization group (even).
        err_beta: LoCo's error decay ``beta`` in ``[0, 1)``, or ``None`` for no error feedback.
        reset_T: zero the error feedback every ``reset_T`` calls.
        local_world_size: ranks per node for the two-hop mode, or ``None`` for one hop.
        comm_for: maps FSDP2's process group to fn's communicator; by default a
            :class:`CommCache` of this object's own.
        name: how log lines name this module.

    Raises:
        TypeError: ``bits``, ``group_size``, ``reset_T`` or ``local_world_size`` is not an int
            (``8.0``, ``True``, ``"8"``), or ``err_beta`` not a real number.
        ValueError: one of them out of range.

    Attributes:
        count: int64[]: calls made since the start (the ``reset_T`` clock).
        errors: the error buffers (fp32; hop 1 ``[W * m]``, hop 2 ``[W * m / L]`` with ``m``
            the padded row length), ``()`` before the first call or :meth:`reset`, or without
            error feedback.
        layout: ``(n, W)`` of the buffers the errors belong to, or ``None``.

    Example:
        >>> import torch.distributed as dist
        >>> from fn.fsdp import QuantizedReduceScatter
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> rs = QuantizedReduceScatter(bits=8, group_size=4)
        >>> x = torch.linspace(-1, 1, 6)
        >>> out = rs.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
        >>> rs(out, x, dist.group.WORLD, dist.ReduceOp.AVG) is None  # out: x, to 8 bits
        True
        >>> torch.allclose(out, x, atol=1 / 127)
        True
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        bits: int = 4,
        group_size: int = 128,
        err_beta: float | None = 0.8,
        reset_T: int = 1024,  # noqa: N803 (LoCo's / DeepSpeed's name)
        local_world_size: int | None = None,
        *,
        comm_for: Callable[[dist.ProcessGroup], ProcessGroup] | None = None,
        name: str = "",
    ) -> None:
        bits, group_size = integer("bits", bits), integer("group_size", group_size)
        reset_T = integer("reset_T", reset_T)
        if local_world_size is not None:
            local_world_size = integer("local_world_size", local_world_size)
        if err_beta is not None:
            if isinstance(err_beta, bool) or not isinstance(err_beta, numbers.Real):
                kind = type(err_beta).__name__
                raise TypeError(f"err_beta must be a float or None, got {err_beta!r} ({kind})")
            err_beta = float(err_beta)
        check_quant_args(bits, group_size)
        if err_beta is not None and not 0.0 <= err_beta < 1.0:
            raise ValueError(f"err_beta must be in [0, 1) or None, got {err_beta}")
        if reset_T < 1:
            raise ValueError(f"reset_T must be a positive int, got {reset_T!r}")
        if local_world_size is not None and local_world_size < 1:
            raise ValueError(f"local_world_size must be a positive int, got {local_world_size}")
        self.bits = bits
        self.group_size = group_size
        self.err_beta = err_beta
        self.reset_T = reset_T
        self.local_world_size = local_world_size
        self.name = name
        self._comm_for = comm_for or CommCache(local_world_size)
        self.count = torch.zeros((), dtype=torch.int64)
        self.errors: tuple[torch.Tensor, ...] = ()
        self.layout: tuple[int, int] | None = None
        self._handed_out = False  # whether state_dict() returned the error buffers

    def error_sizes(self, numel: int, world_size: int) -> tuple[int, ...]:
        """The sizes of the error buffers for a reduce-scatter input of ``numel`` values."""
        if self.err_beta is None:
            return ()
        padded = world_size * self._padded_row(numel // world_size)
        if self.local_world_size is None:
            return (padded,)
        return (padded, padded // self.local_world_size)

    def reset(self, numel: int, world_size: int, device: Any = None) -> None:
        """Zero error buffers (and a zero count) for the layout ``(numel, world_size)``."""
        self.errors = tuple(
            torch.zeros(k, dtype=torch.float32, device=device)
            for k in self.error_sizes(numel, world_size)
        )
        self.layout = (numel, world_size)
        self.count = torch.zeros((), dtype=torch.int64)

    def reduce_scatter(self, out: Tensor, x: Tensor, group: dist.ProcessGroup, op: Any) -> None:
        """Writes this rank's reduced shard of ``x`` into ``out``."""
        comm = self._comm_for(group)
        world_size = comm.world_size
        scale = reduce_scale(op, world_size)
        numel = x.numel()
        if numel % world_size or out.numel() != numel // world_size:
            raise ValueError(
                f"input_tensor ({numel} values) must be world_size={world_size} rows of "
                f"output_tensor's {out.numel()} values"
            )
        layout = (numel, world_size)
        kept = (self.count, self.errors, self.layout)
        if self.layout != layout:
            self.reset(*layout, device=x.device)
        try:
            self._reduce(out, x, comm, scale)
        except ValueError:  # raised on every rank (their sizes differ): nothing was written
            self.count, self.errors, self.layout = kept
            raise
        if kept[2] not in (None, layout):
            logger.warning(
                "fn.fsdp: %s: reduce-scatter layout changed from %s to %s; error feedback "
                "reset to zero",
                self.name or "module",
                kept[2],
                layout,
            )

    def _reduce(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        comm: ProcessGroup,
        scale: float,
    ) -> None:
        """:meth:`__call__` once the layout's buffers are in place: errors read from
        ``self.errors`` and written back in place (never into buffers :meth:`state_dict`
        handed out), the count advanced; a non-finite reduction gives NaN and keeps both."""
        reset = self.err_beta is not None and int(self.count) % self.reset_T == 0
        outs = [torch.empty_like(e) for e in self.errors] if self._handed_out else list(self.errors)
        try:
            quantized_reduce_scatter_into(
                output_tensor,
                input_tensor,
                comm=comm,
                bits=self.bits,
                group_size=self.group_size,
                local_world_size=self.local_world_size,
                scale=scale,
                errors=() if reset else self.errors,
                error_outs=outs,
                err_beta=self.err_beta or 0.0,
            )
        except NonFiniteError:  # every rank raises, before anything was written
            output_tensor.fill_(torch.nan)
            return
        if self.err_beta is not None:
            self.errors = tuple(outs)
            self._handed_out = False
        self.count += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``count``, the layout's ``numel`` and ``world_size``, and ``error.<hop>`` buffers."""
        numel, world_size = self.layout[:2] if self.layout else (0, 0)
        state = {
            "count": self.count,
            "numel": torch.tensor(numel, dtype=torch.int64),
            "world_size": torch.tensor(world_size, dtype=torch.int64),
        }
        state.update({f"error.{i}": e for i, e in enumerate(self.errors)})
        self._handed_out = True
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores :meth:`state_dict`'s output.

        Raises:
            ValueError: an error buffer is missing or has the wrong size (nothing is changed).
        """
        self.load_parsed(self.parse_state_dict(state))

    def parse_state_dict(
        self, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[int, int] | None]:
        """Checks :meth:`state_dict`'s output; returns copies of ``(count, errors, layout)``."""
        numel, world_size = int(state["numel"]), int(state["world_size"])
        sizes = self.error_sizes(numel, world_size) if world_size else ()
        errors = []
        for i, size in enumerate(sizes):
            error = state.get(f"error.{i}")
            if error is None or error.shape != (size,):
                raise ValueError(
                    f"{self.name or 'module'}: error.{i} must have shape ({size},) for "
                    f"numel={numel}, world_size={world_size}, got "
                    f"{None if error is None else tuple(error.shape)}"
                )
            errors.append(error.detach().to(torch.float32, copy=True))
        count = state["count"].detach().to(torch.int64).clone()
        return count, tuple(errors), (numel, world_size) if world_size else None

    def load_parsed(
        self, parsed: tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[int, int] | None]
    ) -> None:
        """Takes the state :meth:`parse_state_dict` returned (a caller that loads several
        reduce-scatters parses them all first, so that a bad entry changes none)."""
        self.count, self.errors, self.layout = parsed

    def _padded_row(self, row: int) -> int:
        return -(-row // self.group_size) * self.group_size
