"""``ElasticDiLoCo``: fn.diloco's outer step under a torchft ``Manager``: the exchange runs over
the current quorum's participants, an outer step is applied only when the Manager's commit vote
passes, and a (re)joining worker recovers the anchor, the outer state and the counters from a
live peer through torchft's recovery."""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchft import Manager

from fn.base import GradientTransformation, OptState
from fn.collectives import (
    Local,
    Simulated,
    error_feedback_leaves,
    local_shard,
    positional_leaves,
)
from fn.collectives.agreement import digest
from fn.collectives.dcp import initializing_optimizer_state
from fn.diloco import OuterStep, outer_update, pseudo_gradient, trainable_params
from fn.diloco.buffers import Buffers, CapturedBuffers
from fn.diloco.checkpoint import (
    diloco_state_dict,
    restored,
    settings_record,
)
from fn.diloco.fragment import anchor_on
from fn.diloco.inner import InnerOptimizer
from fn.diloco.rules import outer_rule
from fn.diloco.sharding import worker_mesh_comms
from fn.errors import check_int, user_stacklevel
from fn.integrations.torchft.comm import ManagerComm
from fn.tree import tree_all_finite, tree_flatten, tree_unflatten

__all__ = ["POSITIONAL_COMPRESSIONS", "ElasticDiLoCo"]

logger = logging.getLogger(__name__)

POSITIONAL_COMPRESSIONS = ("onebit", "loco4")
"""The compressions all of whose error feedback belongs to this worker's position in the quorum
(:func:`fn.collectives.positional_leaves` of their state). The 1-bit allreduce's server error
is rank ``r``'s chunk of the mean and both its errors are padded to a multiple of the number of
workers ``W``; LoCo's all-gather error is rank ``r``'s chunk, and its errors are padded to ``W``
groups. Where the quorum's ``W`` or this worker's rank changes, their error feedback restarts
from zero (logged), and a loaded checkpoint's does too. ``"topk"``'s (and ``"sparseloco"``'s
accumulator) is laid out as the parameters (:data:`fn.collectives.ParamShapedErrorFeedbackField`)
and carries over, but for the owner's error of its owner-partitioned exchange
(:class:`~fn.collectives.TopkOwnerState`'s ``server_error``, the chunks this rank owns), which
restarts; and where the quorum's ``W`` changes the exchange ``"auto"`` chooses
(:func:`~fn.collectives.topk_exchange_form`), all of it restarts.

Example:
    >>> from fn.integrations.torchft import POSITIONAL_COMPRESSIONS
    >>> POSITIONAL_COMPRESSIONS
    ('onebit', 'loco4')
"""


def _merged(shared: list[Any], fresh: OptState, carried: list[Any] | None = None) -> OptState:
    """``fresh`` (the rule's initial state) with its leaves other than the error feedback taken
    from ``shared``, in leaf order (copies on ``fresh``'s devices), and its error feedback
    from ``carried`` (one entry a leaf of ``fresh``) where that holds one, not ``None``."""
    leaves, spec = tree_flatten(fresh)
    feedback = error_feedback_leaves(fresh)
    carried = carried or [None] * len(leaves)
    kept = iter(shared)
    out = []
    for leaf, is_feedback, old in zip(leaves, feedback, carried, strict=True):
        if is_feedback:
            out.append(leaf if old is None else old)
            continue
        value = next(kept)
        out.append(value.to(leaf.device, copy=True) if isinstance(leaf, torch.Tensor) else value)
    return tree_unflatten(out, spec)


def _check_options(sync_every: int, max_sit_outs: int | None, fragments: Any, delay: int) -> None:
    """Raises for an invalid ``sync_every`` or ``max_sit_outs``, and ``NotImplementedError``
    for Streaming DiLoCo, with the reason."""
    check_int("ElasticDiLoCo: sync_every", sync_every, minimum=1)
    if max_sit_outs is not None:
        check_int("ElasticDiLoCo: max_sit_outs", max_sit_outs, minimum=1)
    if fragments != 1 or delay != 0:
        raise NotImplementedError(
            "ElasticDiLoCo: Streaming DiLoCo (fragments, delay) is not built under torchft: "
            "each fragment's outer step would need a quorum and a commit vote of its own, a "
            "worker joining between them would recover fragments of different ages, and a "
            "delayed exchange would run on the Manager's process group while the next "
            "quorum may reconfigure it; use fragments=1, delay=0"
        )


class ElasticDiLoCo:
    """DiLoCo whose workers are torchft replica groups that may leave and join without stopping
    the job.

    Registers a post-step hook on ``inner_optimizer``: after every ``sync_every``-th ``step()``,
    one outer step, run by ``manager``:

    1. ``manager.start_quorum()``: the quorum of this step. A worker behind the others (a
       restarted one, or one whose last commit failed) recovers here, from a live peer through
       torchft's checkpoint transport: the anchor, the outer state (the momentum) and the
       counters; its parameters are set to the anchor, its own error feedback to zero (its
       inner optimizer's state is its own: fresh in a restarted process), and it sits this step
       out. Where the quorum's number of workers or this worker's rank changed, the error
       feedback of :data:`POSITIONAL_COMPRESSIONS` restarts from zero (logged).
    2. :func:`fn.diloco.outer_update` over :class:`ManagerComm`, the quorum's process group:
       the mean over this step's participants, the same compressors and rules, bit for bit, as
       ``fn.diloco.DiLoCo``. A worker sits out where it is recovering, or, as in
       ``fn.diloco.DiLoCo``, where its pseudo-gradient or its inner optimizer's state holds NaN
       or Inf: then it continues from the new anchor with its inner optimizer's state reset, and
       warns (``RuntimeWarning``, on that worker); one that sits out ``max_sit_outs`` steps in a
       row for that reason raises ``RuntimeError`` (it leaves the job, the others go on). The
       exchange's header carries a checksum of the settings: where a worker was started with
       others, every worker raises the same ``ValueError`` before anything changes. A
       collective that fails or outlasts the Manager's timeout is reported to the Manager, not
       raised.
    3. ``manager.should_commit()``: where the vote passes, the anchor, the outer state and the
       error feedback take their new values and the parameters continue from the new anchor;
       where it fails, all stay as they were, and the parameters too (this worker's inner
       steps since the last commit go into its next pseudo-gradient; if the others committed,
       it recovers from them at the next quorum).

    Without faults the run is ``fn.diloco.DiLoCo``'s over the same workers (in replica-id order)
    bit for bit. docs/guides/diloco.md, "Elastic DiLoCo with torchft", gives the set-up and
    what a worker that leaves or joins loses.

    Args:
        model: the worker's model (unsharded, or sharded by FSDP2 on a 1-D mesh or HSDP
            inside the replica group: ``process_group`` then connects the replica groups' ranks
            at this rank's position).
        inner_optimizer: the optimizer of ``model``'s parameters, stepped by the training loop.
        manager: the ``torchft.Manager`` of this rank, built with ``use_async_quorum=False``
            (and ``WorldSizeMode.DYNAMIC``, the default).
        process_group: the process group given to ``manager``.
        sync_every: ``H``, inner steps per outer step.
        outer: ``"nesterov"`` or ``"sparseloco"`` (``fn.diloco.OUTER_RULES``).
        outer_options: its options, as ``fn.diloco.DiLoCo``'s.
        compression: one of ``fn.diloco.COMPRESSIONS`` (``None``: ``"fp32"``).
        compression_options: its options.
        fragments: 1 (Streaming DiLoCo's fragments are not built under torchft).
        delay: 0 (nor its delayed exchange).
        anchor_device: where the anchor lives (``None``: each parameter's device); the outer
            state stays on the parameters' devices, where the outer step runs.
        timeout: the timeout of the collectives inside a sharded worker (``None``:
            ``$FN_TIMEOUT``); those between the workers take the Manager's.
        max_sit_outs: the outer steps in a row this worker may sit out for NaN or Inf before it
            raises (``None``: never).
        buffers: the model's buffers at a committed outer step, as ``fn.diloco.DiLoCo``'s:
            ``"mean"`` averaged over the step's participants (the others from the first one;
            a worker whose floating buffers hold NaN or Inf sits the step out), ``"local"``
            each worker's own.
        name: the key of this object's state among the Manager's state dict functions.

    Raises:
        ValueError: a setting out of range.
        NotImplementedError: ``fragments`` other than 1 or ``delay`` other than 0.

    Attributes:
        inner_steps: the inner steps counted (recovered from a peer on joining).
        outer_steps: the committed outer steps (those without participants included).
        skipped_steps: the committed outer steps in which no worker took part.
        sat_out_steps: the committed outer steps this worker sat out (recovering or not
            finite).
        failed_commits: the outer steps whose commit vote failed on this worker.
        participants: the workers that took part in the last outer step, by quorum rank.

    Example:
        One worker of one rank under a lighthouse of its own (a job runs the lighthouse apart,
        ``torchft_lighthouse``, and one such program per replica group):

        >>> import torch.distributed as dist
        >>> from torchft import Manager, ProcessGroupGloo
        >>> from torchft.coordination import LighthouseServer
        >>> from fn.integrations.torchft import ElasticDiLoCo
        >>> lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
        >>> store = dist.TCPStore("localhost", 0, is_master=True)  # this replica group's
        >>> pg = ProcessGroupGloo()
        >>> manager = Manager(
        ...     pg=pg, load_state_dict=None, state_dict=None, min_replica_size=1,
        ...     use_async_quorum=False, replica_id="0", lighthouse_addr=lighthouse.address(),
        ...     store_addr="localhost", store_port=store.port, rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> diloco = ElasticDiLoCo(model, inner, manager=manager, process_group=pg, sync_every=2)
        >>> for _ in range(4):
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     inner.step()  # every 2nd: a quorum, the outer step, the commit vote
        ...     inner.zero_grad()
        >>> diloco.outer_steps, diloco.participants, manager.current_step()
        (2, [True], 2)
        >>> manager.shutdown(wait=False)
        >>> lighthouse.shutdown()
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        manager: Manager,
        process_group: torch.distributed.ProcessGroup,
        sync_every: int,
        outer: str = "nesterov",
        outer_options: Mapping[str, Any] | None = None,
        compression: str | None = None,
        compression_options: Mapping[str, Any] | None = None,
        fragments: int = 1,
        delay: int = 0,
        anchor_device: torch.device | str | None = None,
        timeout: Any = None,
        max_sit_outs: int | None = 3,
        buffers: str = "mean",
        name: str = "fn.diloco",
    ) -> None:
        _check_options(sync_every, max_sit_outs, fragments, delay)
        if not callable(getattr(manager, "start_quorum", None)):
            raise TypeError(f"ElasticDiLoCo: manager must be a torchft Manager, got {manager!r}")
        if process_group is None:
            raise TypeError(
                "ElasticDiLoCo: process_group must be the process group the Manager was built "
                "with (its pg=), got None"
            )
        self.manager = manager
        self.comm = ManagerComm(manager, process_group)
        self._params = trainable_params(model, "ElasticDiLoCo")
        self._within = worker_mesh_comms(self._params, timeout)
        outer_options, options = dict(outer_options or {}), dict(compression_options or {})
        self._rule_over = functools.partial(outer_rule, outer, outer_options, compression, options)
        self._rule = self._rule_over(self.comm)
        self._positional = compression in POSITIONAL_COMPRESSIONS
        # sized for one worker until the first quorum gives the number of workers
        self._local_rule = self._rule_over(Local())
        self._buffers = Buffers(model, buffers)
        self.sync_every = sync_every
        self._settings = settings_record(
            sync_every=sync_every,
            fragments=[list(range(len(self._params)))],
            delay=0,
            mix=0.0,
            outer=(outer, outer_options),
            compression=(compression, options),
            params=self._params,
        )
        # in every exchange's header and in a recovery: the settings and the buffers' policy
        # and layout (which DiLoCo compares when it is built; a checkpoint holds the settings)
        self._agreed = repr({**self._settings, "buffers": (buffers, self._buffers.layout())})
        self._settings_digest = digest(self._agreed)
        self._anchor = [x.to(anchor_device or x.device, copy=True) for x in self._shards()]
        self._position: tuple[int, int] | None = None  # (W, rank) of the quorum the state fits
        self._state = self._fresh_state(self._local_rule)
        self._recovered = False
        self._inner = InnerOptimizer(inner_optimizer)
        self.max_sit_outs = max_sit_outs
        self._faulty_in_a_row = 0
        self.inner_steps = 0
        self.outer_steps = 0
        self.skipped_steps = 0
        self.sat_out_steps = 0
        self.failed_commits = 0
        self.participants: list[bool] = []
        try:
            manager.register_state_dict_fn(name, self._load_recovered, self._recovery_state)
        except AssertionError as err:  # torchft's check of a key registered before
            raise ValueError(
                f"ElasticDiLoCo: this Manager already holds a state named {name!r} (another "
                "ElasticDiLoCo on it, or one built on it before): give each its own name="
            ) from err
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)

    def remove(self) -> None:
        """Detaches the hook from the inner optimizer: its ``step()`` no longer counts."""
        self._hook.remove()

    def _shards(self) -> list[torch.Tensor]:
        """This rank's part of the parameters (views: writing them writes the parameters)."""
        return [local_shard(p.detach()) for p in self._params]

    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        if initializing_optimizer_state():  # DCP's state_dict API creating a fresh state
            return
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self._outer_step()

    def sync(self) -> bool:
        """Runs an outer step now (the hook runs them every ``sync_every`` inner steps), e.g.
        at the end of training. Every worker of the quorum must call it at the same point.

        Returns:
            Whether the Manager's commit vote passed (the step then applied).
        """
        return self._outer_step()

    @torch.no_grad()
    def _outer_step(self) -> bool:
        self._recovered = False
        self.manager.start_quorum()  # a worker behind the others recovers in here
        result, offered = None, False
        if self.manager.errored() is None:  # else the quorum failed: the vote fails too
            self._fit_state_to_quorum()
            params = self._shards()
            anchor = anchor_on(self._anchor, params)
            delta = pseudo_gradient(anchor, params)
            captured = self._buffers.capture()
            takes_part = (
                self._inner.finite(self._params)
                & (not self._recovered)
                & Buffers.finite(captured, delta[0].device if delta else None)
            )
            offered = bool(takes_part) and bool(tree_all_finite(delta))
            result, buffers = self._exchange(anchor, delta, captured, takes_part=takes_part)
        committed = self.manager.should_commit()
        if not committed or result is None:
            self.failed_commits += 1
            error = self.manager.errored()
            logger.info(
                "fn.integrations.torchft: the outer step after inner step %d was not committed "
                "(%s); the anchor, the outer state and the error feedback are unchanged%s",
                self.inner_steps,
                getattr(error, "original_exception", error) or "the commit vote failed",
                "" if self._recovered else ", this worker keeps its parameters",
            )
            return False
        for a, q, new in zip(self._anchor, self._shards(), result.anchor, strict=True):
            a.copy_(new)
            q.copy_(new)
        if buffers is not None:
            Buffers.write(*buffers)
        self._state = result.state
        self.participants = [bool(x) for x in result.participants.tolist()]
        self.outer_steps += 1
        self.skipped_steps += int(not bool(result.applied))
        mine = self.participants[self.comm.rank]
        self.sat_out_steps += not mine
        self._faulty_in_a_row = 0 if mine or self._recovered else self._faulty_in_a_row + 1
        if self._faulty_in_a_row:
            # offered a finite step, yet no worker took part: the result was not finite
            self._sat_out_for_a_fault(overflowed=offered and not any(self.participants))
        return True

    def _sat_out_for_a_fault(self, *, overflowed: bool) -> None:
        """This worker sat out for NaN or Inf (``overflowed``: its step was finite, but the
        participants' mean or its outer update was not, so no worker took part): its inner
        optimizer starts afresh; it warns, and raises after ``max_sit_outs`` such steps in a
        row."""
        self._inner.reset()
        checked = (
            "pseudo-gradient, its inner optimizer's state or its buffers"
            if self._buffers.checked()
            else "pseudo-gradient or its inner optimizer's state"
        )
        what = (
            f"the outer step after inner step {self.inner_steps} was skipped: the participants' "
            "pseudo-gradients were finite, but their mean or its outer update overflowed; this "
            "worker"
            if overflowed
            else f"this worker's {checked} held NaN or Inf at inner step {self.inner_steps}: it "
            "sat the outer step out (the others' mean was applied) and"
        )
        warnings.warn(
            f"ElasticDiLoCo: {what} lost its inner steps since the last outer step (its "
            f"parameters were reset to the anchor), {self._inner.what_reset()}, and its error "
            "feedback was kept (check its data, inner and outer learning rates and loss scale)",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )
        limit = self.max_sit_outs
        if limit is not None and self._faulty_in_a_row >= limit:
            raise RuntimeError(
                f"ElasticDiLoCo: this worker sat out {limit} outer steps in a row for NaN or Inf "
                f"(max_sit_outs={limit}), so it no longer trains with the others; it raises, and "
                "the others go on without it at their next quorum. Check its data, inner "
                "learning rate and loss scale, or pass max_sit_outs=None to go on"
            )

    def _exchange(
        self,
        anchor: list[torch.Tensor],
        delta: list[torch.Tensor],
        captured: CapturedBuffers | None,
        *,
        takes_part: Any,
    ) -> tuple[OuterStep | None, tuple[CapturedBuffers, Any] | None]:
        """The outer update over the quorum and the ``captured`` buffers the workers continue
        with, or ``(None, None)`` where a collective failed (reported to the Manager, whose
        commit vote then fails)."""
        try:
            result = outer_update(
                self._rule,
                anchor,
                delta,
                self._state,
                comm=self.comm,
                within=self._within,
                takes_part=takes_part,
                header={"settings": self._settings_digest},
            )
            if captured is None:
                return result, None
            rank = self.comm.rank
            values = Buffers.exchange(captured, self.comm, self._within, result.participants, rank)
            return result, (captured, values)
        except Exception as err:
            if self.manager.errored() is None:
                raise
            # a consequence of the failed collective (zeros where a message was expected)
            logger.info("fn.integrations.torchft: the outer exchange failed: %s", err)
            return None, None

    def _fresh_state(self, rule: GradientTransformation) -> OptState:
        """``rule``'s initial state on the parameters' devices, where the outer step runs (also
        where the anchor lives on another device)."""
        return rule.init(anchor_on(self._anchor, self._shards()))

    def _fit_state_to_quorum(self) -> None:
        """Lays the state out for this quorum, as the rule initializes it for its ``W`` and this
        worker's rank: the error feedback laid out by position restarts from zero where ``W``
        or this rank changed (all of it where the state's structure changed: top-k's
        ``"auto"`` exchange choosing the other form); the rest carries over."""
        position = (self.comm.world_size, self.comm.rank)
        if self._position == position:
            return
        fresh = self._fresh_state(self._rule)
        old_leaves, old_spec = tree_flatten(self._state)
        restarts = self._positional or old_spec != tree_flatten(fresh)[1]  # nothing carries over
        keep = [not (restarts or positional) for positional in positional_leaves(fresh)]
        carried = [old_leaves[i] if k else None for i, k in enumerate(keep)]
        self._state = _merged(self._shared_leaves(self._state), fresh, carried)
        if self._position is not None and not all(
            k for k, f in zip(keep, error_feedback_leaves(fresh), strict=True) if f
        ):
            logger.info(
                "fn.integrations.torchft: the quorum changed (%d workers, rank %d -> %d "
                "workers, rank %d); the error feedback laid out by position restarts from zero",
                *self._position,
                *position,
            )
        self._position = position

    def _shared_leaves(self, state: OptState) -> list[Any]:
        """The leaves of ``state`` other than the error feedback, in leaf order."""
        leaves, _ = tree_flatten(state)
        feedback = error_feedback_leaves(state)
        return [x for x, f in zip(leaves, feedback, strict=True) if not f]

    def _counts(self) -> dict[str, Any]:
        return {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "skipped_steps": self.skipped_steps,
            "fragment_steps": [self.outer_steps],
        }

    def _recovery_state(self) -> dict[str, Any]:
        """What a recovering worker loads from this one: the anchor, the outer state without the
        error feedback, the counters and the settings (copies; taken on torchft's quorum
        thread while the training loop waits in ``start_quorum``)."""
        return {
            "anchor": [a.clone() for a in self._anchor],
            "outer_state": [
                x.clone() if isinstance(x, torch.Tensor) else x
                for x in self._shared_leaves(self._state)
            ],
            "counts": self._counts(),
            "settings": self._agreed,
        }

    @torch.no_grad()
    def _load_recovered(self, state: Mapping[str, Any]) -> None:
        """Takes a live peer's :meth:`_recovery_state`: the parameters and the anchor its
        anchor, its outer state with this worker's error feedback at zero, its counters."""
        fresh = self._fresh_state(self._rule)
        self._load_shared(state, fresh, "torchft's recovery", self._agreed)
        self._position = (self.comm.world_size, self.comm.rank)
        for q, a in zip(self._shards(), self._anchor, strict=True):
            q.copy_(a)
        self._recovered = True
        logger.info(
            "fn.integrations.torchft: recovered the anchor, the outer state and the counters "
            "(inner step %d, outer step %d) from a live peer; this worker sits this outer step "
            "out and its error feedback starts at zero",
            self.inner_steps,
            self.outer_steps,
        )

    def _load_shared(
        self, state: Mapping[str, Any], fresh: OptState, where: str, settings: str
    ) -> None:
        """Loads the anchor, the outer state's leaves other than the error feedback (that of
        ``fresh`` instead) and the counters of ``state``, checked first (its ``settings`` must
        be ``settings``)."""
        if state["settings"] != settings:
            raise ValueError(
                f"ElasticDiLoCo: the state from {where} has the settings {state['settings']}, "
                f"this worker {settings}: every worker must pass the same settings; "
                "nothing was loaded"
            )
        anchor = [local_shard(x) for x in state["anchor"]]
        shared = [
            local_shard(x) if isinstance(x, torch.Tensor) else x for x in state["outer_state"]
        ]
        mine = self._shared_leaves(fresh)
        if (
            len(anchor) != len(self._anchor)
            or len(shared) != len(mine)
            or any(
                isinstance(b, torch.Tensor) and a.shape != b.shape
                for a, b in zip([*anchor, *shared], [*self._anchor, *mine], strict=True)
            )
        ):
            raise ValueError(
                f"ElasticDiLoCo: the state from {where} has tensors of other shapes (another "
                "model?); nothing was loaded"
            )
        self._restore(anchor, _merged(shared, fresh), state["counts"])

    def _restore(self, anchor: list[Any], outer_state: OptState, counts: Mapping[str, Any]) -> None:
        """Sets the anchor, the outer state and the counters, once checked."""
        for a, saved in zip(self._anchor, anchor, strict=True):
            a.copy_(saved)
        self._state = outer_state
        self.inner_steps = counts["inner_steps"]
        self.outer_steps = counts["outer_steps"]
        self.skipped_steps = counts["skipped_steps"]

    def state_dict(self) -> dict[str, Any]:
        """This worker's state for a full restart, in ``fn.diloco.DiLoCo``'s format (a
        ``DiLoCo`` of the same settings loads it, and this object loads a ``DiLoCo``'s taken
        outside an exchange): the anchor, the outer state, the counters and the settings under
        shared keys, this rank's error feedback under ``state["per_rank"]["rank<r>"]``.

        Save it on every rank (``torch.save``, or ``fn.fsdp.TrainingCheckpoint(...,
        extra={"diloco": elastic})``) beside the model, the inner optimizer and
        ``manager.state_dict()``.

        Returns:
            A dict of tensors, lists of tensors and Python values (fresh copies).
        """
        return diloco_state_dict(
            self._anchor,
            [self._state],
            self._params,
            self._settings["fragments"],
            counts=self._counts(),
            settings=repr(self._settings),
            world_size=self._position[0] if self._position else 1,
            delta_size=sum(x.numel() for x in self._shards()),
            buffers=self._buffers.targets(),
            worker=self._position[1] if self._position else 0,
        )

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict` (or a ``fn.diloco.DiLoCo``'s of the same settings)
        for a full restart, on any number of workers: the anchor, the outer state and the
        counters load; this rank's error feedback loads where the checkpoint holds it in this
        layout (``"topk"``'s and ``"sparseloco"``'s), else restarts from zero with one warning;
        that of :data:`POSITIONAL_COMPRESSIONS` restarts from zero (logged), as at a change of
        the quorum. Each worker loads the file it saved: the error feedback under this rank's
        key is that worker's own (a replica group of one rank saves it as ``"rank0"``).

        Args:
            state: what :meth:`state_dict` returned (``torch.load`` of this worker's file, or
                filled by ``torch.distributed.checkpoint``).

        Raises:
            ValueError: other settings, tensors of other shapes, or a checkpoint taken while
                an exchange was in flight; nothing was changed.
        """
        if state["in_flight"]["fragment"] is not None:
            raise ValueError(
                "ElasticDiLoCo.load_state_dict: the checkpoint was taken while an exchange was "
                "in flight (Streaming DiLoCo's delay), which ElasticDiLoCo does not run; "
                "nothing was loaded"
            )
        if self._positional:
            fresh = self._fresh_state(self._local_rule)
            self._load_shared(state, fresh, "the checkpoint", repr(self._settings))
            self._position = None
            logger.info(
                "fn.integrations.torchft: loaded a checkpoint; the error feedback of this "
                "compression restarts from zero"
            )
            return
        # the state as the rule lays it out for the checkpoint's quorum: its error feedback
        # loads, and the first quorum keeps what its number of workers and this rank allow
        workers = state["world_size"]
        loaded = restored(
            state,
            anchor=self._anchor,
            fresh_state=self._fresh_state(self._rule_over(Simulated(workers))),
            settings=repr(self._settings),
            world_size=workers,
        )
        self._restore(loaded.anchor, loaded.outer_state, loaded.counts)
        self._position = None if loaded.worker is None else (workers, loaded.worker)
