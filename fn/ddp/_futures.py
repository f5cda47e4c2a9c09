"""The two answers a DDP comm hook gives: a completed future, or an in-flight dense mean."""

from __future__ import annotations

import torch
import torch.distributed as dist


def completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``tensor`` (a hook whose work is done, or that sent nothing)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def dense_mean(
    tensor: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.futures.Future[torch.Tensor]:
    """The mean of ``tensor`` over ``group``, in place, asynchronously.

    fn's arithmetic (``fn.collectives.ProcessGroup.all_reduce``): the sum over the ranks, then
    one division by ``W``. (DDP's own default multiplies by ``1 / W`` before summing; the two
    agree bit for bit when ``W`` is a power of two.)
    """
    world_size = dist.get_world_size(group)
    work = dist.all_reduce(tensor, dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0].div_(world_size))
