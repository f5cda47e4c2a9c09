"""What ``step()`` of a 1-bit optimizer on FSDP2 checks of the gradients its backwards delivered,
before anything changes: :func:`first_exchange`, its first collective (the ranks' micro-batch
counts and ``max_grad_norm``, the reduce-scatters' problems and the gradients' statistics in one
all-gather), and the statistics themselves (:func:`gradient_stats`: non-finite values, the
gradient energy of ``freeze_step="auto"`` and the squared norm that ``max_grad_norm`` clips by,
``fn.transforms.clipping``'s). docs/algorithms.md, "Accumulation and clipping on FSDP2 and
HSDP"."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fn.collectives import CollectiveTimeoutError, ProcessGroup
from fn.errors import NonFiniteError
from fn.transforms import gradient_energy
from fn.transforms.clipping import squared_norm

__all__ = ["checked_totals", "first_exchange", "gradient_stats", "GRAD_CHANGED"]

# Where .grad is changed between the backward and step() on a 1-D mesh's compressed phase
GRAD_CHANGED = (
    "{name}: .grad was changed between the backward and step() (by "
    "torch.nn.utils.clip_grad_norm_, say) in the compressed phase on a 1-D mesh, where the update "
    "reads the local gradient that fn accumulated, not .grad: the change has no effect. Clip with "
    "max_grad_norm= (every phase), or use HSDP (replicate=), where .grad is what the update reads"
)

_UNEVEN = (
    "{name}: the ranks ran different numbers of micro-batches (backwards that reduce-scattered) "
    "since the last step() ({shown}): every rank must run the same number before each step(); "
    "nothing was updated, and the accumulated gradients were dropped (zero_grad, then train on)"
)
_CLIPS = (
    "{name}: the ranks' max_grad_norm differ ({shown}): set it on every rank alike; nothing was "
    "updated"
)
_LRS = (
    "{name}: the ranks' lr in param_groups[0] differ ({shown}): set it (or step the scheduler) "
    "on every rank alike, or the replicas' params drift apart; nothing was updated"
)

# What step() adds to a timeout of its first exchange: the likely cause
_STEP_MISSED = (
    "{name}: the ranks named never reached step()'s first exchange, where the ranks compare "
    "their micro-batch counts: a rank that runs more micro-batches than the others waits in "
    "FSDP2's all-gather of its next forward (a collective of FSDP2's, which fn does not see) "
    "while the others wait in step(). Every rank must run the same number of micro-batches "
    "before each step() (docs/guides/fsdp.md); the process groups cannot be used after this "
    "error: restart from the last checkpoint"
)


def gradient_stats(
    grads: Mapping[str, torch.Tensor | None],
    *,
    energy: bool = False,
    norm: bool = True,
    changed: bool = False,
) -> list[float]:
    """This rank's statistics of gradients (``grads``, by name; ``None``: none), for the checks:
    ``[non-finite, energy, squared norm, changed]``: how many hold a value that is not finite;
    with ``energy`` (a mapping: the shards of the averaged gradient, by FQN) their gradient
    energy (``fn.transforms.gradient_energy``); with ``norm`` their squared norm
    (``fn.transforms.clipping.squared_norm``), both ``0.0`` when some value is not finite; and
    ``changed`` (whether ``.grad`` was changed where the update does not read it).

    Example:
        >>> from fn.fsdp.onebit_gradients import gradient_stats
        >>> gradient_stats({"a": torch.tensor([3.0]), "b": None, "c": torch.tensor([4.0])})
        [0.0, 0.0, 25.0, 0.0]
    """
    present = [g for g in grads.values() if g is not None]
    bad = sum(int(not bool(g.isfinite().all())) for g in present)
    measured = float(gradient_energy(grads)) if energy and not bad else 0.0
    square = squared_norm(present) if norm and not bad else 0.0
    return [float(bad), measured, square, float(changed)]


def first_exchange(
    comm: ProcessGroup,
    name: str,
    batches: int,
    max_grad_norm: float | None,
    lr: float,
    problems: list[Exception],
    stats: list[float],
) -> torch.Tensor:
    """``step()``'s first collective, before any other: one all-gather over ``comm`` (the ranks
    of ``world``, on a group of the optimizer's own) of this rank's micro-batch count
    (``batches``), its ``max_grad_norm`` and ``lr``, whether its reduce-scatters found a
    problem (of which kind, and the first rank a failed collective missed) and its gradient
    statistics (``stats``: :func:`gradient_stats`), which it returns summed over the ranks in
    rank order (the same bits on every rank).

    Raises:
        RuntimeError: on every rank, the ranks ran different numbers of micro-batches.
        ValueError: on every rank, the ranks' ``max_grad_norm`` or ``lr`` differ.
        Exception: the first of this rank's ``problems`` (what its reduce-scatters found, or
            a setting it changed), or on every other rank one of the same kind
            (``RuntimeError``, ``fn.NonFiniteError``, ``ValueError``, ``CollectiveTimeoutError``)
            naming the first rank that found one.
        CollectiveTimeoutError: some rank never called ``step()`` (see the message).
    """
    first = problems[0] if problems else None
    lost = -1.0
    if isinstance(first, CollectiveTimeoutError) and first.missing_ranks:
        lost = float(min(first.missing_ranks))
    kind = 0.0 if first is None else _KINDS.index(_kind(first))
    head = [float(batches), max_grad_norm or 0.0, float(lr), float(first is not None), kind, lost]
    mine = torch.tensor(head + stats, dtype=torch.float64)
    rows = mine.view(1, -1)
    if comm.world_size > 1:
        try:
            rows = comm.all_gather(mine).view(-1, mine.numel())
        except CollectiveTimeoutError as error:
            error.args = (f"{error.args[0]}; {_STEP_MISSED.format(name=name)}",)
            raise
    _check_same(name, *rows[:, :3].T.tolist())
    failed = rows[:, 3].nonzero().view(-1).tolist()
    if problems:
        raise problems[0]
    if failed:
        first_rank = failed[0]
        kind, lost = _KINDS[int(rows[first_rank, 4])], int(rows[first_rank, 5])
        raise _shared_problem(name, first_rank, kind, lost)
    return rows[:, 6:].sum(0)


def _check_same(name: str, counts: list[float], clips: list[float], lrs: list[float]) -> None:
    """Raises on every rank (every input is the same there) unless the ranks ran as many
    micro-batches, clip alike and step with the same learning rate (as a float64: a float
    lr exactly)."""
    checks = (
        (RuntimeError, [int(c) for c in counts], _UNEVEN),
        (ValueError, [c or None for c in clips], _CLIPS),
        (ValueError, lrs, _LRS),
    )
    for error, values, message in checks:
        if len({repr(v) for v in values}) > 1:  # by repr: a NaN lr on every rank is alike
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise error(message.format(name=name, shown=shown))


_KINDS = (RuntimeError, NonFiniteError, ValueError)  # a problem's kind, as the header sends it


def _kind(problem: Exception) -> type[Exception]:
    """The first of :data:`_KINDS` that ``problem`` is (``RuntimeError`` for the rest)."""
    return next((k for k in _KINDS[1:] if isinstance(problem, k)), RuntimeError)


def _shared_problem(name: str, rank: int, kind: type[Exception], lost: int) -> Exception:
    """What every other rank raises when ``rank`` found a problem before its update (in its
    reduce-scatters, or its settings changed): of the same ``kind``, or
    ``CollectiveTimeoutError`` naming ``lost``, the first rank that a failed collective of
    ``rank`` missed (``-1``: none)."""
    if lost >= 0:
        message = (
            f"{name}: the reduce-scatter of rank {rank} failed: rank {lost} never reached one "
            "of its collectives (see its error); nothing was updated"
        )
        return CollectiveTimeoutError(message, [lost])
    what = "a gradient that is not finite" if kind is NonFiniteError else "a problem"
    return kind(
        f"{name}: rank {rank} found {what} before this update (in its reduce-scatter, or a "
        "setting it changed: see its error); nothing was updated"
    )


def checked_totals(name: str, totals: torch.Tensor, compressed: bool) -> torch.Tensor:
    """``totals``, the gradient statistics summed over the ranks (:func:`gradient_stats`'s
    order), once checked.

    Raises:
        fn.NonFiniteError: on every rank, some rank's gradient is not finite (the averaged
            gradient's shards in the warmup, the accumulated gradient once ``compressed``).
    """
    if totals[0] > 0:
        where = "accumulated gradient of some rank"
        if not compressed:
            where = "averaged gradient (on some rank)"
        raise NonFiniteError(f"{name}: non-finite values in the {where}; nothing was updated")
    return totals
