"""What the compression hooks share: a dense warmup, then a compressing transform per bucket
with its error feedback kept in a state that checkpoints."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from fn._validation import check_int
from fn.base import GradientTransformation
from fn.collectives import ProcessGroup
from fn.ddp._futures import completed, dense_mean
from fn.tree import tree_flatten, tree_unflatten

logger = logging.getLogger("fn.ddp")
Layout = tuple[tuple[int, ...], ...]  # a bucket's param shapes, in order


class BucketHookState:
    """The state of a compression hook (see ``OnebitHookState``, ``LocoHookState``).

    Attributes:
        process_group: the ``torch.distributed`` group (``None``: the world).
        comm: ``fn.collectives.ProcessGroup(process_group)``, the transform's comm.
        start_iter: dense iterations before compression starts.
        iter: iterations made so far (one per backward pass that reached DDP's last bucket).
        transform: the compressing ``GradientTransformation`` applied to each bucket's buffer.
        buckets: per bucket index, ``(layout, transform state)``; ``layout`` is the bucket's
            param shapes, so a bucket that DDP rebuilt with other params gets fresh errors.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        start_iter: int,
        make_transform: Callable[[ProcessGroup], GradientTransformation],
    ) -> None:
        self.process_group = process_group
        self.comm = ProcessGroup(process_group)
        self.start_iter = check_int("start_iter", start_iter)
        self.iter = 0
        self.transform = make_transform(self.comm)
        self.buckets: dict[int, tuple[Layout, Any]] = {}

    def _bucket_state(self, index: int, layout: Layout, buffer: torch.Tensor) -> Any:
        """The transform state of bucket ``index``: its own, or fresh if it is new or its
        layout changed (with a log line)."""
        known = self.buckets.get(index)
        if known is not None and known[0] == layout:
            return known[1]
        if known is not None:
            logger.warning(
                "fn.ddp: bucket %d now holds %d elements in %d params (was %d in %d; DDP rebuilt "
                "its buckets): its error feedback is reset",
                index,
                buffer.numel(),
                len(layout),
                _numel(known[0]),
                len(known[0]),
            )
        return self.transform.init(buffer)

    def state_dict(self) -> dict[str, Any]:
        """The iteration count and every bucket's error feedback, for a checkpoint.

        Returns:
            ``{"iter": int, "rank": int, "world_size": int, "buckets": {index: {"layout":
            [[shape], ...], "state": [tensor, ...]}}}``: plain containers and tensors
            (``torch.load(weights_only=True)`` reads it). The error feedback is this rank's:
            save one per rank.
        """
        return {
            "iter": self.iter,
            "rank": self.comm.rank,
            "world_size": self.comm.world_size,
            "buckets": {
                index: {"layout": [list(s) for s in layout], "state": tree_flatten(state)[0]}
                for index, (layout, state) in self.buckets.items()
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict` of this rank.

        A state saved by another rank or world size keeps only the iteration count: its error
        feedback belongs to another rank, so it is dropped (with a warning) and every bucket
        starts from zero error.

        The errors are per bucket: the resumed run continues bit for bit when DDP gives it the
        buckets it saved. DDP starts with buckets in the params' order and rebuilds them once,
        after its first iteration, in the order the gradients arrived; a bucket that then holds
        other params restarts from zero error (logged). ``find_unused_parameters=True`` keeps
        the first buckets for good, so runs resume exactly.

        Raises:
            ValueError: a bucket's saved state does not fit the transform (nothing is changed).
        """
        buckets = {}
        same_rank = (state_dict["rank"], state_dict["world_size"]) == (
            self.comm.rank,
            self.comm.world_size,
        )
        if not same_rank:
            warnings.warn(
                f"fn.ddp: the hook state was saved by rank {state_dict['rank']} of "
                f"{state_dict['world_size']}, this is rank {self.comm.rank} of "
                f"{self.comm.world_size}: its error feedback is reset",
                stacklevel=2,
            )
        for index, saved in state_dict["buckets"].items() if same_rank else ():
            layout = tuple(tuple(s) for s in saved["layout"])
            leaves = list(saved["state"])
            device = leaves[0].device if leaves else None
            fresh, spec = tree_flatten(
                self.transform.init(torch.zeros(_numel(layout), device=device))
            )
            shapes = [tuple(x.shape) for x in fresh]
            if shapes != [tuple(x.shape) for x in leaves]:
                raise ValueError(
                    f"fn.ddp: bucket {index}'s saved state has shapes "
                    f"{[tuple(x.shape) for x in leaves]}, this hook's transform needs {shapes}"
                )
            buckets[int(index)] = (layout, tree_unflatten(leaves, spec))
        self.iter = int(state_dict["iter"])
        self.buckets = buckets


def _numel(layout: Layout) -> int:
    return sum(torch.Size(shape).numel() for shape in layout)


def compressing_hook(
    state: BucketHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The dense mean of the bucket for ``start_iter`` iterations, then ``state.transform``
    applied to it with the bucket's error feedback (synchronously: the returned future is
    complete)."""
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        future = dense_mean(buffer, state.process_group)
    else:
        index, layout = bucket.index(), tuple(tuple(p.shape) for p in bucket.parameters())
        mean, bucket_state = state.transform.update(
            buffer, state._bucket_state(index, layout, buffer)
        )
        state.buckets[index] = (layout, bucket_state)
        future = completed(buffer.copy_(mean))
    if bucket.is_last():
        state.iter += 1
    return future
