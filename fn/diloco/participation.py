"""The workers' agreement on who takes part in an outer step: one all-gather of a small
fixed-size record per worker, its flag and the header of the exchange (where each worker is in
its schedule), so that every rank learns the same participants and a worker that reached
another exchange is the same error on every rank.

The interface is stable (``fn.diloco``'s elastic and sparse exchanges build on it). Where the
outer rule is a ``fn.collectives.Compressor`` the flag and the header travel in the header of
the compressor's own message instead (fn/diloco/step.py), with :func:`check_headers`'s check;
this all-gather serves the other rules (the 1-bit compressor's).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fn.collectives import Comm
from fn.tree import eager

__all__ = ["agree_on_participation", "check_headers"]


def agree_on_participation(
    comm: Comm,
    takes_part: torch.Tensor,
    *,
    within: Sequence[Comm] = (),
    header: Mapping[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which workers take part, agreed by every rank: a worker takes part where every one of its
    ranks says it does.

    This rank's flag is summed over each group of ``within`` in turn (the ranks inside a
    sharded worker: one fp32 value each), so that every rank of a worker holds the worker's
    flag; then one all-gather over ``comm`` of ``1 + len(header)`` int64 values per worker (the
    flag, then the header's values) gives every rank the same mask.

    Args:
        comm: the workers (one rank of each, at this shard position).
        takes_part: ``[]`` bool tensor, this rank's flag.
        within: the groups inside a sharded worker (none: one rank per worker).
        header: name -> value, what every worker must agree on about this exchange (e.g. the
            inner step it started after, the fragment, its size), the same names in the same
            order on every rank; ``None``: nothing.

    Returns:
        ``(participants, mine)``: ``[W]`` bool, the workers that take part, the same on every
        rank; ``[]`` bool, this rank's worker's flag.

    Raises:
        ValueError: on every rank, the same message, where the workers' headers differ, naming
            every worker's values (checked on concrete tensors; under ``Simulated`` the header
            is gathered but not compared).

    Example:
        >>> from fn.collectives import Simulated, simulate
        >>> from fn.diloco.participation import agree_on_participation
        >>> comm = Simulated(3)
        >>> flags = torch.tensor([True, False, True])
        >>> simulate(lambda f: agree_on_participation(comm, f)[0], comm)(flags)[0]
        tensor([ True, False,  True])
    """
    sitting = (~takes_part).to(torch.float32).reshape(1)
    for group in within:
        sitting = group.all_reduce(sitting, op="sum")
    mine = sitting[0] == 0
    values = list((header or {}).values())
    record = torch.cat(
        [mine.to(torch.int64).reshape(1), torch.tensor(values, dtype=torch.int64).to(mine.device)]
    )
    rows = comm.all_gather(record)  # [W, 1 + len(header)]
    if header and eager(rows):
        check_headers(list(header), rows[:, 1:].tolist())
    return rows[:, 0] == 1, mine


def check_headers(names: list[str], rows: list[list[int]]) -> None:
    """Raises, the same on every rank that read the same ``rows`` (one per worker, the values
    of ``names`` in order), unless every worker's are the same.

    Raises:
        ValueError: naming every worker's values.

    Example:
        >>> from fn.diloco.participation import check_headers
        >>> check_headers(["inner step"], [[30], [30]])
    """
    if all(row == rows[0] for row in rows):
        return
    workers = "; ".join(
        f"worker {w}: "
        + ", ".join(f"{name} {value}" for name, value in zip(names, row, strict=True))
        for w, row in enumerate(rows)
    )
    differ = {n for i, n in enumerate(names) if len({row[i] for row in rows}) > 1}
    if differ == {"settings"}:  # ElasticDiLoCo's checksum of its settings
        raise ValueError(
            f"DiLoCo: the workers are not at the same outer exchange ({workers}): they were "
            "built with other settings (sync_every, the outer rule, the compression and their "
            "options, buffers=, the parameters' shapes and dtypes); build every worker alike; "
            "nothing was changed"
        )
    raise ValueError(
        f"DiLoCo: the workers are not at the same outer exchange ({workers}). Every worker must "
        "start each exchange after the same inner steps, with the same trainable parameters and "
        "settings (the outer rule, the compression and their options): "
        "count an inner step the optimizer skipped with DiLoCo.count_inner_step(), or pass "
        "grad_scaler= to count a GradScaler's iterations (docs/troubleshooting.md, DiLoCo); "
        "nothing was changed"
    )
