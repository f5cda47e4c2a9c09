"""Decisions the ranks of the ``torch.optim`` adapter take together (the cross-rank checks of
README's "Policies").

Every rank must issue the same collectives in the same order, so what decides them is agreed on
by all ranks, never read from one rank's local data alone: whether this process is one of several
(:func:`default_comm`), a new group's settings and param shapes (:func:`check_same_group`; not
their values, which a rank may load later), the ranks' step counts, hyperparameters and params
(:func:`check_in_sync`, as :class:`SyncCheckSchedule` says), and each step's gradients
(:func:`vote_on_gradients`, :func:`refuse_unusable`). The comparisons exchange a small fixed-size
fingerprint first; the full descriptions travel only when fingerprints differ, so that every
rank raises the same error naming the fields and the ranks, and none waits in a collective the
others skipped.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fn.collectives import Local, ProcessGroup, Simulated, SimulatedGroup
from fn.collectives.agreement import bit_checksum, differences, digest, gather_texts
from fn.errors import all_finite

_MAX_SHOWN = 5  # differing fields named in one message
_MAX_DEPTH = 12  # how deep settings_of follows closures and NamedTuples
_SCALARS = (bool, int, float, str, type(None))


def settings_of(obj: Any, path: str = "transform") -> dict[str, str]:
    """The scalar settings inside a transform (``{path: repr}``): the NamedTuple fields and the
    closure variables of its functions, followed a few levels deep (chains, schedules), each
    object once. Tensors, comms and other objects are left out; functions are named by their
    qualified name.

    Example:
        >>> from fn.optim._consensus import settings_of
        >>> tx = fn.onebit_adam(1e-3, freeze_step=4, comm=fn.collectives.Local())
        >>> for path, value in settings_of(tx).items():
        ...     if path.endswith(("freeze_step", "settings.eps")):
        ...         print(path, value)
        transform.warmup_update.step_fn.is_compressed.freeze_step 4
        transform.warmup_update.step_fn.update.settings.eps 1e-08
    """
    out: dict[str, str] = {}
    seen: set[int] = set()

    def visit(obj: Any, path: str, depth: int) -> None:
        if isinstance(obj, _SCALARS):
            out[path] = repr(obj)
            return
        if depth > _MAX_DEPTH or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            for field in obj._fields:
                visit(getattr(obj, field), f"{path}.{field}", depth + 1)
        elif isinstance(obj, (tuple, list)):
            for i, item in enumerate(obj):
                visit(item, f"{path}[{i}]", depth + 1)
        elif inspect.ismethod(obj):
            visit(obj.__self__, path, depth + 1)
        elif inspect.isfunction(obj):
            out[path] = f"{obj.__module__}.{obj.__qualname__}"
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                visit(value, f"{path}.{name}", depth + 1)

    visit(obj, path, 0)
    return out


def default_comm() -> Any:
    """``ProcessGroup()`` when ``torch.distributed`` is initialized, else ``Local()``.

    Returns:
        The communicator an optimizer built with ``comm=None`` uses.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized but the environment says this
            process is one of several (``WORLD_SIZE`` > 1, as set by ``torchrun``): a
            single-process optimizer there would silently let the ranks drift apart.

    Example:
        >>> fn.optim.default_comm()  # one process, no torch.distributed
        Local()
    """
    if dist.is_available() and dist.is_initialized():
        return ProcessGroup()
    world_size = os.environ.get("WORLD_SIZE", "1")
    if world_size.strip() not in ("", "0", "1"):
        raise RuntimeError(
            f"WORLD_SIZE={world_size} in the environment, but torch.distributed is not "
            "initialized: call torch.distributed.init_process_group() before building the "
            "optimizer (Trainer and Accelerate do it when they are created: build the optimizer "
            "after TrainingArguments/Accelerator), or pass comm=fn.collectives.Local() to run "
            "each process alone on purpose"
        )
    return Local()


def process_comm(comm: Any) -> Any:
    """The communicator of an adapter built with ``comm``: :func:`default_comm` for ``None``.

    Raises:
        TypeError: ``comm`` simulates ranks (the adapter runs one rank per process).
    """
    comm = default_comm() if comm is None else comm
    if isinstance(comm, (Simulated, SimulatedGroup)):
        raise TypeError(
            "fn.optim runs one rank per process: use Local() or ProcessGroup(); simulate "
            "ranks with the functional API (fn.collectives.simulate)"
        )
    return comm


def group_settings(
    optimizer: type, options: Mapping[str, Any], transform: Any, fixed: bool, group: Mapping
) -> dict[str, str]:
    """What every rank must build a param group with, described (for :func:`check_same_group`
    and :func:`check_in_sync`).

    Args:
        optimizer: the optimizer's class.
        options: its constructor's options (``flatten``, ``sync_grads``, ``nonfinite``).
        transform: the transform, or the factory that builds it.
        fixed: whether ``transform`` is a transform (else a factory).
        group: the param group.

    Returns:
        ``{name: description}``: the optimizer's class, the options, the transform's settings
        (:func:`settings_of`) and the group's entries but its params and their names.
    """
    settings = {"optimizer": f"{optimizer.__module__}.{optimizer.__qualname__}"}
    settings.update({name: repr(value) for name, value in options.items()})
    settings.update(settings_of(transform, "transform" if fixed else "transform factory"))
    for key in sorted(k for k in group if k not in ("params", "param_names")):
        value = group[key]
        settings[key] = repr(tuple(value) if isinstance(value, list) else value)
    return settings


def _gather_fingerprints(comm: Any, rows: torch.Tensor) -> list[list[int]]:
    """Every rank's ``rows`` (int64, the same shape on every rank), as lists by rank."""
    return comm.all_gather(rows.reshape(-1)).view(comm.world_size, -1).tolist()


def check_same_group(
    comm: Any, index: int, settings: Mapping[str, str], params: list[torch.Tensor]
) -> None:
    """Raises the same ``ValueError`` on every rank if the ranks built param group ``index``
    differently: other settings or other params (number, shapes, dtypes). The params' values
    are not compared here (:func:`check_in_sync` does, once they are final).

    One all_gather of one int64 per rank (a hash of everything) in the common case; on a
    mismatch, the descriptions (two more small all_gathers) to name the fields and the ranks.

    Args:
        comm: the communicator.
        index: the group's index (for the message).
        settings: ``{field: value}`` descriptions (optimizer, transform, hyperparameters, ...).
        params: this rank's params of the group.

    Raises:
        ValueError: on every rank, naming the param count or first param that differs, or else
            every setting (up to five) and the ranks holding each value.
    """
    if comm.world_size == 1:
        return
    # on the params' device, like all of the optimizer's traffic (NCCL takes only GPU tensors)
    device = params[0].device if params else torch.device("cpu")
    lines = [f"param {i}: shape {tuple(p.shape)} ({p.dtype})" for i, p in enumerate(params)]
    lines += [f"{field}: {value}" for field, value in settings.items()]
    text = "\n".join(lines)
    fingerprint = torch.tensor([len(params), digest(text)], dtype=torch.int64, device=device)
    gathered = _gather_fingerprints(comm, fingerprint)
    if all(row == gathered[0] for row in gathered):
        return
    for rank, (count, _) in enumerate(gathered):
        if count != gathered[0][0]:
            raise ValueError(
                f"fn.optim: param group {index} has {gathered[0][0]} trainable params on rank 0 "
                f"but {count} on rank {rank}; every rank must build the optimizer "
                "over the same model"
            )
    described = [
        dict(line.split(": ", 1) for line in t.splitlines())
        for t in gather_texts(comm, text, device=device)
    ]
    for i in range(len(params)):
        for rank, theirs in enumerate(described):
            if theirs[f"param {i}"] != described[0][f"param {i}"]:
                raise ValueError(
                    f"fn.optim: param group {index}, param {i} differs across ranks: "
                    f"{described[0][f'param {i}']} on rank 0 but {theirs[f'param {i}']} on "
                    f"rank {rank}"
                )
    differing = differences(described)
    raise ValueError(
        f"fn.optim: the ranks built param group {index} differently: "
        + "; ".join(differing[:_MAX_SHOWN])
        + ("; ..." if len(differing) > _MAX_SHOWN else "")
        + " (every rank must build the optimizer with the same arguments)"
    )


class GroupSnapshot(NamedTuple):
    """What :func:`check_in_sync` compares of one param group."""

    step: int  # the group's update count
    settings: str  # the group's hyperparameters, described
    params: torch.Tensor  # the group's flat params (fp32 master for fp16/bf16)
    tolerance: float | None  # how closely the params agree (GroupRuntime.param_agreement)


def _param_stats(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[bit checksum, sum, sum |x|, sum x^2]``, the float64 sums as their bit patterns."""
    x = x.detach()
    sums = torch.stack(
        [x.sum(dtype=torch.float64), x.abs().sum(dtype=torch.float64), x.double().square().sum()]
    )
    return torch.cat([bit_checksum(x).view(1), sums.view(torch.int64)])


def _stats_agree(ours: list[int], theirs: list[int], rtol: float) -> bool:
    if rtol == 0:
        return ours[0] == theirs[0]
    a = torch.tensor(ours[1:], dtype=torch.int64).view(torch.float64).tolist()
    b = torch.tensor(theirs[1:], dtype=torch.int64).view(torch.float64).tolist()
    sum_ok = abs(a[0] - b[0]) <= rtol * max(a[1], b[1])
    square_ok = abs(a[2] - b[2]) <= rtol * max(a[2], b[2])
    return all(map(math.isfinite, a + b)) and sum_ok and square_ok


def check_in_sync(comm: Any, groups: Sequence[GroupSnapshot]) -> None:
    """Raises the same ``ValueError`` on every rank if the ranks' step counts, hyperparameters or
    params differ (one all_gather of ``7 * len(groups)`` int64 per rank and one pass over the
    params; params bit for bit, to a tolerance in their sums, or not at all, as each group's
    ``tolerance`` says).

    Args:
        comm: the communicator.
        groups: this rank's snapshot of every group.

    Raises:
        ValueError: on every rank, naming each group, field and the ranks holding each value.
    """
    if comm.world_size == 1 or not groups:
        return
    device = groups[0].params.device
    head = [[g.step, digest(g.settings), int(g.tolerance is not None)] for g in groups]
    stats = [_param_stats(g.params).to(device) for g in groups]
    rows = torch.cat([torch.tensor(head, device=device), torch.stack(stats)], dim=1)
    gathered = _gather_fingerprints(comm, rows)
    width = rows.shape[1]
    problems = []
    for index, group in enumerate(groups):
        by_rank = [row[index * width : (index + 1) * width] for row in gathered]
        for column, field in enumerate(("step count", "hyperparameters")):
            values = [r[column] for r in by_rank]
            if len(set(values)) > 1:
                ranks = {v: [i for i, w in enumerate(values) if w == v] for v in values}
                problems.append(
                    f"param group {index} {field} differ: ranks "
                    + " vs ".join(str(r) for r in ranks.values())
                    + (f" (step counts {sorted(set(values))})" if field == "step count" else "")
                )
        if not all(r[2] for r in by_rank):
            continue
        agree = [_stats_agree(by_rank[0][3:], r[3:], group.tolerance) for r in by_rank]
        if not all(agree):
            problems.append(
                f"param group {index} params differ: ranks {[i for i, a in enumerate(agree) if a]}"
                f" hold rank 0's, ranks {[i for i, a in enumerate(agree) if not a]} other values"
            )
    if problems:
        raise ValueError(
            "fn.optim: the ranks are out of sync: "
            + "; ".join(problems)
            + " (the ranks started from different params or hyperparameters: seed the model's "
            "initialization the same way on every rank or load the same weights, and when "
            "resuming load every rank's optimizer state too; or a rank changed its params or "
            "stepped alone)"
        )


class SyncCheckSchedule:
    """When the adapter runs :func:`check_in_sync` on its own: at its first update after it was
    built or loaded (``start_due``: once the weights and the state that the ranks start from are
    final; a step that makes no update does not count), and every ``check_every`` updates
    (:meth:`due_after_update`)."""

    def __init__(self) -> None:
        self.start_due = True
        self.updates = 0  # updates since the last periodic check

    def due_after_update(self, check_every: int, groups: Sequence[Any]) -> bool:
        """Counts an update of the ``groups`` (``GroupRuntime``); whether the periodic check is
        due now (``check_every=0``: never). 0/1 Adam: postponed to the next update after which
        the ranks' params agree (a sync), when every group's ``param_agreement()`` is known."""
        if not check_every:
            return False
        self.updates += 1
        due = self.updates >= check_every
        if due and all(runtime.param_agreement() is not None for runtime in groups):
            self.updates = 0
            return True
        return False


class GradientVote(NamedTuple):
    """What the ranks agreed on about one step's gradients (the same on every rank)."""

    nonfinite: int  # non-finite gradient elements over all ranks, plus overflowing scalers
    unusable: int  # ranks with a gradient the optimizer cannot take (e.g. a sparse one)
    holding: int = 1  # ranks on which some param has a gradient (0: the step is no update)


def vote_on_gradients(
    comm: Any,
    grads: list[torch.Tensor],
    found_inf: torch.Tensor | None,
    unusable: bool,
    holding: bool = True,
    device: torch.device | None = None,
) -> GradientVote:
    """The ranks' vote on a step's gradients: one 3-element allreduce.

    Args:
        comm: the communicator.
        grads: this rank's gradients to count non-finite elements in (none: not counted here).
        found_inf: this rank's ``GradScaler`` overflow flag, or ``None`` without a scaler.
        unusable: whether this rank holds a gradient the optimizer cannot take.
        holding: whether some param of this rank has a gradient (``.grad`` not ``None``).
        device: where the vote travels when ``grads`` is empty (the params' device: NCCL
            takes only GPU tensors); ``None``: the CPU.

    Returns:
        The same vote on every rank: the step is no update when no rank holds a gradient
        (``holding == 0``), and may be taken exactly when the other two counts are zero.
    """
    device = grads[0].device if grads else device or torch.device("cpu")
    counts = torch.zeros(3, dtype=torch.int64, device=device)
    for g in grads:
        if not all_finite(g):  # one reduction in the common case; the exact count only here
            counts[0] += (~torch.isfinite(g)).sum().to(device)
    if found_inf is not None:
        counts[0] += (found_inf.to(device) > 0).to(torch.int64)
    counts[1] = int(unusable)
    counts[2] = int(holding)
    if comm.world_size > 1:
        counts = comm.all_reduce(counts, op="sum")
    return GradientVote(*counts.tolist())


def refuse_unusable(comm: Any, vote: GradientVote, unusable: Sequence[str]) -> None:
    """Raises the same ``ValueError`` on every rank when the vote counts ranks holding a gradient
    the optimizer cannot take, naming this rank's first (``unusable``, described) if it holds
    one."""
    if vote.unusable:
        mine = unusable[0] if unusable else "that rank's error names the param"
        raise ValueError(
            f"fn.optim: {vote.unusable} of {comm.world_size} ranks hold a gradient that "
            f"fn.optim cannot take ({mine}); no update was made on any rank"
        )
