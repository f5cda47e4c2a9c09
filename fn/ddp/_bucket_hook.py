"""What the compression hooks share: a dense warmup, then a compressing transform per bucket
with its error feedback kept in a state that checkpoints, run on a background thread so that
the backward pass goes on meanwhile; one policy for non-finite buckets in both phases."""

from __future__ import annotations

import datetime
import functools
import logging
import operator
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from fn.base import GradientTransformation
from fn.collectives import ProcessGroup
from fn.collectives.agreement import agree
from fn.ddp._futures import completed_call, dense_mean
from fn.ddp._worker import SerialWorker
from fn.errors import NonFiniteError, all_finite, check_int, finite_or_raise
from fn.tree import tree_flatten, tree_unflatten

logger = logging.getLogger("fn.ddp")
Layout = tuple[tuple[int, ...], ...]  # a bucket's param shapes, in order
NONFINITE_POLICIES = ("propagate", "raise")


class BucketHookState:
    """The state of a compression hook (see ``OnebitHookState``, ``LocoHookState``): a subclass
    says which transform compresses the buckets (:meth:`_make_transform`).

    Attributes:
        process_group: the ``torch.distributed`` group (``None``: the world).
        comm: the transform's ``fn.collectives.ProcessGroup`` (with ``overlap``, over a group of
            the same ranks made for it, so that its collectives never interleave with DDP's).
        start_iter: dense iterations before compression starts.
        overlap: whether compressed buckets run on the state's background thread.
        nonfinite: ``"propagate"`` or ``"raise"`` (see ``OnebitHookState``).
        local_world_size: ranks per node of the two-level collectives, or ``None`` (flat).
        iter: iterations made so far (one per backward pass that reached DDP's last bucket and
            did not raise).
        transform: the compressing ``GradientTransformation`` applied to each bucket's buffer.
        buckets: per bucket index, ``(layout, transform state)`` as the last compressed
            iteration whose buckets were all finite left it; ``layout`` is the bucket's param
            shapes, so a bucket that DDP rebuilt with other params gets fresh errors.

    Reading ``iter`` or ``buckets``, :meth:`state_dict` and :meth:`load_state_dict` first wait
    for the buckets in flight. ``nonfinite`` is a setting, like ``overlap``: the checkpoint
    leaves it out.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        start_iter: int = 100,
        overlap: bool = True,
        timeout: datetime.timedelta | float | None = None,
        nonfinite: str = "propagate",
        local_world_size: int | None = None,
    ) -> None:
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            kind = type(process_group).__name__
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, got "
                f"{process_group!r} ({kind})"
            )
        self.process_group = process_group
        self.local_world_size = local_world_size
        # before any other collective (overlap's group): ranks built with other settings would
        # send buckets of other sizes or phases, which gloo aborts or waits on until the timeout
        settings = {
            "start_iter": start_iter,
            "overlap": overlap,
            "nonfinite": nonfinite,
            "local_world_size": local_world_size,
            **self._compression_settings(),
        }
        agree(
            ProcessGroup(process_group, timeout=timeout), f"fn.ddp.{type(self).__name__}", settings
        )
        fn_group = process_group
        if overlap:
            # fn's collectives then run on their own thread while DDP may send on its group
            # (e.g. find_unused_parameters' allreduce after the last bucket): a group of their
            # own keeps the two sequences apart, each in the same order on every rank
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            fn_group = dist.new_group(ranks, backend=dist.get_backend(process_group))
        self.comm = ProcessGroup(fn_group, timeout=timeout)
        self.start_iter = check_int("start_iter", start_iter)
        self.overlap = overlap
        self.nonfinite = nonfinite
        self.transform = self._make_transform(self.comm)
        self._iter = 0
        self._buckets: dict[int, tuple[Layout, Any]] = {}
        # the compressed iteration in flight: each bucket's new (layout, transform state), or
        # None where the bucket was not finite; committed at its last bucket if all are finite
        self._pending: dict[int, tuple[Layout, Any] | None] = {}
        # the dense iteration in flight under "raise": each bucket's checked mean
        self._dense_checks: dict[int, torch.futures.Future[torch.Tensor]] = {}
        # each bucket's layout and its params' identities at its last compressed hook call (the
        # hook's thread logs rebuilds; identities None: loaded, not seen since)
        self._layouts: dict[int, tuple[Layout, tuple[int, ...] | None]] = {}
        self._worker = SerialWorker(f"fn.ddp.{type(self).__name__}")
        # the error of a bucket that failed in the iteration in flight (overlap): the later
        # buckets of that iteration fail with it, without communicating, as they would not have
        # run inside the hook
        self._failed: BaseException | None = None

    def _make_transform(self, comm: ProcessGroup) -> GradientTransformation:
        """The compressing transform over ``comm`` (each hook's state says which)."""
        raise NotImplementedError

    def _compression_settings(self) -> dict[str, Any]:
        """The settings of the compression that every rank must share (none by default)."""
        return {}

    @property
    def iter(self) -> int:
        self._worker.drain()
        return self._iter

    @property
    def buckets(self) -> dict[int, tuple[Layout, Any]]:
        self._worker.drain()
        return self._buckets

    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The hook's work on one bucket: its dense mean for ``start_iter`` iterations, then
        ``transform`` applied to it with the bucket's error feedback: handed to the state's
        background thread with ``overlap`` (the future completes when the bucket is reduced,
        or with its error), else run here (the future is complete). A bucket with a NaN or an
        Inf on some rank gets the same answer on every rank from no collective of its own
        (``nonfinite``): the dense mean of such a bucket is non-finite on every rank
        (``"raise"`` checks each mean), the compressed collectives raise
        ``fn.NonFiniteError`` on every rank.

        Args:
            bucket: DDP's gradient bucket.

        Returns:
            The future of the bucket's reduced gradients.
        """
        buffer = bucket.buffer()
        last = bucket.is_last()
        index = bucket.index()
        if self._iter < self.start_iter:
            return self._dense(index, buffer, last)
        params = bucket.parameters()
        layout = tuple(tuple(p.shape) for p in params)
        if self._note_layout(index, layout, tuple(map(id, params)), buffer.numel()):
            # its error feedback was the old params' (the last iteration is done: DDP waited)
            self._buckets.pop(index, None)
        compress = functools.partial(self._compress, index, layout, buffer, last)
        if not self.overlap:
            return completed_call(compress)
        return self._worker.submit(functools.partial(self._in_order, index, compress, last))

    def _note_layout(self, index: int, layout: Layout, params: tuple[int, ...], numel: int) -> bool:
        """Records bucket ``index``'s layout and its ``params`` (their ids); logs when DDP
        rebuilt the bucket with other params (other shapes, or params of the same shapes in
        another order), and returns whether it did."""
        known = self._layouts.get(index)
        self._layouts[index] = (layout, params)
        if known is None:
            return False
        moved = known[0] != layout or known[1] not in (None, params)
        if moved:
            logger.warning(
                "fn.ddp: bucket %d now holds %d elements in %d params (was %d in %d; DDP rebuilt "
                "its buckets): its error feedback is reset",
                index,
                numel,
                len(layout),
                _numel(known[0]),
                len(known[0]),
            )
        return moved

    def _dense(
        self, index: int, buffer: torch.Tensor, last: bool
    ) -> torch.futures.Future[torch.Tensor]:
        """The dense mean of bucket ``index``; the iteration counts at the last bucket. Under
        ``"raise"`` each mean is checked (it is the same on every rank, so every rank raises
        alike) and the iteration counts once every bucket's check passed."""
        mean = dense_mean(buffer, self.process_group)
        if self.nonfinite == "propagate":
            if last:
                self._iter += 1
            return mean
        if index in self._dense_checks:  # left by an iteration that failed before its end
            self._dense_checks.clear()
        checked = mean.then(functools.partial(_finite_mean, index))
        self._dense_checks[index] = checked
        if not last:
            return checked
        checks, self._dense_checks = list(self._dense_checks.values()), {}
        return torch.futures.collect_all(checks).then(self._count_dense)

    def _count_dense(
        self, checks: torch.futures.Future[list[torch.futures.Future]]
    ) -> torch.Tensor:
        """The last bucket's mean, once every bucket's mean of the iteration passed its check
        (``checks.value()`` raises the first failure); counts the iteration."""
        mean = checks.value()[-1].value()
        self._iter += 1
        return mean

    def _compress(
        self, index: int, layout: Layout, buffer: torch.Tensor, last: bool
    ) -> torch.Tensor:
        """``buffer`` replaced by the transform's output with bucket ``index``'s error feedback
        (fresh if the bucket is new or its layout changed), or by NaN where some rank's bucket
        is not finite (``"propagate"``; ``"raise"`` raises). The new error feedback of the
        iteration's buckets is committed at its last bucket, and only if every bucket was
        finite; the iteration counts there."""
        if index in self._pending:  # left by an iteration that failed before its end
            self._pending.clear()
        known = self._buckets.get(index)
        bucket_state = (
            known[1] if known is not None and known[0] == layout else self.transform.init(buffer)
        )
        try:
            mean, bucket_state = self.transform.update(buffer, bucket_state)
            if self.comm.world_size == 1:  # the transforms pass one rank's values on unchecked
                finite_or_raise(mean, "its gradients hold a NaN or an Inf")
        except NonFiniteError as err:
            if self.nonfinite == "raise":
                self._pending.clear()
                raise _nonfinite(index, str(err)) from err
            logger.info(
                "fn.ddp: bucket %d is not finite on some rank (%s): passed on as NaN, no error "
                "feedback of this iteration is kept",
                index,
                err,
            )
            self._pending[index] = None
            buffer.fill_(torch.nan)
        except BaseException:
            self._pending.clear()
            raise
        else:
            self._pending[index] = (layout, bucket_state)
            buffer.copy_(mean)
        if last:
            pending, self._pending = self._pending, {}
            if all(entry is not None for entry in pending.values()):
                self._buckets.update(pending)
            self._iter += 1
        return buffer

    def _in_order(
        self, index: int, compress: Callable[[], torch.Tensor], last: bool
    ) -> torch.Tensor:
        """``compress()`` on the background thread, unless an earlier bucket of the iteration
        failed (every rank fails in the same bucket: fn's collectives raise together)."""
        try:
            if self._failed is not None:
                raise RuntimeError(
                    f"fn.ddp: bucket {index} was not reduced: an earlier bucket of this "
                    f"iteration failed ({self._failed})"
                ) from self._failed
            return compress()
        except BaseException as err:
            if self._failed is None:
                self._failed = err
            raise
        finally:
            if last:
                self._failed = None

    def state_dict(self) -> dict[str, Any]:
        """The iteration count and every bucket's error feedback, for a checkpoint.

        Returns:
            The state as plain containers and tensors (``torch.load(weights_only=True)``
            reads it), ``{"iter": int, "rank": int, "world_size": int, "local_world_size":
            int | None, "buckets": {index: {"layout": [[shape], ...], "state": [tensor,
            ...]}}}``. The error feedback is this rank's: save one per rank.
        """
        self._worker.drain()
        return {
            "iter": self._iter,
            "rank": self.comm.rank,
            "world_size": self.comm.world_size,
            "local_world_size": self.local_world_size,
            "buckets": {
                index: {"layout": [list(s) for s in layout], "state": tree_flatten(state)[0]}
                for index, (layout, state) in self._buckets.items()
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict` of this rank.

        A state saved by another rank, world size or ``local_world_size`` (none recorded:
        flat) keeps only the iteration count: its error feedback is dropped, with a warning.
        The resumed run continues bit for bit when DDP gives it the buckets it saved; DDP
        rebuilds its buckets once, after its first iteration (its second with
        ``static_graph=True``; not with ``find_unused_parameters=True``), and a bucket that
        then holds other params (or the same in another order, seen within a process: a loaded
        bucket's params are known from its next iteration on) restarts from zero error
        (logged).

        Raises:
            ValueError: an ``iter`` that is no int >= 0, or a bucket's saved state that does not
                fit the transform (other shapes or dtypes) or holds a NaN or an Inf (no
                iteration would be finite again); nothing is changed.
        """
        self._worker.drain()
        iteration = _iteration(state_dict["iter"])
        buckets = {}
        saved = (state_dict["rank"], state_dict["world_size"], state_dict.get("local_world_size"))
        here = (self.comm.rank, self.comm.world_size, self.local_world_size)
        same_rank = saved == here
        if not same_rank:
            warnings.warn(
                f"fn.ddp: the hook state was saved by {_rank_text(*saved)}, this is "
                f"{_rank_text(*here)}: its error feedback is reset",
                stacklevel=2,
            )
        for index, saved in state_dict["buckets"].items() if same_rank else ():
            layout = tuple(tuple(s) for s in saved["layout"])
            leaves = list(saved["state"])
            device = leaves[0].device if leaves else None
            fresh, spec = tree_flatten(
                self.transform.init(torch.zeros(_numel(layout), device=device))
            )
            forms = [(tuple(x.shape), x.dtype) for x in fresh]
            if forms != [(tuple(x.shape), x.dtype) for x in leaves]:
                raise ValueError(
                    f"fn.ddp: bucket {index}'s saved state has shapes and dtypes "
                    f"{[(tuple(x.shape), x.dtype) for x in leaves]}, this hook's transform needs "
                    f"{forms}"
                )
            if not all(all_finite(x) for x in leaves if x.is_floating_point()):
                raise ValueError(
                    f"fn.ddp: bucket {index}'s saved error feedback holds a NaN or an Inf (every "
                    "iteration after it would be non-finite): load an earlier checkpoint"
                )
            buckets[int(index)] = (layout, tree_unflatten(leaves, spec))
        self._iter = iteration
        self._buckets = buckets
        self._pending, self._dense_checks = {}, {}
        self._layouts = {index: (layout, None) for index, (layout, _) in buckets.items()}


def _iteration(value: Any) -> int:
    """A saved ``iter``: an int >= 0 (a 0-dim integer tensor too), or ``ValueError``."""
    try:
        iteration = operator.index(value)
    except TypeError:
        iteration = -1
    if isinstance(value, bool) or iteration < 0:
        raise ValueError(f"fn.ddp: the hook state's iter must be an int >= 0, got {value!r}")
    return iteration


def _rank_text(rank: int, world_size: int, local_world_size: int | None) -> str:
    level = "" if local_world_size is None else f" with local_world_size {local_world_size}"
    return f"rank {rank} of {world_size}{level}"


def _numel(layout: Layout) -> int:
    return sum(torch.Size(shape).numel() for shape in layout)


def _nonfinite(index: int, cause: str) -> NonFiniteError:
    return NonFiniteError(
        f"fn.ddp: bucket {index} is non-finite on some rank ({cause}); the hook state is "
        "unchanged (nonfinite='propagate' passes such buckets on, e.g. to torch.amp.GradScaler, "
        "which then skips the step)"
    )


def _finite_mean(index: int, mean: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    """The dense mean of bucket ``index``, or ``NonFiniteError`` if it is not finite."""
    value = mean.value()
    if not all_finite(value):
        raise _nonfinite(
            index,
            "its mean over the ranks holds a NaN or an Inf: a rank's gradients do, or "
            "their sum overflows",
        )
    return value
