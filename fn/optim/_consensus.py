"""Decisions the ranks of the ``torch.optim`` adapter take together.

Every rank must issue the same collectives in the same order, so what decides them is agreed on
by all ranks, never read from one rank's local data alone:

- :func:`check_same_params`: when a group is built, the ranks compare their params (number,
  shapes, dtypes), which size the flat buffers and every collective over them.
- :func:`count_nonfinite`: before each step, the ranks vote on skipping it.
"""

from __future__ import annotations

from typing import Any

import torch

from fn._validation import all_finite


def _describe(p: torch.Tensor) -> str:
    return f"shape {tuple(p.shape)} ({p.dtype})"


def _all_gather_text(comm: Any, text: str, device: torch.device) -> list[str]:
    """Every rank's ``text`` (two small all_gathers: the lengths, then the padded UTF-8 bytes)."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    lengths = comm.all_gather(torch.tensor([data.numel()], device=device)).view(-1).tolist()
    width = max(lengths)
    if width == 0:
        return [""] * len(lengths)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = comm.all_gather(padded.to(device)).cpu()  # [W, width]
    return [bytes(row[:n].tolist()).decode() for row, n in zip(rows, lengths, strict=True)]


def check_same_params(comm: Any, index: int, params: list[torch.Tensor]) -> None:
    """Raises the same ``ValueError`` on every rank if the ranks' params of group ``index``
    differ in number, shape or dtype.

    Each rank describes its params (one line per param: shape and dtype) and the ranks gather
    these descriptions; nothing is exchanged with one rank.

    Args:
        comm: the communicator.
        index: the group's index (for the message).
        params: this rank's params of the group.

    Raises:
        ValueError: on every rank, naming the first param (or the param count) that differs.
    """
    if comm.world_size == 1:
        return
    # on the params' device, like all of the optimizer's traffic (NCCL takes only GPU tensors)
    device = params[0].device if params else torch.device("cpu")
    text = "\n".join(_describe(p) for p in params)
    described = [t.splitlines() for t in _all_gather_text(comm, text, device)]
    ours = described[0]
    for rank, theirs in enumerate(described):
        if len(theirs) != len(ours):
            raise ValueError(
                f"fn.optim: param group {index} has {len(ours)} trainable params on rank 0 "
                f"but {len(theirs)} on rank {rank}; every rank must build the optimizer "
                "over the same model"
            )
    for i, first in enumerate(ours):
        for rank, theirs in enumerate(described):
            if theirs[i] != first:
                raise ValueError(
                    f"fn.optim: param group {index}, param {i} differs across ranks: "
                    f"{first} on rank 0 but {theirs[i]} on rank {rank}"
                )


def count_nonfinite(comm: Any, grads: list[torch.Tensor], found_inf: torch.Tensor | None) -> int:
    """The number of non-finite gradient elements summed over all ranks (one 1-element
    allreduce), plus one per rank whose ``GradScaler`` found an overflow.

    Args:
        comm: the communicator.
        grads: this rank's gradients.
        found_inf: this rank's ``GradScaler`` overflow flag, or ``None`` without a scaler.

    Returns:
        The same count on every rank: zero exactly when every rank may step.
    """
    device = grads[0].device if grads else torch.device("cpu")
    count = torch.zeros((), dtype=torch.int64, device=device)
    for g in grads:
        if not all_finite(g):  # one reduction in the common case; the exact count only here
            count = count + (~torch.isfinite(g)).sum().to(device)
    if found_inf is not None:
        count = count + (found_inf.to(device) > 0).to(torch.int64)
    if comm.world_size > 1:
        count = comm.all_reduce(count, op="sum")
    return int(count)
