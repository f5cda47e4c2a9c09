"""``quantized_all_gather``: FSDP2's parameter all-gather in 8-bit groups (ZeRO++ qwZ).

FSDP2 all-gathers every module's parameter shards before its forward (and again before its
backward when it resharded after the forward). :class:`QuantizedAllGather` sends each rank's
flat shard ``x`` (``n`` values, padded on its own to whole groups) as blockwise codes and fp32
scales, and every rank writes ``DQ(Q(x_i))`` for every rank ``i``, its own included, into
FSDP2's output in the parameters' dtype: all ranks compute with the same unsharded weights, and
the sharded parameters the optimizer updates stay exact. A shard with a non-finite value gathers
as NaN on every rank. Inputs that are not floating point (FSDP2 sends mixed dtypes as bytes)
are gathered unchanged.

Reference:
    Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
    Training", 2023 (arXiv:2306.10209), qwZ.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fn.collectives import quantized_all_gather_into
from fn.collectives.process_group import all_gather_flat
from fn.fsdp._fsdp2 import AllGather, FreshBuffers
from fn.fsdp.agreement import agree_on_settings, integer
from fn.fsdp.loco import ROOT
from fn.fsdp.reduce_scatter import CommCache
from fn.kernels import check_quant_args

__all__ = ["QuantizedAllGather", "quantized_all_gather"]


class QuantizedAllGather(FreshBuffers, AllGather):
    """One FSDP2 module's parameter all-gather, sent as ``bits``-bit groups.

    Args:
        bits: 8 (ZeRO++'s qwZ) or 4.
        group_size: values per quantization group (even).
        comm_for: maps FSDP2's process group to fn's communicator (default: a
            :class:`~fn.fsdp.CommCache` of this object's own).

    Raises:
        TypeError: ``bits`` or ``group_size`` is not an int (``8.0``, ``True``, ``"8"``).
        ValueError: ``bits`` or ``group_size`` out of range.

    Example:
        >>> import torch.distributed as dist
        >>> from fn.fsdp import QuantizedAllGather
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> gather = QuantizedAllGather(bits=8, group_size=4)
        >>> x = torch.tensor([0.5, -1.0, 0.25, 0.3, 0.7])
        >>> out = gather.allocate((5,), dtype=torch.float32, device=torch.device("cpu"))
        >>> gather(out, x, dist.group.WORLD)
        >>> out  # x, to 8 bits per group of 4
        tensor([ 0.5000, -1.0000,  0.2500,  0.2969,  0.6945])
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        bits: int = 8,
        group_size: int = 128,
        *,
        comm_for: CommCache | None = None,
    ) -> None:
        bits, group_size = integer("bits", bits), integer("group_size", group_size)
        check_quant_args(bits, group_size)
        self.bits = bits
        self.group_size = group_size
        self._comm_for = comm_for or CommCache(None)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        """Writes every rank's dequantized shard into ``output_tensor`` (``[W * n]``); runs
        synchronously whatever ``async_op`` says (FSDP2 then sees no pending work)."""
        del async_op
        if not input_tensor.is_floating_point():
            all_gather_flat(output_tensor, input_tensor, group=group)
            return
        quantized_all_gather_into(
            output_tensor,
            input_tensor,
            comm=self._comm_for(group),
            bits=self.bits,
            group_size=self.group_size,
        )


def quantized_all_gather(
    module: nn.Module, *, bits: int = 8, group_size: int = 128
) -> dict[str, QuantizedAllGather]:
    """Sends the parameter all-gathers of every FSDP2 module under ``module`` quantized.

    Forward and backward then run on ``DQ(Q(w))`` (blockwise ``bits``-bit, per rank's shard);
    the sharded parameters and their updates stay exact. Use it with
    :func:`~fn.fsdp.loco_reduce_scatter` for ZeRO++'s qwZ + qgZ.

    Call it on every rank after ``fully_shard``: it is collective (one all-gather of 16 bytes
    a rank over the model's FSDP2 process group), so that arguments one rank refuses, or
    settings that differ across ranks, raise on every rank here rather than fail in the first
    forward.

    Args:
        module: a model with ``fully_shard`` applied to it or to some of its submodules.
        bits: 8 (qwZ) or 4.
        group_size: values per quantization group (even).

    Returns:
        ``{fqn: QuantizedAllGather}`` (``"<root>"`` for ``module`` itself).

    Raises:
        TypeError: ``bits`` or ``group_size`` is not an int (as :class:`QuantizedAllGather`),
            on every rank.
        ValueError: on every rank: no FSDP2 module under ``module``, ``bits`` /
            ``group_size`` out of range (as :class:`QuantizedAllGather`), or the ranks passed
            different ``bits`` or ``group_size``. Nothing is installed.

    Example:
        ZeRO++'s qwZ and qgZ together:

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
        >>> gathers = fn.fsdp.quantized_all_gather(model, bits=8, group_size=8)  # qwZ
        >>> handle = fn.fsdp.loco_reduce_scatter(model, bits=4, group_size=8)  # qgZ
        >>> list(gathers), list(handle.reduce_scatters)
        (['<root>'], ['<root>'])
        >>> dist.destroy_process_group()
    """
    modules = [(n, child) for n, child in module.named_modules() if isinstance(child, FSDPModule)]
    agree_on_settings(
        "fn.fsdp.quantized_all_gather",
        module,
        lambda: QuantizedAllGather(bits, group_size),
        ("bits", "group_size"),
        None if modules else "module: no FSDP2 module (fully_shard) in it",
    )
    comm_for = CommCache(None)
    gathers = {}
    for name, child in modules:
        gather = QuantizedAllGather(bits, group_size, comm_for=comm_for)
        child.set_custom_all_gather(gather)
        gathers[name or ROOT] = gather
    return gathers
