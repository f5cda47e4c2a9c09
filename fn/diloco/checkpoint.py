"""``DiLoCo``'s state dict: one form for ``torch.save`` per rank and for
``torch.distributed.checkpoint`` (DCP), which keeps one copy of a key for all ranks.

What is the same on every rank of the group sits under shared keys: the anchor and the outer
state's other leaves (``DTensor`` s laid out as the parameters where the workers are sharded, so
that DCP keeps one copy per shard and can reshard), the counts, the settings and the number of
workers. What differs per rank (the error feedback) sits under ``state["per_rank"]["rank<r>"]``,
``r`` the rank in the world, a key of this rank's own (fn's convention, in
fn/collectives/dcp.py). An exchange in flight is the shared ``state["in_flight"]`` (its
fragment, the inner step it started after and the positions of the parameters that required
grad then, ``None`` values outside one) and, among this
rank's own entries, its pseudo-gradient (``in_flight_delta``), whether it takes part and the
buffer values it sends, as they were when the exchange started: the same keys and shapes in and
outside an exchange, as DCP needs."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from fn.base import OptState
from fn.collectives import as_sharded_like, error_feedback_leaves, local_shard
from fn.collectives.dcp import PER_RANK, own_entries, rank_key
from fn.errors import user_stacklevel
from fn.tree import tree_flatten, tree_unflatten

__all__ = [
    "settings_record",
    "InFlight",
    "diloco_state_dict",
    "Restored",
    "restored",
]


def settings_record(
    *,
    sync_every: int,
    fragments: list[list[int]],
    delay: int,
    mix: float,
    outer: tuple[str, Mapping[str, Any]],
    compression: tuple[str | None, Mapping[str, Any]],
    params: Sequence[torch.Tensor],
) -> dict[str, Any]:
    """The settings a DiLoCo state dict records (``state["settings"]``, as their ``repr``) and
    that every worker must share: a checkpoint loads only under the same.

    Args:
        sync_every: ``H``.
        fragments: the trainable parameters' indices of each fragment.
        delay: the streaming delay.
        mix: the share of a worker's own parameters kept at a delayed outer step.
        outer: the outer rule's name and options.
        compression: the compression's name (or ``None``) and options.
        params: the trainable parameters.

    Returns:
        A dict of plain values (the options sorted, the parameters' shapes and dtypes).

    Example:
        >>> from fn.diloco.checkpoint import settings_record
        >>> settings_record(sync_every=4, fragments=[[0]], delay=0, mix=0.0,
        ...                 outer=("nesterov", {}), compression=(None, {}),
        ...                 params=[torch.zeros(2)])["parameters"]
        [((2,), 'torch.float32')]
    """
    return {
        "sync_every": sync_every,
        "fragments": fragments,
        "delay": delay,
        "mix": float(mix),
        "outer": (outer[0], sorted(outer[1].items())),
        "compression": (compression[0], sorted(compression[1].items())),
        "parameters": [(tuple(p.shape), str(p.dtype)) for p in params],
    }


def _laid_out_like(leaves: Sequence[Any], params: Sequence[torch.Tensor]) -> list[Any]:
    """The parameter each leaf is laid out like (``None``: a scalar, a non-tensor, or not a
    parameter's shape): the ``i``-th tensor leaf of one dimension or more that of parameter
    ``i mod n``, where its shape is that parameter's local shape (the outer rules keep one such
    leaf per parameter, in parameter order, for each of their per-parameter fields)."""
    out, i = [], 0
    for x in leaves:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            out.append(None)
            continue
        p = params[i % len(params)]
        i += 1
        if x.shape != local_shard(p).shape:
            if isinstance(p, DTensor):
                raise NotImplementedError(
                    "DiLoCo: an outer state tensor of shape "
                    f"{tuple(x.shape)} is not laid out as the parameters' shards, so it cannot "
                    "be saved per shard; this outer rule is not built for sharded workers"
                )
            p = None
        out.append(p)
    return out


class InFlight(NamedTuple):
    """A fragment's exchange in flight, as a checkpoint holds it.

    Attributes:
        fragment: the fragment.
        started_at: the inner step its exchange started after.
        delta: this rank's pseudo-gradient of the fragment, fp32 local tensors.
        takes_part: ``[]`` bool, whether this rank takes part, as decided when the exchange
            started (``None``: not saved, in a checkpoint from before fn kept it).
        buffers: the model's buffer values the exchange sends, as taken when it started
            (``[]``: none).
        trainable: the positions in ``model.parameters()`` of the parameters that required
            grad when it started (``None``: not saved, in a checkpoint from before fn kept
            them).
    """

    fragment: int
    started_at: int
    delta: list[torch.Tensor]
    takes_part: torch.Tensor | None = None
    buffers: Sequence[torch.Tensor] = ()
    trainable: Sequence[int] | None = None


def diloco_state_dict(
    anchor: Sequence[torch.Tensor],
    outer_states: Sequence[OptState],
    params: Sequence[torch.Tensor],
    fragments: Sequence[Sequence[int]],
    *,
    counts: Mapping[str, Any],
    settings: str,
    world_size: int,
    in_flight: InFlight | None = None,
    delta_size: int = 0,
    buffers: Sequence[torch.Tensor] = (),
    worker: int = 0,
) -> dict[str, Any]:
    """The state dict of :class:`fn.diloco.DiLoCo` (fresh copies).

    Args:
        anchor: the anchor, one local tensor per parameter.
        outer_states: the outer rule's state of each fragment.
        params: the parameters (``DTensor`` s where the workers are sharded).
        fragments: each fragment's parameters, as indices into ``params``.
        counts: the step counts.
        settings: the settings, as text.
        world_size: the number of workers.
        in_flight: the exchange in flight, or ``None``.
        delta_size: the largest fragment's local size: ``in_flight_delta``'s.
        buffers: the model's buffers that an exchange sends (the shapes of
            ``in_flight_buffers``).
        worker: this worker's index among the workers, whose position the error feedback
            laid out by position (an owner's share) belongs to.

    Returns:
        ``{"anchor", "outer_state", "counts", "settings", "world_size", "in_flight",
        "per_rank"}``: ``outer_state`` the rules' leaves other than the error feedback, in
        leaf order (the fragments' in turn), ``in_flight`` ``{"fragment", "started_at",
        "trainable"}`` (``None`` values outside an exchange), and ``per_rank`` ``{"rank<r>":
        {"error_feedback": [...], "worker": ..., "in_flight_delta": ...,
        "in_flight_takes_part": ..., "in_flight_buffers": [...]}}``: this rank's error
        feedback leaves in the same order; ``worker`` (a ``[]`` int64);
        one fp32 vector of ``delta_size`` values, the in-flight pseudo-gradient's tensors
        flattened in turn; whether this rank takes part in that exchange (a ``[]`` bool); the
        buffer values it sends, one per tensor of ``buffers`` (outside an exchange: zeros and
        ``True``, the same keys and shapes).

    Example:
        >>> from fn.diloco.checkpoint import diloco_state_dict
        >>> sorted(diloco_state_dict([], [()], [], [[]], counts={}, settings="", world_size=1))
        ['anchor', 'counts', 'in_flight', 'outer_state', 'per_rank', 'settings', 'world_size']
    """
    shared, own = [], []
    for state, fragment in zip(outer_states, fragments, strict=True):
        leaves, _ = tree_flatten(state)
        feedback = error_feedback_leaves(state)
        kept = [x for x, f in zip(leaves, feedback, strict=True) if not f]
        layout = _laid_out_like(kept, [params[i] for i in fragment])
        shared += [as_sharded_like(_copied(x), p) for x, p in zip(kept, layout, strict=True)]
        own += [_copied(x) for x, f in zip(leaves, feedback, strict=True) if f]
    return {
        # sharded: on the mesh's device, as DCP reads a DTensor; else where it is kept
        "anchor": [
            as_sharded_like(a.to(local_shard(p).device, copy=True), p)
            if isinstance(p, DTensor)
            else a.clone()
            for a, p in zip(anchor, params, strict=True)
        ],
        "outer_state": shared,
        "counts": dict(counts),
        "settings": settings,
        "world_size": world_size,
        "in_flight": {
            "fragment": None if in_flight is None else in_flight.fragment,
            "started_at": None if in_flight is None else in_flight.started_at,
            "trainable": None if in_flight is None else _listed(in_flight.trainable),
        },
        PER_RANK: {
            rank_key(): {
                "error_feedback": own,
                "worker": torch.tensor(worker),
                "in_flight_delta": _delta_vector(in_flight, delta_size, params),
                **_flight_record(in_flight, buffers, params),
            }
        },
    }


def _listed(positions: Sequence[int] | None) -> list[int] | None:
    return None if positions is None else [int(i) for i in positions]


def _delta_vector(
    in_flight: InFlight | None, size: int, params: Sequence[torch.Tensor]
) -> torch.Tensor:
    """One fp32 vector of ``size`` values, whether or not an exchange is in flight, so that
    the state has the same keys and shapes to load into (as DCP needs)."""
    device = local_shard(params[0]).device if params else None
    vector = torch.zeros(size, device=device)
    if in_flight is not None:
        flat = torch.cat([d.reshape(-1) for d in in_flight.delta])
        vector[: flat.numel()] = flat
    return vector


def _flight_record(
    in_flight: InFlight | None, buffers: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> dict[str, Any]:
    """This rank's part in the exchange in flight and the buffer values it sends (placeholders
    of the same shapes outside one)."""
    if in_flight is None or in_flight.takes_part is None:
        device = local_shard(params[0]).device if params else None
        return {
            "in_flight_takes_part": torch.ones((), dtype=torch.bool, device=device),
            "in_flight_buffers": [torch.zeros_like(b) for b in buffers],
        }
    return {
        "in_flight_takes_part": in_flight.takes_part.clone(),
        "in_flight_buffers": [b.clone() for b in in_flight.buffers],
    }


class Restored(NamedTuple):
    """What :func:`restored` reads from a state dict (new tensors, checked).

    Attributes:
        anchor: one local tensor per parameter, on the anchor's devices.
        outer_state: the outer rule's state.
        counts: the step counts.
        in_flight: the exchange in flight, to start again, or ``None``.
        worker: the saving worker's index among the workers (``None``: not saved, or the
            error feedback restarts).
    """

    anchor: list[torch.Tensor]
    outer_state: OptState
    counts: dict[str, Any]
    in_flight: InFlight | None = None
    worker: int | None = None


def restored(
    state: Mapping[str, Any],
    *,
    anchor: Sequence[torch.Tensor],
    fresh_state: OptState,
    settings: str,
    world_size: int,
    fragment_shards: Sequence[Sequence[torch.Tensor]] = (),
    buffers: Sequence[torch.Tensor] = (),
) -> Restored:
    """Reads a :func:`diloco_state_dict` and checks it against this run, changing nothing.

    Under another number of workers, or without this rank's own entries (saved by another rank
    or on another layout), the error feedback restarts from zero, with one warning. An
    exchange in flight loads only on the same number of workers, from this rank's own entries.

    Args:
        state: the state dict (from ``torch.load`` of one rank's file, or filled by DCP).
        anchor: this run's anchor (the shapes, dtypes and devices to read into).
        fresh_state: the outer rules' initial state, a pytree (e.g. a list of the fragments'
            states: the structure, and the error feedback to restart from).
        settings: this run's settings, as text.
        world_size: this run's number of workers.
        fragment_shards: each fragment's local parameters (the shapes and devices of an
            in-flight pseudo-gradient).
        buffers: the model's buffers that an exchange sends (the shapes, dtypes and devices of
            an in-flight exchange's buffer values).

    Returns:
        A :class:`Restored`.

    Raises:
        ValueError: other settings, tensors of other shapes, or an exchange in flight under
            another number of workers or without this rank's entries; nothing was read.

    Example:
        >>> from fn.diloco.checkpoint import diloco_state_dict, restored
        >>> saved = diloco_state_dict([torch.ones(2)], [()], [torch.ones(2)], [[0]],
        ...                           counts={"outer": 1}, settings="s", world_size=1)
        >>> restored(saved, anchor=[torch.zeros(2)], fresh_state=(), settings="s", world_size=1)
        Restored(anchor=[tensor([1., 1.])], outer_state=(), counts={'outer': 1}, in_flight=None,
                 worker=0)
    """
    where = "DiLoCo.load_state_dict"
    if state["settings"] != settings:
        raise ValueError(
            f"{where}: the checkpoint's settings {state['settings']} differ from this run's "
            f"{settings}; nothing was loaded"
        )
    in_flight = _in_flight(state, world_size, fragment_shards, buffers)  # refused before warning
    fresh, spec = tree_flatten(fresh_state)
    feedback = error_feedback_leaves(fresh_state)
    shared_fresh = [x for x, f in zip(fresh, feedback, strict=True) if not f]
    saved_shared = [local_shard(x) for x in state["outer_state"]]
    saved_anchor = [local_shard(x) for x in state["anchor"]]
    if len(saved_shared) != len(shared_fresh) or len(saved_anchor) != len(anchor):
        raise ValueError(f"{where}: the checkpoint's state has another structure")
    _check_shapes(where, saved_anchor, anchor)
    _check_shapes(where, saved_shared, shared_fresh)
    own = own_entries(state)
    saved_feedback = None if own is None else [local_shard(x) for x in own["error_feedback"]]
    restart = state["world_size"] != world_size or saved_feedback is None
    if not restart:
        fresh_feedback = [x for x, f in zip(fresh, feedback, strict=True) if f]
        restart = not _same_shapes(saved_feedback, fresh_feedback)
    if restart and any(feedback):
        warnings.warn(
            f"{where}: the checkpoint was taken on {state['world_size']} workers with another "
            f"layout or rank, this run has {world_size}: the error feedback restarts from zero",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    shared_iter = iter(saved_shared)
    feedback_iter = iter(saved_feedback or [])
    leaves = []
    for new, is_feedback in zip(fresh, feedback, strict=True):
        if is_feedback:
            old = new if restart else next(feedback_iter)
        else:
            old = next(shared_iter)
        leaves.append(_copied(old).to(new.device) if isinstance(new, torch.Tensor) else old)
    return Restored(
        [x.to(a.device, a.dtype, copy=True) for x, a in zip(saved_anchor, anchor, strict=True)],
        tree_unflatten(leaves, spec),
        dict(state["counts"]),
        in_flight,
        None if restart or "worker" not in own else int(own["worker"]),
    )


def _in_flight(
    state: Mapping[str, Any],
    world_size: int,
    fragment_shards: Sequence[Sequence[torch.Tensor]],
    buffers: Sequence[torch.Tensor],
) -> InFlight | None:
    """The checkpoint's exchange in flight, checked, its pseudo-gradient and this rank's
    participation on the parameters' devices, its buffer values on the buffers'; ``None``
    outside one."""
    entry = state.get("in_flight") or {"fragment": None}
    if entry["fragment"] is None:
        return None
    own = own_entries(state)
    if state["world_size"] != world_size or own is None:
        raise ValueError(
            f"DiLoCo.load_state_dict: the checkpoint was taken on {state['world_size']} "
            f"workers while fragment {entry['fragment']}'s exchange was in flight; "
            f"that exchange belongs to those ranks and cannot resume on "
            f"{world_size} workers or from another rank's entries. Resume on the "
            "same ranks, or from a checkpoint taken outside an exchange (not in the delay "
            "steps before a fragment's outer step); nothing was loaded"
        )
    vector = local_shard(own["in_flight_delta"])
    if vector.shape != (max(sum(x.numel() for x in f) for f in fragment_shards),):
        raise ValueError(
            "DiLoCo.load_state_dict: the in-flight pseudo-gradient has another size than "
            "this run's fragments; nothing was loaded"
        )
    params = fragment_shards[entry["fragment"]]
    pieces = vector[: sum(q.numel() for q in params)].split([q.numel() for q in params])
    delta = [
        x.reshape(q.shape).to(q.device, torch.float32, copy=True)
        for x, q in zip(pieces, params, strict=True)
    ]
    trainable = _listed(entry.get("trainable"))
    if "in_flight_takes_part" not in own:  # saved before fn kept them: decided again on load
        return InFlight(entry["fragment"], entry["started_at"], delta, trainable=trainable)
    values = [local_shard(x) for x in own["in_flight_buffers"]]
    if not _same_shapes(values, buffers):
        raise ValueError(
            "DiLoCo.load_state_dict: the in-flight exchange's buffers have other shapes than "
            "this model's; nothing was loaded"
        )
    takes_part = local_shard(own["in_flight_takes_part"]).to(params[0].device, torch.bool)
    return InFlight(
        entry["fragment"],
        entry["started_at"],
        delta,
        takes_part.clone(),
        [x.to(b.device, b.dtype, copy=True) for x, b in zip(values, buffers, strict=True)],
        trainable,
    )


def _same_shapes(saved: Sequence[Any], fresh: Sequence[Any]) -> bool:
    return len(saved) == len(fresh) and all(
        not isinstance(b, torch.Tensor) or (isinstance(a, torch.Tensor) and a.shape == b.shape)
        for a, b in zip(saved, fresh, strict=True)
    )


def _check_shapes(where: str, saved: Sequence[Any], fresh: Sequence[Any]) -> None:
    if not _same_shapes(saved, fresh):
        raise ValueError(
            f"{where}: the checkpoint's tensors have other shapes than this run's "
            "(another model?); nothing was loaded"
        )


def _copied(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x
