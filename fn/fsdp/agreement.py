"""What the ``fn.fsdp`` installers check across ranks (:func:`agree_on_settings`): that no rank
refused its arguments and that every rank passed the same settings, through
``fn.collectives.agreement`` over the model's shard group, so that a problem on one rank is an
error on every rank at install rather than a hang or a backend abort at the first collective."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fn.collectives import Local, ProcessGroup
from fn.collectives.agreement import agree, problem_of

__all__ = ["agree_on_settings", "integer", "shard_group"]


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


def shard_group(module: nn.Module) -> dist.ProcessGroup | None:
    """The process group FSDP2 shards ``module``'s first parameter over (its mesh dim of
    ``Shard`` placement), or ``None`` when no parameter of it is sharded."""
    for p in module.parameters():
        if isinstance(p, DTensor):
            for mesh_dim, placement in enumerate(p.placements):
                if isinstance(placement, Shard):
                    return p.device_mesh.get_group(mesh_dim)
    return None


def agree_on_settings(
    name: str,
    module: nn.Module,
    make: Callable[[], Any],
    keys: tuple[str, ...],
    missing: str | None,
) -> None:
    """An installer's check of its settings, on this rank and then across ranks
    (``fn.collectives.agreement.agree`` over ``module``'s FSDP2 shard group, on its device; the
    world where no parameter is sharded).

    Args:
        name: the installer, which starts every message.
        module: the model it installs on.
        make: builds the object that checks the settings (raising ``TypeError`` or
            ``ValueError``); its attributes ``keys`` are the settings the ranks compare.
        keys: those attributes' names.
        missing: what is wrong with ``module`` itself (no FSDP2 module, say), or ``None``.

    Raises:
        TypeError, ValueError: as ``agree``, on every rank.
    """
    problem, settings = None, dict.fromkeys(keys)
    try:
        checked = make()
        settings = {key: getattr(checked, key) for key in keys}
        if missing is not None:
            raise ValueError(missing)
    except (TypeError, ValueError) as error:
        problem = problem_of(error)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if not dist.is_initialized():  # one process: its own refusal only
        agree(Local(), name, settings, problem)
        return
    group = shard_group(module)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    agree(ProcessGroup(group), name, settings, problem, ranks=ranks, device=device)
