"""``DiLoCo``: the outer step hooked onto any inner optimizer's ``step()``, so that a training loop
does not change; the anchor, the outer state and the counters in a ``state_dict``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fn.base import EmptyState
from fn.collectives import (
    Comm,
    Local,
    Participation,
    ProcessGroup,
    Simulated,
    cast_allreduce,
    local_shard,
)
from fn.collectives.agreement import bit_checksum, digest
from fn.collectives.dcp import initializing_optimizer_state
from fn.diloco.agreement import agree_on_settings
from fn.diloco.buffers import Buffers
from fn.diloco.checkpoint import (
    InFlight,
    diloco_state_dict,
    restored,
    settings_record,
)
from fn.diloco.exchange import Exchanger
from fn.diloco.fragment import Fragment
from fn.diloco.inner import InnerOptimizer
from fn.diloco.isolation import isolation_problem
from fn.diloco.rules import outer_rule
from fn.diloco.sharding import worker_mesh_comms
from fn.diloco.sit_outs import SitOuts
from fn.diloco.step import trainable_params
from fn.diloco.streaming import StreamSchedule, fragment_indices
from fn.errors import check_fraction, check_int

__all__ = ["DiLoCo"]

logger = logging.getLogger(__name__)


class _UpdateCounter:
    """Counts a grad scaler's ``update()`` calls: the scaler's ``update`` wrapped on the
    instance (the class's is untouched); :meth:`remove` restores it."""

    @staticmethod
    def check(scaler: Any) -> None:
        """Raises ``TypeError`` for a ``scaler`` (not ``None``) without ``update()``."""
        if scaler is not None and not callable(getattr(scaler, "update", None)):
            raise TypeError(
                "DiLoCo: grad_scaler must be a torch.amp.GradScaler (its update() counts the "
                f"inner steps), got {type(scaler).__name__}"
            )

    def __init__(self, scaler: Any, count: Callable[[], None]) -> None:
        self._scaler = scaler
        update = scaler.update

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = update(*args, **kwargs)
            count()
            return result

        scaler.update = counted

    def remove(self) -> None:
        vars(self._scaler).pop("update", None)


def _comm(group: Any, timeout: Any) -> Comm:
    if isinstance(group, Simulated):
        raise TypeError("DiLoCo runs on real ranks: pass a torch.distributed group, not Simulated")
    if isinstance(group, (Local, ProcessGroup)):
        return group
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return Local()
    return ProcessGroup(group, timeout=timeout)


class DiLoCo:
    """DiLoCo around any inner optimizer: every ``sync_every`` inner steps, one outer step, or
    with streaming, one fragment's outer step every ``sync_every / fragments`` inner steps.

    Registers a post-step hook on ``inner_optimizer`` (any ``torch.optim.Optimizer``:
    ``torch.optim``'s, ``fn.optim``'s): after every ``sync_every``-th ``step()``, the model's
    parameters (those that require grad, in ``model.parameters()`` order) go through
    :func:`fn.diloco.outer_step` with the outer rule, and every rank continues from the new
    anchor. The training loop does not change. docs/algorithms.md, "DiLoCo: local steps and a
    compressed outer step" specifies the step, the bytes and the memory.

    What the schedule counts: the inner optimizer's ``step()`` calls that ran (not those
    ``torch.amp.GradScaler`` skipped on an overflow, nor one that raised), plus
    :meth:`count_inner_step`'s; with ``grad_scaler=``, instead the scaler's ``update()`` calls
    (one per loop iteration, whether or not the optimizer stepped) plus
    :meth:`count_inner_step`'s. Every worker must count alike: each exchange checks that every
    worker started it after the same inner step, with the same fragment, size and trainable
    parameters (and whether from :meth:`sync`), else every rank raises the same ``ValueError``
    naming every worker's values.

    Parameters that start to require grad after construction (unfrozen, or added to the
    model) join DiLoCo at the next outer step (the same on every worker, else the exchange
    raises): they take the mean of the participating workers' values (fp32), which becomes
    their anchor, and join that step's fragment, their outer state fresh (logged). Parameters
    frozen after construction stay synced. Buffers (``buffers="mean"``): the floating ones are
    averaged over the workers that take part at every outer step, the others taken from the
    first (fn/diloco/buffers.py); ``"local"`` keeps each worker's own.

    Refused at construction, the same ``ValueError`` on every rank: an inner optimizer, a
    ``DistributedDataParallel`` model or a device mesh that communicates across the workers
    (``fn.optim``'s default comm, ``fn.fsdp``'s ``world=`` spanning other workers); inner
    optimizers whose kind, param groups' hyperparameters or parameters differ across workers,
    or that step a tensor that is not one of the model's parameters.

    Streaming DiLoCo (``fragments=P``): the parameters form ``P`` fragments, each with its own
    anchor, outer state and compressor state; fragment ``p`` takes its outer step after the
    inner steps ``t = (p + 1) H / P (mod H)``. With ``delay=tau`` its pseudo-gradient is taken
    ``tau`` inner steps earlier and its exchange runs on a background thread (over process
    groups of its own) during those ``tau`` steps; the ``step()`` that applies it waits for it,
    and raises ``RuntimeError`` (the thread's exception chained) where it failed. The results
    do not depend on the thread's timing.

    At construction every rank checks with the others (one small all-gather) that they passed
    the same settings and hold the same parameters; a difference is the same ``ValueError`` on
    every rank. A rank that stops answering makes the others raise
    ``fn.collectives.CollectiveTimeoutError`` after ``timeout`` (``$FN_TIMEOUT``).

    Faults: a worker whose pseudo-gradient (of the fragment), or whose inner optimizer's state
    of the fragment's parameters (``torch.optim``'s, one pass over it), holds NaN or Inf sits
    that outer step out (:func:`fn.diloco.outer_update`): the others' mean is applied, and
    every worker continues from the new anchor. The sitter loses its inner steps since its
    last outer step: all its parameters (every fragment's) are reset to their anchors and its
    inner optimizer's state is reset (``torch.optim``: its per-param state cleared, so AdamW
    starts its moments afresh; ``fn.optim``: ``reset_state()``; ``fn.fsdp``'s 1-bit
    optimizers, finite by construction, keep theirs); its error feedback is kept as it was.
    Every rank warns (``RuntimeWarning``, the same text) naming the sitters, the fragment and
    the inner step; ``sat_out`` counts each worker's sit-outs. Where every worker sits out, the
    step is skipped (the anchor and the outer state unchanged). A worker that sits out
    ``max_sit_outs`` outer steps in a row makes every rank raise the same ``RuntimeError``
    once that step is applied. This policy (participation) is stable: ``fn.diloco``'s elastic
    and sparse exchanges build on it.

    A worker may span several ranks, its model sharded by FSDP2 (``fully_shard``, on a 1-D mesh
    or HSDP; the parameters ``DTensor`` s, on one device mesh): ``group`` is then the workers'
    ranks at one shard position (``mesh["worker"].get_group()`` for a mesh ``("worker",
    "shard")``), each rank syncs its own local shard, the anchor is per local shard, and the
    agreement that the pseudo-gradients are finite is also summed over the parameters' mesh, so
    that every rank of every worker applies or skips a step together; with ``delay > 0`` the
    exchange's thread sums it over copies of those groups of its own, as FSDP2 uses them on the
    training loop's thread meanwhile. ``"fp32"`` and ``"bf16"`` then give the unsharded model's
    outer step bit for bit; the compressors with groups or chunks cut them from the shards.
    ``fn.fsdp.OnebitAdam`` and ``OnebitLamb`` serve as a
    sharded worker's inner optimizer given the worker's ranks as ``world=``
    (``mesh["shard"].get_group()``), so that their checks span that worker only.

    Args:
        model: the worker's model, unsharded or sharded by FSDP2 (buffers are not
            synchronized).
        inner_optimizer: the optimizer of ``model``'s parameters, stepped by the training loop.
        group: the workers: a ``torch.distributed`` group (``None``: the world, or one rank
            where ``torch.distributed`` is not initialized), or a ``fn.collectives.Local`` or
            ``ProcessGroup``; with sharded workers, the workers' ranks at this shard position.
        sync_every: ``H``, inner steps per outer step.
        outer: the outer rule, one of :data:`OUTER_RULES`.
        outer_options: its options (``lr``, ``momentum`` for ``"nesterov"``; ``lr``, ``beta``
            for ``"sparseloco"``).
        compression: the compressor, one of ``fn.diloco.COMPRESSIONS`` (``None``: ``"fp32"``;
            ``"sparseloco"`` takes only ``"topk"``).
        compression_options: its options (e.g. ``k``, ``chunk_size`` for ``"topk"``).
        fragments: ``P``, the number of fragments (contiguous runs of the parameters,
            balanced by element count; ``sync_every`` a multiple of it), or the fragments as
            lists of parameters (each trainable parameter in exactly one).
        delay: ``tau``, in ``[0, sync_every / P)``: inner steps between taking a fragment's
            pseudo-gradient and applying its outer step, which overlap its exchange.
        mix: ``alpha`` in ``[0, 1)``: a fragment's parameters continue from ``(1 - alpha)`` times
            the new anchor plus ``alpha`` times their own (0: the anchor; the ``tau`` inner
            steps' changes to the fragment are then dropped).
        anchor_device: where the anchor lives: ``None`` (each parameter's device) or a device
            such as ``"cpu"`` (the outer state stays on the parameters' devices, where the
            outer step runs).
        timeout: the collectives' timeout (a ``timedelta`` or seconds; ``None``:
            ``$FN_TIMEOUT``, else 5 minutes), where ``group`` is a ``torch.distributed`` group.
        max_sit_outs: the outer steps in a row a worker may sit out before every rank raises
            ``RuntimeError`` (``None``: never).
        grad_scaler: a ``torch.amp.GradScaler`` whose ``update()`` calls count the inner steps
            in place of the optimizer's ``step()`` (DiLoCo wraps the scaler's ``update``;
            :meth:`remove` restores it), so that a step the scaler skips still counts.
        buffers: ``"mean"`` (every worker's buffers made equal at every outer step) or
            ``"local"`` (each worker keeps its own).

    Raises:
        ValueError: a setting out of range (also ``sync_every`` not a multiple of ``P``, or
            fragment lists that miss a parameter, repeat one or name another tensor), or (on
            every rank) settings, parameters or inner optimizers that differ across ranks, or
            communication across the workers outside DiLoCo (see above).
        NotImplementedError: ``DTensor`` parameters mixed with plain ones or on several device
            meshes; complex buffers with ``buffers="mean"``.
        TypeError: a ``grad_scaler`` without ``update()``.

    Attributes:
        inner_steps: the inner steps counted so far.
        outer_steps: the outer steps taken (one per fragment's step; skipped ones included).
        skipped_steps: the outer steps skipped because every worker sat out.
        fragment_steps: the outer steps of each fragment.
        sat_out: per worker (rank of ``group``), the outer steps it sat out.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=2)  # one rank: Local
        >>> for _ in range(4):
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     inner.step()
        ...     inner.zero_grad()
        >>> diloco.inner_steps, diloco.outer_steps
        (4, 2)

        Streaming: 2 fragments, one synced every 2 inner steps, each exchange on a thread
        during the inner step before it:

        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=4, fragments=2, delay=1)
        >>> for _ in range(8):
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     inner.step()
        ...     inner.zero_grad()
        >>> diloco.outer_steps, diloco.fragment_steps
        (4, [2, 2])
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        group: Any = None,
        sync_every: int,
        outer: str = "nesterov",
        outer_options: Mapping[str, Any] | None = None,
        compression: str | None = None,
        compression_options: Mapping[str, Any] | None = None,
        fragments: int | Sequence[Sequence[torch.Tensor]] = 1,
        delay: int = 0,
        mix: float = 0.0,
        anchor_device: torch.device | str | None = None,
        timeout: Any = None,
        max_sit_outs: int | None = 3,
        grad_scaler: Any = None,
        buffers: str = "mean",
    ) -> None:
        check_int("DiLoCo: sync_every", sync_every, minimum=1)
        check_fraction("DiLoCo", mix=mix)
        _UpdateCounter.check(grad_scaler)
        self._model = model
        self._buffers = Buffers(model, buffers)
        self._inner = InnerOptimizer(inner_optimizer)
        self._params = trainable_params(model, "DiLoCo")
        within = worker_mesh_comms(self._params, timeout)  # sharded: the worker's ranks
        indices = fragment_indices(self._params, fragments)
        self._schedule = StreamSchedule(sync_every, len(indices), delay).checked()
        self.comm = _comm(group, timeout)
        self._sit_outs = SitOuts(
            self.comm.world_size, max_sit_outs, buffers=self._buffers.checked()
        )
        self.sync_every = sync_every
        self._mix = float(mix)
        outer_options, options = dict(outer_options or {}), dict(compression_options or {})
        self._settings = settings_record(
            sync_every=sync_every,
            fragments=indices,
            delay=delay,
            mix=self._mix,
            outer=(outer, outer_options),
            compression=(compression, options),
            params=self._params,
        )
        shards = [local_shard(p.detach()) for p in self._params]
        self._agree(shards, within, max_sit_outs=max_sit_outs, counted_by=grad_scaler)
        # with a delay, each exchange on a thread over process groups of its own (copies of the
        # workers' group and of the worker mesh's, which FSDP2 uses on this thread meanwhile)
        self._exchanger = Exchanger([self.comm, *within], background=delay > 0)
        self._rule = outer_rule(
            outer, outer_options, compression, options, self._exchanger.comms[0]
        )
        self._anchor = [x.to(anchor_device or x.device, copy=True) for x in shards]
        self._fragments = [self._fragment(p, f) for p, f in enumerate(indices)]
        self._anchor_device = anchor_device
        self._synced = {id(q) for q in self._params}  # the parameters DiLoCo syncs
        self._joining: dict[int, list[torch.Tensor]] = {}  # by fragment: trainable, not synced
        self._worker = getattr(self.comm, "rank", 0)  # this worker's index in the mask
        self.inner_steps = self.outer_steps = self.skipped_steps = 0
        self._hook = self._counting_hook(inner_optimizer, grad_scaler)

    def _counting_hook(self, inner_optimizer: torch.optim.Optimizer, grad_scaler: Any) -> Any:
        """The hook that counts the inner steps: after ``inner_optimizer.step()``, or after
        ``grad_scaler.update()`` (which runs also where the scaler skipped the step)."""
        if grad_scaler is None:
            return inner_optimizer.register_step_post_hook(self._after_inner_step)
        return _UpdateCounter(grad_scaler, self.count_inner_step)

    def _agree(
        self,
        shards: Sequence[torch.Tensor],
        within: Sequence[Comm],
        *,
        max_sit_outs: int | None,
        counted_by: Any,
    ) -> None:
        """The ranks' agreement on the settings, the parameters' ``shards``, the other options,
        the inner optimizer and the workers' isolation (one all-gather); raises the same
        ``ValueError`` on every rank."""
        values = {  # agreed on, not saved (a checkpoint's settings stay as they were)
            "local shapes": [tuple(x.shape) for x in shards],
            "parameter values": [int(bit_checksum(x)) for x in shards],
            "max_sit_outs": max_sit_outs,
            "inner steps counted": "optimizer.step()" if counted_by is None else "update()",
            "buffers": (self._buffers.policy, self._buffers.layout()),
        }
        problem = isolation_problem(self._model, self._inner, within, self.comm)
        described = self._inner.description(list(self._model.parameters()))
        if problem is None and any(-1 in p for p in described["inner optimizer's parameters"]):
            problem = (
                "DiLoCo: the inner optimizer steps tensors that are not parameters of the model: "
                "DiLoCo never syncs them, so the workers would drift apart; make them the "
                "model's parameters; nothing was changed"
            )
        agreed = {**self._settings, **values, **described, "refused": problem}
        agree_on_settings(self.comm, agreed, "DiLoCo")
        if problem is not None:  # the same on every rank
            raise ValueError(problem)

    def _fragment(self, p: int, indices: list[int]) -> Fragment:
        """Fragment ``p`` of the parameters ``indices``, its outer state fresh."""
        anchor = [self._anchor[i] for i in indices]
        return Fragment(p, indices, [self._params[i] for i in indices], anchor, self._rule)

    @property
    def fragment_steps(self) -> list[int]:
        """The outer steps of each fragment."""
        return [f.steps for f in self._fragments]

    @property
    def sat_out(self) -> list[int]:
        """Per worker (rank of ``group``), the outer steps it sat out."""
        return list(self._sit_outs.total)

    @property
    def max_sit_outs(self) -> int | None:
        """The outer steps in a row a worker may sit out before every rank raises."""
        return self._sit_outs.max_sit_outs

    def remove(self) -> None:
        """Detaches the hook from the inner optimizer (or the grad scaler): its ``step()``
        (``update()``) no longer counts.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=1)
            >>> diloco.remove()
            >>> inner.step()
            >>> diloco.inner_steps
            0
        """
        self._hook.remove()

    def close(self) -> None:
        """Ends this DiLoCo: detaches its hook (as :meth:`remove`), waits for an exchange in
        flight (``delay > 0``) to end, without applying it (the anchor, the outer state and the
        error feedback stay as before that exchange, on every rank), and stops the exchange's
        thread (a later :meth:`sync` runs on the caller's). Afterwards none of its
        collectives runs, so the process group may be destroyed, or another DiLoCo built on it,
        without a collective left running on the exchange's thread. To apply that exchange and
        end on one anchor instead, call :meth:`sync` first. Every rank must call it at the same
        point.

        Raises:
            RuntimeError: the exchange in flight failed on its thread (chained).

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=2, delay=1)
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> inner.step()  # starts an exchange, to be applied at the next step
            >>> diloco.state_dict()["in_flight"]["fragment"]
            0
            >>> diloco.close()
            >>> diloco.state_dict()["in_flight"]["fragment"], diloco.outer_steps
            (None, 0)
        """
        self.remove()
        for fragment in self._fragments:
            if fragment.flight is not None:
                fragment.finish()
        self._exchanger.close()

    def count_inner_step(self) -> None:
        """Counts one inner step that the counter did not see, and runs the schedule as after
        it: call it once for a loop iteration whose ``step()`` did not run (it raised, e.g.
        ``fn.NonFiniteError``, and the loop caught it and went on), or with ``grad_scaler=``
        whose ``update()`` did not run, so that every worker starts each outer step after the
        same loop iteration.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=2)
            >>> diloco.count_inner_step()
            >>> diloco.count_inner_step()  # the 2nd: the outer step
            >>> diloco.inner_steps, diloco.outer_steps
            (2, 1)
        """
        self.inner_steps += 1
        plan = self._schedule.plan(self.inner_steps)
        if plan.starts is not None:
            self._start(self._fragments[plan.starts])
        if plan.applies is not None and self._fragments[plan.applies].flight is not None:
            self._apply(self._fragments[plan.applies], self._mix)

    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        if initializing_optimizer_state():  # DCP's state_dict API creating a fresh state
            return
        self.count_inner_step()

    def _start(
        self, fragment: Fragment, *, in_flight: InFlight | None = None, inline: bool = False
    ) -> None:
        """Starts ``fragment``'s exchange: its pseudo-gradient, buffers and participation now,
        or ``in_flight``'s (a checkpoint's); on this thread where ``inline`` (``sync()``)."""
        started_at = self.inner_steps if in_flight is None else in_flight.started_at
        params = list(self._model.parameters())
        if in_flight is None or in_flight.trainable is None:  # the latter: saved before fn kept it
            trainable = [(i, q) for i, q in enumerate(params) if q.requires_grad]
        else:  # as when it started, though a layer may have been unfrozen since
            trainable = [(i, params[i]) for i in in_flight.trainable]
        self._joining[fragment.index] = [q for _, q in trainable if id(q) not in self._synced]
        shapes = repr([(i, tuple(q.shape)) for i, q in trainable]).encode()
        header = {
            "inner step": started_at,
            "fragment": fragment.index,
            "values": fragment.size(),
            "from sync()": int(inline),
            "trainable tensors": len(trainable),
            "their checksum": digest(shapes),
        }
        worker = self._worker
        if in_flight is None or in_flight.takes_part is None:  # the latter: saved before both
            captured = self._buffers.capture()
            takes_part = self._inner.finite(fragment.params) & Buffers.finite(
                captured, local_shard(fragment.params[0]).device
            )
        else:
            captured = self._buffers.captured(in_flight.buffers)
            takes_part = in_flight.takes_part

        def buffers(result, comm, within):
            if captured is None:
                return None
            return captured, Buffers.exchange(captured, comm, within, result.participants, worker)

        fragment.start(
            self._exchanger,
            self._rule,
            started_at=started_at,
            takes_part=takes_part,
            header=header,
            delta=None if in_flight is None else in_flight.delta,
            background=False if inline else None,
            then=buffers,
            buffers=[] if captured is None else captured.values,
            trainable=[i for i, _ in trainable],
        )

    def _apply(self, fragment: Fragment, mix: float) -> bool:
        """Waits for ``fragment``'s exchange and applies it: the new anchor and outer state,
        a participant's parameters mixed with their own by ``mix``, a sitter's whole model
        reset to the anchors and its inner optimizer's state reset. Returns whether every
        worker took part."""
        result, buffers, started_at = fragment.finish()
        participants = [bool(x) for x in result.participants.tolist()]
        mine = participants[self._worker]
        fragment.commit(result, mix=mix, takes_part=mine)
        if buffers is not None:
            Buffers.write(*buffers)
        self.outer_steps += 1
        self.skipped_steps += not any(participants)
        if not mine:  # the whole worker continues from the anchors, its optimizer afresh
            for other in self._fragments:
                other.reset()
            self._inner.reset()
        joining = self._joining.pop(fragment.index, [])
        if joining and any(participants):
            self._join(fragment, joining, participants)
        step = (
            "the outer step"
            if len(self._fragments) == 1
            else f"the outer step of fragment {fragment.index}"
        )
        self._sit_outs.record(
            participants, f"{step} started after inner step {started_at}", self._inner.what_reset()
        )
        return all(participants)

    @torch.no_grad()
    def _join(
        self, fragment: Fragment, params: list[torch.Tensor], participants: list[bool]
    ) -> None:
        """Parameters that started to require grad join ``fragment``: every worker's take the
        participants' mean (fp32, ``cast_allreduce`` over the workers), which is their anchor;
        their outer state starts fresh. The synced parameters stay in ``model.parameters()``
        order (the fragments' indices renumbered). A collective: every worker joins the same
        ones."""
        shards = [local_shard(q.detach()) for q in params]
        device = shards[0].device
        count = torch.tensor(sum(participants), device=device)
        part = Participation(torch.tensor(participants[self._worker], device=device), count)
        means = cast_allreduce(comm=self.comm).update(
            [x.float() for x in shards], EmptyState(), participation=part
        )[0]
        for shard, mean in zip(shards, means, strict=True):
            shard.copy_(mean)
        anchor = [x.to(self._anchor_device or x.device, copy=True) for x in shards]
        anchors = {
            id(q): a for q, a in zip(self._params + params, self._anchor + anchor, strict=True)
        }
        self._synced.update(id(q) for q in params)
        # in model.parameters() order, as a DiLoCo built with them trainable lists them, so
        # that a checkpoint taken from now on resumes into one
        self._params = [q for q in self._model.parameters() if id(q) in self._synced]
        self._anchor = [anchors[id(q)] for q in self._params]
        position = {id(q): i for i, q in enumerate(self._params)}
        for other in self._fragments:
            other.indices = [position[id(q)] for q in other.params]
        fragment.extend([position[id(q)] for q in params], params, anchor, self._rule)
        self._settings["parameters"] = [(tuple(q.shape), str(q.dtype)) for q in self._params]
        self._settings["fragments"] = [f.indices for f in self._fragments]
        names = {id(q): name for name, q in self._model.named_parameters()}
        logger.info(
            "DiLoCo: %s started to require grad; synced from now on in fragment %d (their "
            "anchor: the mean of the participating workers' values)",
            ", ".join(names.get(id(q), "a parameter") for q in params),
            fragment.index,
        )

    def sync(self) -> bool:
        """Runs the outer step of every fragment now (the hook runs them on its schedule).

        Every rank must call it at the same point. An exchange in flight is waited for and
        applied first; then every fragment's outer step runs on this thread, in order. Every
        rank's parameters are set to the new anchor (``mix`` applies to the scheduled steps
        only), e.g. at the end of training.

        Returns:
            Whether every worker took part in every step; ``False`` where some worker sat out
            one (see the class docstring).

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=100)
            >>> diloco.sync(), diloco.outer_steps
            (True, 1)
        """
        applied = True
        pending = [f for f in self._fragments if f.flight is not None]
        for fragment in pending:
            applied = self._apply(fragment, 0.0) and applied
        for fragment in self._fragments:
            self._start(fragment, inline=True)
            applied = self._apply(fragment, 0.0) and applied
        return applied

    def state_dict(self) -> dict[str, Any]:
        """This rank's DiLoCo state: the anchor, each fragment's outer state, the counters, the
        settings and an exchange in flight under keys shared by the ranks, and what is this
        rank's own (its error feedback, an in-flight pseudo-gradient) under
        ``state["per_rank"]["rank<r>"]`` (``r`` its rank in the world).

        Save it per rank (``torch.save`` to one file per rank), or through
        ``torch.distributed.checkpoint`` (``fn.fsdp.TrainingCheckpoint(..., extra={"diloco":
        diloco})``), which keeps one copy of each shared key, of each shard where the workers
        are sharded (the anchor and the momentum are then ``DTensor`` s laid out as the
        parameters). With the model's and the inner optimizer's state, it resumes bit for bit.
        Taken while a fragment's exchange is in flight (``delay > 0``), it holds that fragment
        and the inner step its exchange started after (``"in_flight"``), its anchor and outer
        state from before the exchange, and among this rank's entries its pseudo-gradient
        (``"in_flight_delta"``: one fp32 vector of the largest fragment's size, the fragment's
        tensors flattened in turn, zero outside an exchange), whether it takes part
        (``"in_flight_takes_part"``) and the buffer values it sends (``"in_flight_buffers"``),
        as decided and taken when the exchange started: a run resumed from it sends the same
        exchange again and applies it at the same step.

        Returns:
            A dict of tensors, lists of tensors and Python values (fresh copies).

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> sorted(fn.diloco.DiLoCo(model, inner, sync_every=2).state_dict())
            ['anchor', 'counts', 'in_flight', 'outer_state', 'per_rank', 'settings', 'world_size']
        """
        counts = {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "skipped_steps": self.skipped_steps,
            "fragment_steps": self.fragment_steps,
            **self._sit_outs.counts(),
        }
        flying = next((f for f in self._fragments if f.flight is not None), None)
        in_flight = None
        if flying is not None:
            flight = flying.flight
            in_flight = InFlight(
                flying.index,
                flight.started_at,
                flight.delta,
                flight.takes_part,
                flight.buffers,
                flight.trainable,
            )
        return diloco_state_dict(
            self._anchor,
            [f.state for f in self._fragments],
            self._params,
            [f.indices for f in self._fragments],
            counts=counts,
            settings=repr(self._settings),
            world_size=self.comm.world_size,
            in_flight=in_flight,
            delta_size=max(f.size() for f in self._fragments),
            buffers=self._buffers.targets(),
            worker=self._worker,
        )

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict`. Under another number of workers (or from another
        rank's file) the error feedback restarts from zero, with one warning; the rest (the
        anchor, the momentum, the counters) loads. A checkpoint taken while an exchange was in
        flight starts that exchange again (every rank must then load at the same point, as it
        is a collective); it loads only on the same number of workers, from this rank's own
        entries.

        Args:
            state: what :meth:`state_dict` returned on this rank (or, under another number of
                workers, on some rank), or what ``torch.distributed.checkpoint`` loaded into it.

        Raises:
            ValueError: settings other than this object's, tensors of other shapes, or an
                exchange in flight under another number of workers, without this rank's
                entries or naming parameters the model does not have; nothing was changed.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=2)
            >>> saved = diloco.state_dict()
            >>> diloco.sync()
            True
            >>> diloco.load_state_dict(saved)
            >>> diloco.outer_steps
            0
        """
        loaded = restored(
            state,
            anchor=self._anchor,
            fresh_state=[f.fresh_state(self._rule) for f in self._fragments],
            settings=repr(self._settings),
            world_size=self.comm.world_size,
            fragment_shards=[f.shards() for f in self._fragments],
            buffers=self._buffers.targets(),
        )
        flying = loaded.in_flight
        count = len(list(self._model.parameters()))
        if flying is not None and not all(0 <= i < count for i in flying.trainable or ()):
            raise ValueError(
                "DiLoCo.load_state_dict: the in-flight exchange names parameters this model "
                f"does not have (positions {list(flying.trainable)}, the model has {count}); "
                "nothing was loaded"
            )
        for fragment in self._fragments:  # this object's own exchange: ended before replacing it
            if fragment.flight is not None:
                fragment.finish()
        for a, saved in zip(self._anchor, loaded.anchor, strict=True):
            a.copy_(saved)
        for fragment, outer_state, steps in zip(
            self._fragments, loaded.outer_state, loaded.counts["fragment_steps"], strict=True
        ):
            fragment.state, fragment.steps = outer_state, steps
        self.inner_steps = loaded.counts["inner_steps"]
        self.outer_steps = loaded.counts["outer_steps"]
        self.skipped_steps = loaded.counts["skipped_steps"]
        self._sit_outs.load(loaded.counts)
        if loaded.in_flight is not None:
            self._start(self._fragments[loaded.in_flight.fragment], in_flight=loaded.in_flight)
