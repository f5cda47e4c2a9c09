"""``ManagerComm``: fn's ``Comm`` over a torchft ``Manager``'s process group, whose failures the
Manager records instead of raising them, so that its commit vote discards the step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    ReduceOp,
)
from torchft import Manager

from fn.collectives.comm import ByteCounter, check_chunked, check_op

__all__ = ["ManagerComm"]


class ManagerComm(ByteCounter):
    """The collectives of the current quorum: the ranks of a torchft ``Manager``'s process group
    (one per replica group at this rank's position in its group), in the quorum's replica
    order.

    torchft reconfigures ``process_group`` at every quorum that changes the members, so
    ``world_size`` and ``rank`` are those of the last ``manager.start_quorum()``. A collective
    that fails or outlasts the Manager's timeout (``Manager(timeout=...)``, through
    ``manager.wrap_future``) is reported to the Manager (``manager.report_error``) and not
    raised: it returns zeros, and every later collective returns zeros at once without sending
    anything, until the next quorum; the Manager's commit vote (``manager.should_commit()``)
    then fails on this replica group, which discards the step. Bytes are counted as
    ``fn.collectives.ProcessGroup`` counts them, for what was sent.

    ``reduce_scatter`` is an ``all_to_all`` summed in rank order on the receiving rank (gloo has
    no reduce-scatter); ``split`` (the two-level collectives of ``local_world_size=``) is not
    built: a quorum's replicas carry no node layout.

    Args:
        manager: the ``torchft.Manager``, built with ``use_async_quorum=False``.
        process_group: the process group given to that Manager (``torchft.ProcessGroupGloo``,
            ``ProcessGroupBabyNCCL``, ...).

    Example:
        One replica group of one rank under a lighthouse of its own:

        >>> import torch.distributed as dist
        >>> from torchft import Manager, ProcessGroupGloo
        >>> from torchft.coordination import LighthouseServer
        >>> from fn.integrations.torchft import ManagerComm
        >>> lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
        >>> store = dist.TCPStore("localhost", 0, is_master=True)
        >>> pg = ProcessGroupGloo()
        >>> manager = Manager(
        ...     pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1,
        ...     use_async_quorum=False, replica_id="0", lighthouse_addr=lighthouse.address(),
        ...     store_addr="localhost", store_port=store.port, rank=0, world_size=1)
        >>> manager.start_quorum()
        >>> comm = ManagerComm(manager, pg)
        >>> comm.world_size, comm.rank, comm.all_gather(torch.tensor([1.0, 2.0]))
        (1, 0, tensor([[1., 2.]]))
        >>> manager.should_commit()
        True
        >>> manager.shutdown(wait=False)
        >>> lighthouse.shutdown()
    """

    def __init__(self, manager: Manager, process_group: torch.distributed.ProcessGroup) -> None:
        super().__init__()
        self.manager = manager
        self.process_group = process_group

    @property
    def world_size(self) -> int:
        return self.process_group.size()

    @property
    def rank(self) -> int:
        """This replica group's rank in the quorum (sorted by replica id)."""
        rank = self.manager.participating_rank()
        if rank is None:
            raise NotImplementedError(
                "fn.integrations.torchft: this replica has no rank in the quorum: it is "
                "recovering asynchronously (Manager(use_async_quorum=True)) or a spare "
                "(WorldSizeMode.FIXED_WITH_SPARES); fn's DiLoCo needs use_async_quorum=False "
                "and WorldSizeMode.DYNAMIC"
            )
        return rank

    def __repr__(self) -> str:
        return f"ManagerComm({self.process_group!r})"

    def split(self, local_world_size: int) -> tuple[ManagerComm, ManagerComm]:
        """Not built under torchft: a quorum's replica groups carry no node layout, so the
        two-level collectives (``local_world_size=``) have no groups to run on.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            f"ManagerComm.split({local_world_size}): the two-level collectives "
            "(local_world_size=) are not built under torchft, whose quorum has no node layout"
        )

    def _run(
        self, kind: str, x: torch.Tensor, out: torch.Tensor, start: Callable[[], Any]
    ) -> torch.Tensor:
        """Runs ``start()`` (one collective writing ``out``) and waits for it through the
        Manager; ``out``, or zeros where this or an earlier collective of the step failed."""
        if self.manager.errored() is None:
            try:
                work = start()
                self._count(kind, x)
                # on an error or the Manager's timeout: reported, and the default returned
                self.manager.wrap_future(work.get_future(), None).wait()
            except Exception as err:  # a failure to start: reported as the Manager does
                self.manager.report_error(err)
        # after an error a fresh tensor: an abandoned collective may still write into ``out``
        return out if self.manager.errored() is None else torch.zeros_like(out)

    def all_reduce(self, x: torch.Tensor, op: str = "mean") -> torch.Tensor:
        check_op(op)
        out = x.clone(memory_format=torch.contiguous_format)
        options = AllreduceOptions()
        options.reduceOp = ReduceOp.SUM
        out = self._run("all_reduce", x, out, lambda: self.process_group.allreduce([out], options))
        return out / self.world_size if op == "mean" else out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        world_size = self.world_size
        flat = x.contiguous().view(-1)
        out = x.new_empty(world_size * x.numel())
        out = self._run(
            "all_gather",
            x,
            out,
            lambda: self.process_group.allgather_into_tensor_coalesced(
                [out], [flat], AllgatherOptions()
            ),
        )
        return out.view(world_size, *x.shape)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        check_chunked(x, self.world_size, "all_to_all")
        x = x.contiguous()
        out = torch.empty_like(x)
        return self._run(
            "all_to_all",
            x,
            out,
            lambda: self.process_group.alltoall_base(out, x, [], [], AllToAllOptions()),
        )

    def reduce_scatter(self, x: torch.Tensor, op: str = "mean") -> torch.Tensor:
        check_op(op)
        pieces = self.all_to_all(x)  # row i: rank i's chunk for this rank (the same bytes)
        total = torch.zeros_like(pieces[0])
        for piece in pieces.unbind(0):  # in rank order, as fn.kernels.sum_ranks
            total = total + piece
        return total / self.world_size if op == "mean" else total
