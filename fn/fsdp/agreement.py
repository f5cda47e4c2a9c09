"""What the ``fn.fsdp`` installers check across ranks: that no rank refused its arguments and that
every rank passed the same settings (one small all-gather), so that a problem on one rank is an
error on every rank at install rather than a hang or a backend abort at the first collective."""

from __future__ import annotations

import numbers
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fn.collectives import ProcessGroup
from fn.collectives.process_group import all_gather_flat

__all__ = [
    "agree", "agree_on_settings", "gather_texts", "integer", "problem_of", "shard_group", "shared"
]  # fmt: skip

# the problems a rank can report to the others (their index in the all-gathered tensor)
KINDS: tuple[type[Exception] | None, ...] = (None, ValueError, NotImplementedError, TypeError)


def integer(name: str, value: Any) -> int:
    """``value`` as a Python int.

    Args:
        name: the setting's name, for the message.
        value: its value.

    Returns:
        ``int(value)``.

    Raises:
        TypeError: naming ``name``, unless ``value`` is an integer (a bool is not).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def problem_of(error: Exception) -> tuple[type[Exception], str]:
    """``error`` as :func:`agree`'s ``problem``: its kind (one :func:`agree` can send, else
    ``ValueError``) and message."""
    kind = type(error) if type(error) in KINDS else ValueError
    return kind, str(error)


def shard_group(module: nn.Module) -> dist.ProcessGroup | None:
    """The process group FSDP2 shards ``module``'s first parameter over (its mesh dim of
    ``Shard`` placement), or ``None`` when no parameter of it is sharded."""
    for p in module.parameters():
        if isinstance(p, DTensor):
            for mesh_dim, placement in enumerate(p.placements):
                if isinstance(placement, Shard):
                    return p.device_mesh.get_group(mesh_dim)
    return None


def gather_texts(
    group: dist.ProcessGroup | None, text: str, sizes: list[int], device: torch.device | str
) -> list[str]:
    """Every rank's ``text``, in group rank order: one all-gather of their UTF-8 bytes, padded to
    the longest (a collective over ``group``, ``None``: the world).

    Args:
        group: the process group.
        text: this rank's text.
        sizes: every rank's byte count of its text (all-gathered just before, so that every
            rank knows whether to call this).
        device: where the all-gather runs (a ``nccl`` group has no CPU collectives).

    Returns:
        The ranks' texts.
    """
    width = max(max(sizes), 1)
    mine = torch.zeros(width, dtype=torch.uint8)
    data = text.encode()
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(len(sizes) * width, dtype=torch.uint8, device=device)
    all_gather_flat(out, mine.to(device), group=group)
    rows = out.cpu().view(len(sizes), width)
    return [bytes(rows[r, :n].tolist()).decode() for r, n in enumerate(sizes)]


def shared(texts: list[str], verb: str, ranks: list[int] | None = None) -> str:
    """The ranks' non-empty ``texts`` as one message: ``"rank(s) [r, ...] <verb>: <text>"`` for
    each distinct text, in the order of their first ranks, joined by ``"; "``; ``ranks``: the
    ranks in the world of the texts' senders (default: their index)."""
    found: dict[str, list[int]] = {}
    for index, text in enumerate(texts):
        if text:
            found.setdefault(text, []).append(index if ranks is None else ranks[index])
    return "; ".join(f"rank(s) {senders} {verb}: {text}" for text, senders in found.items())


def agree(
    name: str,
    group: dist.ProcessGroup | None,
    problem: tuple[type[Exception], str] | None,
    fingerprint: str,
    what: str = "settings or models",
    device: torch.device | str = "cpu",
) -> None:
    """Raises on every rank if some rank found a problem or the ranks' settings differ (one
    all-gather over ``group``, or ``WORLD`` when the model gave none, and a second one of the
    problems' messages when some rank found one; nothing without a process group or with one
    rank).

    Args:
        name: the installer, which starts every message (``"fn.fsdp.OnebitAdam"``).
        group: the model's FSDP2 process group, or ``None``.
        problem: what this rank refused (an exception class of :data:`KINDS` and its message,
            without ``name``), or ``None``.
        fingerprint: this rank's settings, as a string every rank must match.
        what: what the ranks passed, for the message when the fingerprints differ.
        device: where the all-gathers run: the model's device (a ``nccl`` group has no CPU
            collectives).

    Raises:
        ValueError, NotImplementedError, TypeError: on every rank, the same: the kind of the
            first rank that found a problem, with every distinct problem and the ranks (in the
            world) that found it (``"<name>: rank(s) [2, 3] refused the model or the settings:
            <why>"``).
        ValueError: on every rank, the fingerprints differ.
    """
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    if group is None or dist.get_world_size(group) == 1:
        if problem is not None:
            raise problem[0](f"{name}: {problem[1]}")
        return
    text = "" if problem is None else problem[1] or problem[0].__name__
    mine = torch.tensor(
        [
            KINDS.index(problem[0]) if problem else 0,
            zlib.crc32(fingerprint.encode()),
            len(text.encode()),
        ],
        dtype=torch.int64,
        device=device,
    )
    gathered = ProcessGroup(group).all_gather(mine).cpu()
    failed = [r for r, kind in enumerate(gathered[:, 0].tolist()) if kind]
    if failed:
        texts = gather_texts(group, text, gathered[:, 2].tolist(), device)
        kind = KINDS[int(gathered[failed[0], 0])]
        ranks = dist.get_process_group_ranks(group)
        raise kind(f"{name}: {shared(texts, 'refused the model or the settings', ranks)}")
    if bool((gathered[:, 1] != gathered[0, 1]).any()):
        raise ValueError(
            f"{name}: the ranks passed different {what} (fingerprints "
            f"{gathered[:, 1].tolist()}); every rank must pass the same"
        )


def agree_on_settings(
    name: str,
    module: nn.Module,
    make: Callable[[], Any],
    keys: tuple[str, ...],
    missing: str | None,
) -> None:
    """An installer's check of its settings, on this rank and then across ranks (:func:`agree`
    over ``module``'s FSDP2 shard group, on its device).

    Args:
        name: the installer, which starts every message.
        module: the model it installs on.
        make: builds the object that checks the settings (raising ``TypeError`` or
            ``ValueError``); its attributes ``keys`` are the settings the ranks compare.
        keys: those attributes' names.
        missing: what is wrong with ``module`` itself (no FSDP2 module, say), or ``None``.

    Raises:
        TypeError, ValueError: as :func:`agree`, on every rank.
    """
    problem, fingerprint = None, ""
    try:
        checked = make()
        fingerprint = repr(tuple(getattr(checked, key) for key in keys))
        if missing is not None:
            raise ValueError(missing)
    except (TypeError, ValueError) as error:
        problem = problem_of(error)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    names = ", ".join(keys[:-1]) + " or " + keys[-1] if len(keys) > 1 else keys[0]
    what = f"{names} (this rank: {fingerprint})"
    agree(name, shard_group(module), problem, fingerprint, what, device)
