"""``loco_reduce_scatter``: 4-bit LoCo gradients for every FSDP2 module of a model.

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters each sharded module's gradients
on its own, with the reduce-scatter that module was given by ``set_custom_reduce_scatter``.
:func:`loco_reduce_scatter` gives every FSDP2 module under a model its own
:class:`~fn.fsdp.QuantizedReduceScatter` (equal-sized modules never share error feedback) and
returns a :class:`LocoReduceScatterHandle` that checkpoints them: its ``state_dict()`` holds this
rank's buffers under ``per_rank["rank<r>"]``, so ``torch.distributed.checkpoint`` saves every
rank's own.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from fn.collectives.dcp import PER_RANK, own_entries, rank_key
from fn.fsdp.agreement import agree_on_settings
from fn.fsdp.reduce_scatter import CommCache, QuantizedReduceScatter

__all__ = ["LocoReduceScatterHandle", "loco_reduce_scatter"]

ROOT = "<root>"  # the state-dict key of the FSDP2 module passed in (its FQN is "")


def _own_params(module: FSDPModule) -> list[torch.Tensor]:
    """The parameters ``module``'s FSDP2 group manages: none of a nested FSDP2 module's."""
    nested = {
        id(p)
        for child in module.modules()
        if child is not module and isinstance(child, FSDPModule)
        for p in child.parameters()
    }
    return [p for p in module.parameters() if id(p) not in nested and p.requires_grad]


def _layout(params: list[torch.Tensor]) -> tuple[int, dist.ProcessGroup]:
    """The reduce-scatter input size FSDP2 builds for ``params``, and their shard group."""
    numel, group = 0, None
    for p in params:
        if not isinstance(p, DTensor):
            raise TypeError("loco_reduce_scatter: a parameter is not sharded by fully_shard")
        mesh_dim, shard = next(
            (i, pl) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)
        )
        world_size = p.device_mesh.size(mesh_dim)
        group = p.device_mesh.get_group(mesh_dim)
        if shard.dim == 0:  # FSDP2 pads dim 0 to a multiple of W
            numel += -(-p.shape[0] // world_size) * world_size * math.prod(p.shape[1:])
        else:  # Shard(d > 0) needs even sharding
            numel += p.numel()
    return numel, group


class LocoReduceScatterHandle:
    """The quantized reduce-scatters installed on a model's FSDP2 modules, by module FQN.

    A ``torch.distributed.checkpoint`` ``Stateful``: ``state_dict()`` is
    ``{"per_rank": {"rank<r>": {fqn: module_state}}}`` with this rank's buffers only, under a
    name of its own (fn/collectives/dcp.py; ``"<root>"`` names the module passed in);
    ``load_state_dict`` restores this rank's entry.

    :func:`loco_reduce_scatter` builds it.

    Args:
        reduce_scatters: ``{fqn: QuantizedReduceScatter}``, the installed reduce-scatters.
        rank: this rank.
        comms: the comms the reduce-scatters send through (for :attr:`bytes_sent`).

    Attributes:
        reduce_scatters: ``{fqn: QuantizedReduceScatter}``.

    Example:
        One rank here (under ``torchrun`` every rank runs this and checkpoints its own entry):

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
        >>> handle = fn.fsdp.loco_reduce_scatter(model, bits=4, group_size=8)
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> saved = handle.state_dict()
        >>> sorted(saved["per_rank"]["rank0"]["<root>"])
        ['count', 'error.0', 'numel', 'world_size']
        >>> handle.load_state_dict(saved)
        >>> dist.destroy_process_group()
    """

    def __init__(
        self, reduce_scatters: dict[str, QuantizedReduceScatter], rank: int, comms: CommCache
    ) -> None:
        self.reduce_scatters = reduce_scatters
        self.rank = rank
        self._comms = comms

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank's quantized reduce-scatters have sent (fn's own count)."""
        return self._comms.bytes_sent

    def state_dict(self) -> dict[str, dict[str, dict[str, dict[str, torch.Tensor]]]]:
        """This rank's error feedback: ``{"per_rank": {"rank<r>": {fqn: {count, numel,
        world_size, error.<hop>}}}}`` (the live tensors, which a checkpoint load fills in
        place)."""
        own = {name: rs.state_dict() for name, rs in self.reduce_scatters.items()}
        return {PER_RANK: {rank_key(self.rank): own}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores this rank's entry of a :meth:`state_dict`.

        Raises:
            KeyError: there is no entry for this rank or for one of the modules (a checkpoint
                from another world size or model); nothing is changed.
            ValueError: a buffer has the wrong size; nothing is changed.
        """
        key = rank_key(self.rank)
        own = own_entries(state_dict, self.rank)
        if own is None:
            raise KeyError(
                f"state_dict has no error feedback for {key} under {PER_RANK!r} (keys: "
                f"{list(state_dict)}, per rank: {list(state_dict.get(PER_RANK) or [])})"
            )
        missing = set(self.reduce_scatters) - set(own)
        if missing:
            raise KeyError(
                f"state_dict[{PER_RANK!r}][{key!r}] has no entry for the modules {sorted(missing)}"
            )
        parsed = {name: rs.parse_state_dict(own[name]) for name, rs in self.reduce_scatters.items()}
        for name, rs in self.reduce_scatters.items():
            rs.load_parsed(parsed[name])


def loco_reduce_scatter(
    module: nn.Module,
    *,
    bits: int = 4,
    group_size: int = 128,
    err_beta: float | None = 0.8,
    reset_T: int = 1024,  # noqa: N803 (LoCo's / DeepSpeed's name)
    local_world_size: int | None = None,
) -> LocoReduceScatterHandle:
    """Sends the gradients of every FSDP2 module under ``module`` quantized, with LoCo feedback.

    Call it on every rank after ``fully_shard``: it is collective (one all-gather of 16 bytes a
    rank over the model's FSDP2 process group, and the two-hop split with ``local_world_size``),
    so that arguments one rank refuses, or settings that differ across ranks, raise on every
    rank here rather than fail in the first backward. Each FSDP2 module gets its own
    :class:`~fn.fsdp.QuantizedReduceScatter`: its sharded gradients are ``op`` over the ranks
    of ``DQ(Q(g_i + e_i))`` with ``op`` FSDP2's (mean, sum, or a divide factor's premultiplied
    sum) and ``e_i' = beta e_i + (1 - beta) (g_i + e_i - DQ(Q(g_i + e_i)))`` this rank's error
    feedback per quantization hop; ``err_beta=None`` is ZeRO++ qgZ without feedback.

    Args:
        module: a model with ``fully_shard`` applied to it or to some of its submodules.
        bits: 4 or 8.
        group_size: values per quantization group (even).
        err_beta: LoCo's error decay ``beta`` in ``[0, 1)``, or ``None``.
        reset_T: zero the error feedback every ``reset_T`` reduce-scatters.
        local_world_size: ranks per node for the two-hop mode (intra-node, then inter-node),
            or ``None``.

    Returns:
        A :class:`LocoReduceScatterHandle` (checkpoint it with the model and optimizer).

    Raises:
        TypeError: on every rank, an argument of the wrong type (``bits=8.0``; as
            :class:`~fn.fsdp.QuantizedReduceScatter`).
        ValueError: on every rank: no FSDP2 module under ``module``, an argument out of range,
            or settings that differ across ranks. Nothing is installed.

    Example:
        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> from fn.fsdp import loco_reduce_scatter
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
        >>> handle = loco_reduce_scatter(model, bits=4, group_size=8)
        >>> list(handle.reduce_scatters), handle.reduce_scatters["<root>"].layout  # (n, W)
        (['<root>'], (20, 1))
        >>> dist.destroy_process_group()
    """
    modules = [  # (name, FSDP2 module, its trainable params)
        (name or ROOT, child, params)
        for name, child in module.named_modules()
        if isinstance(child, FSDPModule) and (params := _own_params(child))
    ]
    agree_on_settings(
        "fn.fsdp.loco_reduce_scatter",
        module,
        lambda: QuantizedReduceScatter(bits, group_size, err_beta, reset_T, local_world_size),
        ("bits", "group_size", "err_beta", "reset_T", "local_world_size"),
        None if modules else "module: no FSDP2 module (fully_shard) with trainable parameters",
    )
    comm_for = CommCache(local_world_size)
    reduce_scatters = {}
    for name, child, params in modules:
        rs = QuantizedReduceScatter(
            bits, group_size, err_beta, reset_T, local_world_size, comm_for=comm_for, name=name
        )
        numel, group = _layout(params)
        comm_for(group)
        rs.reset(numel, dist.get_world_size(group), device=params[0].device)
        child.set_custom_reduce_scatter(rs)
        reduce_scatters[name] = rs
    return LocoReduceScatterHandle(reduce_scatters, dist.get_rank(), comm_for)
