"""``ProcessGroup``: the collectives of a ``torch.distributed`` process group.

Works with any backend that implements all_reduce, the flat all_gather / reduce_scatter and
all_to_all_single (gloo, nccl, xccl, hccl, mpi), for instance under ``torchrun``. Results are
new tensors: inputs are never changed. The collectives are not vmappable (use ``Simulated``
to batch ranks in one process).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fn.collectives import _traffic
from fn.collectives.comm import ByteCounter, ReduceOp, check_chunked, check_op, check_split

__all__ = ["ProcessGroup"]

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ProcessGroup(ByteCounter):
    """Collectives over ``group`` (``None``: the default group, which must be initialized).

    Args:
        group: a ``torch.distributed`` process group, or ``None`` for the world.
        counts_into: count the bytes sent into this comm's counter (used by :meth:`split`).

    Example:
        Under ``torchrun`` the launcher sets up the group; here a one-rank gloo group in this
        process stands in for it:

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> comm = fn.collectives.ProcessGroup()
        >>> comm.world_size, comm.all_reduce(torch.tensor([1.0, 2.0]))
        (1, tensor([1., 2.]))
        >>> dist.destroy_process_group()
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, counts_into: ProcessGroup | None = None
    ) -> None:
        super().__init__(counts_into)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroup needs torch.distributed.init_process_group() to have been called "
                "(e.g. by torchrun)"
            )
        self.group = group
        self._world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._splits: dict[int, tuple[ProcessGroup, ProcessGroup]] = {}

    def split(self, local_world_size: int) -> tuple[ProcessGroup, ProcessGroup]:
        """The intra-node and inter-node groups of this rank (group ranks ``node * L + local``).

        A collective call: every rank of the group must call it, in the same order (the groups
        are created once per ``local_world_size`` and cached).

        Args:
            local_world_size: ranks per node ``L``; must divide ``world_size``.

        Returns:
            ``(intra, inter)`` ``ProcessGroup``s that count their bytes into this one.
        """
        check_split(self._world_size, local_world_size)
        if local_world_size not in self._splits:
            members = (
                list(range(self._world_size))
                if self.group is None
                else dist.get_process_group_ranks(self.group)
            )
            nodes = self._world_size // local_world_size
            node, local = divmod(self.rank, local_world_size)
            intra = [
                dist.new_group(members[n * local_world_size : (n + 1) * local_world_size])
                for n in range(nodes)
            ]
            inter = [dist.new_group(members[i::local_world_size]) for i in range(local_world_size)]
            self._splits[local_world_size] = (
                ProcessGroup(intra[node], counts_into=self),
                ProcessGroup(inter[local], counts_into=self),
            )
        return self._splits[local_world_size]

    @property
    def world_size(self) -> int:
        return self._world_size

    def __repr__(self) -> str:
        return f"ProcessGroup(rank={self.rank}, world_size={self._world_size})"

    def _counted(self, kind: str, x: torch.Tensor) -> None:
        self._count(kind, _traffic.payload_bytes(x), self._world_size)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        check_op(op)
        self._counted("all_reduce", x)
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, dist.ReduceOp.SUM, group=self.group)
        return out / self._world_size if op == "mean" else out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._counted("all_gather", x)
        out = x.new_empty(self._world_size * x.numel())
        _all_gather_flat(out, x.contiguous().view(-1), group=self.group)
        return out.view(self._world_size, *x.shape)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        check_chunked(x, self._world_size, "all_to_all")
        self._counted("all_to_all", x)
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        check_op(op)
        check_chunked(x, self._world_size, "reduce_scatter")
        self._counted("reduce_scatter", x)
        out = x.new_empty(x[0].numel())
        _reduce_scatter_flat(out, x.contiguous().view(-1), dist.ReduceOp.SUM, group=self.group)
        out = out.view(x.shape[1:])
        return out / self._world_size if op == "mean" else out
