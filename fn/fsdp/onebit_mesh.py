"""The two meshes a 1-bit optimizer on FSDP2 runs on, as objects: :class:`ShardMesh`, a 1-D mesh
of ``W`` ranks (a module's compressed vector ``X`` is all ``W`` rows, exchanged over the shard
group), and :class:`HsdpMesh`, HSDP's ``N`` nodes of ``L`` ranks (each rank's row of ``X``,
exchanged over the replicate group). What differs between them is here, behind the same
methods, so that the optimizer and its modules hold one and ask it (docs/algorithms.md, "1-bit
Adam and 1-bit LAMB on FSDP2" and "... on HSDP")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from fn.collectives import PackedSigns, ProcessGroup, local_shard
from fn.collectives.dtensor import rows_of_ranks
from fn.fsdp.onebit_layout import ModuleLayout, row_multiple, shard_of

__all__ = ["HsdpMesh", "ShardMesh"]

Stats = Callable[[], list[float]]


class ShardMesh:
    """A 1-D mesh: the update's exchange runs over the ``W`` ranks of the shard group, on all
    of ``X``; in the compressed phase a rank accumulates its whole local gradient.

    Args:
        shard: fn's comm over the shard group.

    Attributes:
        shard: fn's comm over the shard group.
        exchange: the comm of the update's exchange (here ``shard``).
        shape: ``(W, N)``: the ranks of the shard group, and the nodes (``1``).
        communicates: whether fn's collectives deliver the mean gradient (else one rank: the
            rule alone).
        header: what a checkpoint's header adds after the update count and checksums.
        multiple: what a row of ``X`` is padded to (``None``: ``lcm(W, 8)``).
        hops: the level of a process group's bytes, by its ranks (none on a 1-D mesh).
        accumulates_locally: whether the compressed phase's reduce-scatter keeps this rank's
            whole gradient (else it stays dense inside the shard group).

    Example:
        >>> import torch.distributed as dist
        >>> from fn.fsdp.onebit_mesh import ShardMesh
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> mesh = ShardMesh(fn.collectives.ProcessGroup())
        >>> mesh.shape, mesh.rows(0), mesh.communicates
        ((1, 1), (0, 1), False)
        >>> dist.destroy_process_group()
    """

    accumulates_locally = True

    def __init__(self, shard: ProcessGroup) -> None:
        self.shard, self.exchange = shard, shard
        self.shape, self.communicates = (shard.world_size, 1), shard.world_size > 1
        self.header: list[int] = []
        self.multiple: int | None = None
        self.hops: dict[tuple[int, ...], str] = {}

    def rows(self, rank: int) -> tuple[int, int]:
        """The first row of ``X`` that a module's momentum on this rank (``rank`` in the shard
        group) covers, and how many."""
        del rank
        return 0, self.shard.world_size

    def gathered(self, row: torch.Tensor) -> torch.Tensor:
        """The momentum that a module compresses at the freeze, from this rank's ``row`` of it:
        every rank's row (one all-gather)."""
        return self.shard.all_gather(row).view(-1)

    def own_row(self, signs: PackedSigns, rank: int) -> PackedSigns:
        """This rank's row of a module's packed momentum ``signs``: its chunk of ``X``."""
        return PackedSigns(signs.packed[rank : rank + 1], signs.scales[rank : rank + 1])

    def compressed_gradient(
        self, module: Any, grads: dict[str, torch.Tensor | None], check: bool
    ) -> tuple[torch.Tensor, bool]:
        """The gradient that enters a module's momentum, flat fp32 in the layout of ``X``:
        this rank's accumulated local gradient; and (``check``) whether ``.grad`` (``grads``)
        was changed where the update does not read it."""
        del grads
        changed = check and module.grad_changed()
        return module.local_gradient.view(-1).float(), changed

    def warmup_stats(self, stats: Stats) -> list[float]:
        """This rank's gradient statistics for ``step()``'s first exchange in the warmup:
        FSDP2's reduce-scatter averaged the gradient already."""
        return stats()

    def warmup_totals(
        self, totals: torch.Tensor, modules: Iterable[Any], stats: Stats
    ) -> torch.Tensor:
        """The warmup's gradient statistics summed over the ranks: the first exchange's."""
        del modules, stats
        return totals

    def momentum_state(self, layout: ModuleLayout, signs: PackedSigns | None) -> dict[str, Any]:
        """A module's packed momentum in a checkpoint (zeros for ``None``): all of it, the same
        on every rank."""
        world_size = self.shard.world_size
        signs = signs or PackedSigns(
            torch.zeros(world_size, layout.padded_row // 8, dtype=torch.uint8),
            torch.zeros(world_size),
        )
        return {"packed": signs.packed, "scales": signs.scales}

    def momentum_template(self, layout: ModuleLayout) -> dict[str, Any] | None:
        """What DCP loads a module's packed momentum saved on this mesh shape into (``None``:
        new tensors of the saved sizes)."""
        del layout
        return None


class HsdpMesh(ShardMesh):
    """HSDP (``replicate=``): ``N`` nodes of ``L`` ranks; each module's reduce-scatter stays
    dense inside the node, and the update's exchange runs over the ``N`` ranks of the replicate
    group, on this rank's row of ``X`` (the node's gradient, accumulated in ``.grad``).

    Args:
        shard: fn's comm over the shard group (inside the node).
        replicas: fn's comm over the replicate group (across the nodes).

    Attributes:
        shard: fn's comm over the shard group.
        exchange: the comm of the update's exchange (here ``replicas``).
        hops: ``"intra"`` for the shard group and ``"inter"`` for the replicate group, by
            their ranks.
        accumulates_locally: ``False``: the node's gradient accumulates in FSDP2's ``.grad``.

    Example:
        >>> import torch.distributed as dist
        >>> from fn.fsdp.onebit_mesh import HsdpMesh
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> comm = fn.collectives.ProcessGroup()
        >>> mesh = HsdpMesh(comm, comm)
        >>> mesh.shape, mesh.rows(0), mesh.multiple
        ((1, 1), (0, 1), 8)
        >>> dist.destroy_process_group()
    """

    accumulates_locally = False

    def __init__(self, shard: ProcessGroup, replicas: ProcessGroup) -> None:
        super().__init__(shard)
        nodes = replicas.world_size
        self.exchange, self.shape, self.communicates = replicas, (shard.world_size, nodes), True
        self.header, self.multiple = [nodes], row_multiple(nodes)
        for hop, comm in (("intra", shard), ("inter", replicas)):
            group = comm.group or dist.group.WORLD
            self.hops[tuple(dist.get_process_group_ranks(group))] = hop

    def rows(self, rank: int) -> tuple[int, int]:
        return rank, 1

    def gathered(self, row: torch.Tensor) -> torch.Tensor:
        return row

    def own_row(self, signs: PackedSigns, rank: int) -> PackedSigns:
        del rank
        return signs

    def compressed_gradient(
        self, module: Any, grads: dict[str, torch.Tensor | None], check: bool
    ) -> tuple[torch.Tensor, bool]:
        del check  # .grad is what the update reads
        return module.node_row(grads), False

    def warmup_stats(self, stats: Stats) -> list[float]:
        del stats  # they come once the nodes have averaged the gradient
        return [0.0] * 4

    def warmup_totals(
        self, totals: torch.Tensor, modules: Iterable[Any], stats: Stats
    ) -> torch.Tensor:
        """Every module's accumulated node gradient (this rank's row, in ``.grad``) replaced by
        its mean over the nodes (one dense all-reduce per module that a backward
        reduce-scattered), then the statistics of the mean summed over the shard group."""
        del totals
        for module in modules:
            if module.received:
                self._average(module)
        mine = torch.tensor(stats(), dtype=torch.float64)
        if self.shard.world_size == 1:
            return mine
        return self.shard.all_gather(mine).view(-1, mine.numel()).sum(0)

    def _average(self, module: Any) -> None:
        mean = self.exchange.all_reduce(module.node_row(module.grad_shards()), "mean")
        for slot in module.layout.slots:
            local = local_shard(slot.param)
            values = mean[slot.offset : slot.offset + local.numel()].view(local.shape)
            if slot.param.grad is None:
                slot.param.grad = shard_of(values.clone(), slot.param)
            else:
                local_shard(slot.param.grad).copy_(values)

    def momentum_state(self, layout: ModuleLayout, signs: PackedSigns | None) -> dict[str, Any]:
        """This rank's row (its ``N`` chunks), a DTensor over the shard mesh (the same on the
        ``N`` peers: DCP keeps one copy)."""
        param = layout.slots[0].param
        packed = torch.zeros(layout.padded_row // 8, dtype=torch.uint8, device=param.device)
        scales = torch.zeros(self.exchange.world_size, device=param.device)
        if signs is not None:
            packed, scales = signs.packed.reshape(-1), signs.scales.reshape(-1)
        return {"packed": rows_of_ranks(packed, param), "scales": rows_of_ranks(scales, param)}

    def momentum_template(self, layout: ModuleLayout) -> dict[str, Any] | None:
        return self.momentum_state(layout, None)
