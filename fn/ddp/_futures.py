"""The answers a DDP comm hook gives: a completed future (holding a result or the error that
computing it raised), or an in-flight dense mean."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``tensor`` (a hook whose work is done, or that sent nothing)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def completed_call(compute: Callable[[], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
    """A future holding ``compute()``, run now (the callback of a completed future runs inline),
    or the exception it raised: DDP raises that from the backward and recovers at the next
    one, as from a failed collective, where an exception raised by the hook itself leaves its
    reducer unusable."""
    return completed(torch.empty(0)).then(lambda _: compute())  # runs now, here


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
