"""``DiLoCo``: the outer step hooked onto any inner optimizer's ``step()``, so that a training loop
does not change; the anchor, the outer state and the counters in a ``state_dict``."""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fn.base import GradientTransformation
from fn.collectives import Comm, Local, ProcessGroup, Simulated
from fn.diloco.agreement import agree_on_settings
from fn.diloco.checkpoint import (
    PER_RANK,
    diloco_state_dict,
    initializing_optimizer_state,
    own_key,
    restored,
)
from fn.diloco.compressors import compression as build_compression
from fn.diloco.exchange import BackgroundExchange, ExchangeThread, exchange_comms
from fn.diloco.nesterov_rule import nesterov
from fn.diloco.sharding import local_shard, worker_mesh_comms
from fn.diloco.sparseloco_rule import sparseloco
from fn.diloco.step import OuterStep, outer_update, pseudo_gradient
from fn.diloco.streaming import StreamSchedule, fragment_indices
from fn.errors import check_fraction, check_int, user_stacklevel

__all__ = ["OUTER_RULES", "DiLoCo"]

OUTER_RULES = ("nesterov", "sparseloco")
"""The outer rules :class:`DiLoCo` takes by name, ``"nesterov"`` (:func:`fn.diloco.nesterov`,
after any compressor) and ``"sparseloco"`` (:func:`fn.diloco.sparseloco`, its top-k built in).

Example:
    >>> fn.diloco.OUTER_RULES
    ('nesterov', 'sparseloco')
"""


def _comm(group: Any, timeout: Any) -> Comm:
    if isinstance(group, Simulated):
        raise TypeError("DiLoCo runs on real ranks: pass a torch.distributed group, not Simulated")
    if isinstance(group, (Local, ProcessGroup)):
        return group
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return Local()
    return ProcessGroup(group, timeout=timeout)


def _rule(
    outer: str, outer_options: Mapping, kind: str | None, options: Mapping, comm: Comm
) -> GradientTransformation:
    if outer == "nesterov":
        return nesterov(build_compression(kind or "fp32", comm=comm, **options), **outer_options)
    if outer == "sparseloco":
        if kind not in (None, "topk"):
            raise ValueError(
                f"DiLoCo: outer='sparseloco' sends its own top-k; compression must be None or "
                f"'topk' (its k and chunk_size go in compression_options), got {kind!r}"
            )
        return sparseloco(comm=comm, **outer_options, **options)
    raise ValueError(f"DiLoCo: outer must be one of {', '.join(OUTER_RULES)}, got {outer!r}")


def _params_digest(params: list[torch.Tensor]) -> int:
    """A CRC-32 of the parameters' bytes, to check that every rank starts from the same ones."""
    digest = 0
    for p in params:
        data = p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest = zlib.crc32(data, digest)
    return digest


class _Flight(NamedTuple):
    """A fragment's exchange, started and not yet applied."""

    fragment: int
    started_at: int  # the inner step it started after
    delta: list[torch.Tensor]  # this rank's pseudo-gradient of the fragment
    exchange: BackgroundExchange[OuterStep]


class DiLoCo:
    """DiLoCo around any inner optimizer: every ``sync_every`` inner steps, one outer step, or
    with streaming, one fragment's outer step every ``sync_every / fragments`` inner steps.

    Registers a post-step hook on ``inner_optimizer`` (any ``torch.optim.Optimizer``:
    ``torch.optim``'s, ``fn.optim``'s): after every ``sync_every``-th ``step()``, the model's
    parameters (those that require grad, in ``model.parameters()`` order) go through
    :func:`fn.diloco.outer_step` with the outer rule, and every rank continues from the new
    anchor. The training loop does not change. docs/algorithms.md, "DiLoCo: local steps and a
    compressed outer step" specifies the step, the bytes and the memory.

    Streaming DiLoCo (``fragments=P``): the parameters form ``P`` fragments, each with its own
    anchor, outer state and compressor state; fragment ``p`` takes its outer step after the
    inner steps ``t = (p + 1) H / P (mod H)``. With ``delay=tau`` its pseudo-gradient is taken
    ``tau`` inner steps earlier and its exchange runs on a background thread (over process
    groups of its own) during those ``tau`` steps; the ``step()`` that applies it waits for it,
    and raises ``RuntimeError`` (the thread's exception chained) where it failed. The results
    do not depend on the thread's timing.

    At construction every rank checks with the others (one small all-gather) that they passed
    the same settings and hold the same parameters; a difference is the same ``ValueError`` on
    every rank. A non-finite pseudo-gradient on any rank skips the outer step on every rank with
    the anchor and the outer state unchanged, resets every rank's parameters to the anchor, and
    warns. A rank that stops answering makes the others raise
    ``fn.collectives.CollectiveTimeoutError`` after ``timeout`` (``$FN_TIMEOUT``).

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
            such as ``"cpu"``.
        timeout: the collectives' timeout (a ``timedelta`` or seconds; ``None``:
            ``$FN_TIMEOUT``, else 5 minutes), where ``group`` is a ``torch.distributed`` group.

    Raises:
        ValueError: a setting out of range (also ``sync_every`` not a multiple of ``P``, or
            fragment lists that miss a parameter, repeat one or name another tensor), or (on
            every rank) settings or parameters that differ across ranks.
        NotImplementedError: ``DTensor`` parameters mixed with plain ones or on several device
            meshes.

    Attributes:
        inner_steps: the inner steps counted so far.
        outer_steps: the outer steps taken (one per fragment's step; skipped ones included).
        skipped_steps: the outer steps skipped for a non-finite pseudo-gradient.
        fragment_steps: the outer steps of each fragment.

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
    ) -> None:
        check_int("DiLoCo: sync_every", sync_every, minimum=1)
        check_fraction("DiLoCo", mix=mix)
        self._params = [p for p in model.parameters() if p.requires_grad]
        within = worker_mesh_comms(self._params, timeout)  # sharded: the worker's ranks
        self._fragments = fragment_indices(self._params, fragments)
        self._schedule = StreamSchedule(sync_every, len(self._fragments), delay).checked()
        self.comm = _comm(group, timeout)
        outer_options, options = dict(outer_options or {}), dict(compression_options or {})
        # built here to refuse bad options before the ranks compare their settings
        self._rule = _rule(outer, outer_options, compression, options, self.comm)
        self.sync_every = sync_every
        self._mix = float(mix)
        self._settings = {
            "sync_every": sync_every,
            "fragments": self._fragments,
            "delay": delay,
            "mix": self._mix,
            "outer": (outer, sorted(outer_options.items())),
            "compression": (compression, sorted(options.items())),
            "parameters": [(tuple(p.shape), str(p.dtype)) for p in self._params],
        }
        shards = [local_shard(p.detach()) for p in self._params]
        values = {
            "local shapes": [tuple(x.shape) for x in shards],
            "parameter values": _params_digest(shards),
        }
        agree_on_settings(self.comm, {**self._settings, **values}, "DiLoCo")
        # a delayed exchange runs on a thread, over process groups of its own (copies of the
        # workers' group and of the worker mesh's, which FSDP2 uses on this thread meanwhile)
        comms = [self.comm, *within]
        # the thread starts now: starting one per exchange made the loop wait for it
        self._worker = ExchangeThread() if delay > 0 else None
        if delay > 0:
            comms = exchange_comms(comms)
            self._rule = _rule(outer, outer_options, compression, options, comms[0])
        self._exchange_comms = comms  # the workers' group, then the worker mesh's
        self._anchor = [x.to(anchor_device or x.device, copy=True) for x in shards]
        self._states = [self._rule.init(self._part(self._anchor, p)) for p in self._fragment_ids]
        self._flight: _Flight | None = None
        self.inner_steps = 0
        self.outer_steps = 0
        self.skipped_steps = 0
        self.fragment_steps = [0] * len(self._fragments)
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)

    def remove(self) -> None:
        """Detaches the hook from the inner optimizer: its ``step()`` no longer counts.

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

    @property
    def _fragment_ids(self) -> range:
        return range(len(self._fragments))

    def _part(self, tensors: list[torch.Tensor], p: int) -> list[torch.Tensor]:
        """Fragment ``p``'s entries of a list over the parameters."""
        return [tensors[i] for i in self._fragments[p]]

    def _shards(self, p: int) -> list[torch.Tensor]:
        """This rank's part of fragment ``p``'s parameters (views: writing them writes the
        parameters)."""
        return [local_shard(q.detach()) for q in self._part(self._params, p)]

    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        if initializing_optimizer_state():  # DCP's state_dict API creating a fresh state
            return
        self.inner_steps += 1
        plan = self._schedule.plan(self.inner_steps)
        if plan.starts is not None:
            self._start(plan.starts, background=self._schedule.delay > 0)
        if plan.applies is not None and self._flight is not None:
            self._apply(self._mix)

    @torch.no_grad()
    def _start(
        self,
        p: int,
        *,
        background: bool,
        started_at: int | None = None,
        delta: list[torch.Tensor] | None = None,
    ) -> None:
        """Takes fragment ``p``'s pseudo-gradient (or resumes with ``delta``) and starts its
        exchange."""
        params = self._shards(p)
        anchor = [a.to(q.device) for a, q in zip(self._part(self._anchor, p), params, strict=True)]
        if delta is None:
            delta = pseudo_gradient(anchor, params)
        started_at = self.inner_steps if started_at is None else started_at
        rule, state, (comm, *within) = self._rule, self._states[p], self._exchange_comms
        exchange = BackgroundExchange(
            lambda: outer_update(rule, anchor, delta, state, comm=comm, within=within),
            background=background,
            device=params[0].device,
            worker=self._worker,
            what=f"DiLoCo: the outer exchange of fragment {p} (started after inner step "
            f"{started_at})",
        )
        self._flight = _Flight(p, started_at, delta, exchange)

    @torch.no_grad()
    def _apply(self, mix: float) -> bool:
        """Waits for the exchange in flight and applies it: the fragment's new anchor, its
        parameters (mixed with their own by ``mix``), its outer state."""
        flight, self._flight = self._flight, None
        result = flight.exchange.result()
        applied = bool(result.applied)
        p = flight.fragment
        shards = self._shards(p)
        for i, param, new in zip(self._fragments[p], shards, result.anchor, strict=True):
            anchor = self._anchor[i]  # the exchange's new tensor where it fits, else a copy
            fits = (new.device, new.dtype) == (anchor.device, anchor.dtype)
            self._anchor[i] = new if fits else anchor.copy_(new)
            if applied and mix > 0:
                mixed = new.float() * (1.0 - mix) + param.float() * mix
                param.copy_(mixed)
            else:
                param.copy_(new)
        self._states[p] = result.state
        self.outer_steps += 1
        self.fragment_steps[p] += 1
        if not applied:
            self.skipped_steps += 1
            many = len(self._fragments) > 1
            which = f"fragment {p}'s pseudo-gradient" if many else "a pseudo-gradient"
            warnings.warn(
                f"DiLoCo: {which} held NaN or Inf at inner step {flight.started_at}; the outer "
                "step was skipped on every rank and every rank's parameters were reset to the "
                "anchor (check the inner learning rate and the data)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return applied

    def sync(self) -> bool:
        """Runs the outer step of every fragment now (the hook runs them on its schedule).

        Every rank must call it at the same point. An exchange in flight is waited for and
        applied first; then every fragment's outer step runs on this thread, in order. Every
        rank's parameters are set to the new anchor (``mix`` applies to the scheduled steps
        only), e.g. at the end of training.

        Returns:
            Whether every step was applied; ``False`` where some rank's pseudo-gradient was not
            finite, that step then skipped on every rank and the parameters reset to the anchor.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=100)
            >>> diloco.sync(), diloco.outer_steps
            (True, 1)
        """
        applied = True
        if self._flight is not None:
            applied = self._apply(0.0)
        for p in self._fragment_ids:
            self._start(p, background=False)
            applied = self._apply(0.0) and applied
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
        state from before the exchange, and this rank's pseudo-gradient (``"in_flight_delta"``
        of this rank's entries: one fp32 vector of the largest fragment's size, the fragment's
        tensors flattened in turn, zero outside an exchange): a run resumed from it sends the
        same exchange again and applies it at the same step.

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
            "fragment_steps": list(self.fragment_steps),
        }
        state = diloco_state_dict(
            self._anchor,
            self._states,
            self._params,
            self._fragments,
            counts=counts,
            settings=repr(self._settings),
            world_size=self.comm.world_size,
        )
        flight = self._flight
        # the same keys with an exchange in flight or not (None values outside one)
        state["in_flight"] = {
            "fragment": None if flight is None else flight.fragment,
            "started_at": None if flight is None else flight.started_at,
        }
        # one fp32 vector of the largest fragment's size, whether or not an exchange is in
        # flight, so that the state has the same keys and shapes to load into (as DCP needs)
        buffer = torch.zeros(max(self._fragment_sizes()), device=self._shards(0)[0].device)
        if flight is not None:
            flat = torch.cat([d.reshape(-1) for d in flight.delta])
            buffer[: flat.numel()] = flat
        state[PER_RANK][own_key()]["in_flight_delta"] = buffer
        return state

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
                exchange in flight under another number of workers or without this rank's
                entries; nothing was changed.

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
        in_flight = state["in_flight"] if state["in_flight"]["fragment"] is not None else None
        delta = None
        if in_flight is not None and state["settings"] == repr(self._settings):
            delta = self._in_flight_delta(state, in_flight)  # refused before any warning
        loaded = restored(
            state,
            anchor=self._anchor,
            fresh_state=[self._rule.init(self._part(self._anchor, p)) for p in self._fragment_ids],
            settings=repr(self._settings),
            world_size=self.comm.world_size,
        )
        if self._flight is not None:  # this object's own exchange: ended before replacing it
            self._flight.exchange.result()
            self._flight = None
        for a, saved in zip(self._anchor, loaded.anchor, strict=True):
            a.copy_(saved)
        self._states = list(loaded.outer_state)
        self.inner_steps = loaded.counts["inner_steps"]
        self.outer_steps = loaded.counts["outer_steps"]
        self.skipped_steps = loaded.counts["skipped_steps"]
        self.fragment_steps = list(loaded.counts["fragment_steps"])
        if in_flight is not None:
            self._start(
                in_flight["fragment"],
                background=self._schedule.delay > 0,
                started_at=in_flight["started_at"],
                delta=delta,
            )

    def _in_flight_delta(
        self, state: Mapping[str, Any], in_flight: Mapping[str, int]
    ) -> list[torch.Tensor]:
        """This rank's in-flight pseudo-gradient from ``state``, checked, on the parameters'
        devices."""
        own = state.get(PER_RANK, {}).get(own_key())
        if state["world_size"] != self.comm.world_size or own is None:
            raise ValueError(
                f"DiLoCo.load_state_dict: the checkpoint was taken on {state['world_size']} "
                f"workers while fragment {in_flight['fragment']}'s exchange was in flight; "
                f"that exchange belongs to those ranks and cannot resume on "
                f"{self.comm.world_size} workers or from another rank's entries. Resume on the "
                "same ranks, or from a checkpoint taken outside an exchange (not in the delay "
                "steps before a fragment's outer step); nothing was loaded"
            )
        params = self._shards(in_flight["fragment"])
        buffer = local_shard(own["in_flight_delta"])
        if buffer.shape != (max(self._fragment_sizes()),):
            raise ValueError(
                "DiLoCo.load_state_dict: the in-flight pseudo-gradient has another size than "
                "this run's fragments; nothing was loaded"
            )
        pieces = buffer[: sum(q.numel() for q in params)].split([q.numel() for q in params])
        return [
            x.reshape(q.shape).to(q.device, torch.float32, copy=True)
            for x, q in zip(pieces, params, strict=True)
        ]

    def _fragment_sizes(self) -> list[int]:
        """The elements of this rank's part of each fragment."""
        return [sum(x.numel() for x in self._shards(p)) for p in self._fragment_ids]
