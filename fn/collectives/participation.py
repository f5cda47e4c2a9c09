"""Which ranks take part in a mean: the ``participation=`` keyword of the compressed allreduces.

A collective that averages the ranks' inputs may be told that some ranks sit this call out
(``Participation``): a sitter's message is exactly zero, the mean divides by the number of
participants ``n`` instead of ``W``, and the sitter's own error feedback is kept as it was
(its input, which may be non-finite, is never read). Every rank still runs every exchange, so
the collectives' sizes do not change. ``fn.diloco``'s outer step passes it to its compressor
(docs/algorithms.md, "DiLoCo: local steps and a compressed outer step", participation).

The interface is stable: ``fn.diloco``'s elastic and sparse exchanges build on it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fn.tree import tree_map

__all__ = ["Participation", "participants_mean", "sent", "kept"]


class Participation(NamedTuple):
    """The participation of one call of a compressed allreduce, on this rank.

    Attributes:
        takes_part: ``[]`` bool tensor: whether this rank's input is part of the mean.
        count: ``[]`` int64 tensor: ``n``, how many ranks take part, the same on every rank,
            from 1 to ``W`` (``n = 0`` is the caller's to skip: see ``fn.diloco.outer_update``).

    Example:
        >>> from fn.collectives import Participation, Simulated, cast_allreduce, simulate
        >>> comm = Simulated(3)
        >>> tx = cast_allreduce(comm=comm)
        >>> x = {"w": torch.tensor([[1.0], [float("nan")], [5.0]])}  # rank 1 sits out
        >>> takes_part = torch.tensor([True, False, True])
        >>> def mean(x, takes_part):
        ...     part = Participation(takes_part, torch.tensor(2))
        ...     return tx.update(x, tx.init(x), participation=part)[0]
        >>> simulate(mean, comm)(x, takes_part)["w"]  # (1 + 0 + 5) / 2 on every rank
        tensor([[3.],
                [3.],
                [3.]])
    """

    takes_part: torch.Tensor
    count: torch.Tensor


def participants_mean(
    total: torch.Tensor, world_size: int, participation: Participation | None
) -> torch.Tensor:
    """``total / W``, or with ``participation``, ``total / n``.

    Where every rank takes part (``n == W``) the division is ``total / W`` itself, the bits of
    the call without ``participation`` on every device (a GPU divides by a host scalar as a
    multiplication by its reciprocal).

    Args:
        total: the sum over the ranks.
        world_size: ``W``.
        participation: the call's, or ``None`` (every rank).

    Returns:
        The mean.

    Example:
        >>> from fn.collectives import Participation, participants_mean
        >>> part = Participation(torch.tensor(True), torch.tensor(2))
        >>> participants_mean(torch.tensor([6.0]), 3, part)
        tensor([3.])
    """
    if participation is None:
        return total / world_size
    count = participation.count.to(total.device)
    return torch.where(count == world_size, total / world_size, total / count.clamp(min=1))


def sent(x: Any, participation: Participation | None) -> Any:
    """``x`` (a tensor or a pytree of tensors) where this rank takes part, zeros where it sits
    out: what a sitter's input is replaced by before anything is computed from it.

    Example:
        >>> from fn.collectives import Participation
        >>> from fn.collectives.participation import sent
        >>> sent(torch.tensor([float("nan")]), Participation(torch.tensor(False), torch.tensor(1)))
        tensor([0.])
    """
    if participation is None:
        return x
    return tree_map(lambda t: torch.where(participation.takes_part, t, 0), x)


def kept(new: Any, old: Any, participation: Participation | None) -> Any:
    """``new`` where this rank takes part, ``old`` where it sits out, leaf by leaf (the bits of
    the one chosen): a sitter's error feedback.

    Example:
        >>> from fn.collectives import Participation
        >>> from fn.collectives.participation import kept
        >>> sitter = Participation(torch.tensor(False), torch.tensor(1))
        >>> kept(torch.tensor([2.0]), torch.tensor([1.0]), sitter)
        tensor([1.])
    """
    if participation is None:
        return new
    return tree_map(lambda a, b: torch.where(participation.takes_part, a, b), new, old)
