"""What fn's states share about ``torch.distributed.checkpoint`` (DCP): where each rank's own
entries sit in a state dict, and the two things fn reads of DCP's state-dict API
(``torch.distributed.checkpoint.state_dict``) from the call stack, for which torch has no public
name.

DCP saves a key that every rank holds once, as if the ranks held replicas. What differs between
ranks (error feedback, 0/1 Adam's local momentum, DiLoCo's pseudo-gradient in flight) therefore
sits under a key of the rank's own, in every fn state dict alike:

.. math::
    \\mathrm{state}[\\texttt{"per\\_rank"}][\\texttt{"rank}r\\texttt{"}]

with ``r`` the rank in the state's group (the world for ``fn.fsdp`` and ``fn.diloco``, the
optimizer's comm for ``fn.optim.PerRankState``). A checkpoint saved on ``W`` ranks holds ``W``
such entries, and each rank reads back only its own."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

__all__ = [
    "PER_RANK",
    "rank_key",
    "own_entries",
    "called_by_state_dict_api",
    "initializing_optimizer_state",
]

PER_RANK = "per_rank"
"""The key of a state dict's per-rank entries, each under :func:`rank_key`."""

_STATE_DICT_API = "torch.distributed.checkpoint.state_dict"


def rank_key(rank: int | None = None) -> str:
    """The name of rank ``rank``'s own entries under ``state["per_rank"]``: ``"rank<r>"``.

    Args:
        rank: the rank; ``None``: this process's rank in the world (0 without
            ``torch.distributed``).

    Returns:
        ``f"rank{rank}"``.

    Example:
        >>> from fn.collectives.dcp import rank_key
        >>> rank_key(3), rank_key()
        ('rank3', 'rank0')
    """
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"rank{rank}"


def own_entries(state: Mapping[str, Any], rank: int | None = None) -> Any:
    """Rank ``rank``'s own entries of ``state`` (``state["per_rank"]["rank<r>"]``), or ``None``
    where it has none (a state saved on fewer ranks, or with no per-rank part).

    Args:
        state: a state dict.
        rank: the rank (:func:`rank_key`).

    Returns:
        The entries, or ``None``.

    Example:
        >>> from fn.collectives.dcp import own_entries
        >>> own_entries({"per_rank": {"rank0": {"error": 1}}}), own_entries({}, rank=1)
        ({'error': 1}, None)
    """
    per_rank = state.get(PER_RANK)
    return per_rank.get(rank_key(rank)) if isinstance(per_rank, Mapping) else None


def called_by_state_dict_api() -> bool:
    """Whether the caller of the function that asks was called by DCP's state-dict API
    (``get_state_dict``, ``set_state_dict`` and their ``_optimizer_`` forms read
    ``optimizer.state`` before anything else of it).

    Returns:
        ``True`` where the frame two above this one is of ``torch.distributed.checkpoint.
        state_dict``.

    Example:
        >>> from fn.collectives.dcp import called_by_state_dict_api
        >>> def state():
        ...     return called_by_state_dict_api()
        >>> state()
        False
    """
    return sys._getframe(2).f_globals.get("__name__") == _STATE_DICT_API


def initializing_optimizer_state() -> bool:
    """Whether this call comes from DCP's ``_init_optim_state``, which runs one ``step()`` of a
    fresh optimizer with zero gradients and learning rate 0 to create its state before a
    checkpoint is saved or loaded: not a training step, so a wrapper that counts steps (DiLoCo)
    does not count it.

    Returns:
        ``True`` where a frame of ``_init_optim_state`` is on the stack.

    Example:
        >>> from fn.collectives.dcp import initializing_optimizer_state
        >>> initializing_optimizer_state()
        False
    """
    return any(
        frame.f_code.co_name == "_init_optim_state"
        and frame.f_globals.get("__name__") == _STATE_DICT_API
        for frame, _ in traceback.walk_stack(sys._getframe(1))
    )
