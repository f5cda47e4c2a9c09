"""The ``Comm`` protocol every communication backend implements, and the single-process backend.

A ``Comm`` is handed to a transform when it is built (like optax's ``axis_name``); the transform
calls its collectives on each rank's local tensors. Results are new tensors (out of place).
Every backend counts the bytes each rank sends and receives with the formulas in
``fn.collectives._traffic``.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch

from fn.collectives import _traffic

__all__ = ["Comm", "Local", "ReduceOp", "HOPS"]

ReduceOp = Literal["mean", "sum"]

# The levels of a two-level topology (``Comm.split``), in the order of their codes 0, 1, 2: the
# whole group, inside a node, across nodes.
HOPS = ("world", "intra", "inter")


@runtime_checkable
class Comm(Protocol):
    """A group of ``world_size`` ranks and the collectives between them.

    Shapes are per rank. ``W`` is ``world_size``.

    - ``all_reduce(x, op)``: ``op`` ("mean" or "sum") of ``x`` over the ranks, same shape.
    - ``all_gather(x)``: ``[W, *x.shape]``, row ``i`` is rank ``i``'s ``x``.
    - ``all_to_all(x)``: ``x`` is ``[W, *chunk]``; ``out[i]`` is rank ``i``'s ``x[my_rank]``.
    - ``reduce_scatter(x, op)``: ``x`` is ``[W, *chunk]``; returns ``op`` over the ranks of
      their ``x[my_rank]``, shape ``chunk``.
    - ``bytes_sent``: cumulative bytes this rank has sent; ``reset_bytes_sent()`` zeroes it and
      returns the old count.
    - ``split(L)``: ``(intra, inter)`` comms for a two-level topology of ``W / L`` nodes with
      ``L`` ranks each (rank ``node * L + local``): ``intra`` spans this rank's node, ``inter``
      the ranks with this rank's local index. Their traffic counts into this comm.

    fn's comms (``Local``, ``Simulated``, ``ProcessGroup``) also break ``bytes_sent`` down by
    level: ``bytes_sent_by_hop`` is ``{"world": ..., "intra": ..., "inter": ...}``, the bytes
    sent by collectives of the whole group, of its ``intra`` split (inside a node) and of its
    ``inter`` split (across nodes); and they count what each rank receives the same way
    (``bytes_received``, ``bytes_received_by_hop``, ``reset_bytes_received()``: a collective
    receives what it sends, a point-to-point receive its message). Other comms need not.

    Example:
        >>> from fn.collectives import Comm, Local, Simulated
        >>> isinstance(Local(), Comm), isinstance(Simulated(4), Comm)
        (True, True)
    """

    @property
    def world_size(self) -> int: ...

    @property
    def bytes_sent(self) -> int: ...

    def reset_bytes_sent(self) -> int: ...

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor: ...

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor: ...

    def split(self, local_world_size: int) -> tuple[Comm, Comm]: ...


class ByteCounter:
    """Byte bookkeeping shared by the backends (a mutable counter, the only state of a comm).

    A sub-group comm (from ``split``) counts into its parent's counter, under its level
    (``hop``, an index into :data:`HOPS`).
    """

    def __init__(self, counts_into: ByteCounter | None = None, hop: int = 0) -> None:
        # Tensors updated in place, not Python ints: torch.compile guards an int it reads by
        # value (a recompile for every new count, eager fall-back with dynamic=False), while an
        # in-place add on a tensor is traced into the graph and runs at every call. Row 0: the
        # bytes sent, row 1: the bytes received; one column per level.
        self._bytes_by_hop = torch.zeros(2, len(HOPS), dtype=torch.int64)
        self._counter = self if counts_into is None else counts_into._counter
        self._hop = hop

    @property
    def bytes_sent(self) -> int:
        return int(self._counter._bytes_by_hop[0].sum())

    @property
    def bytes_sent_by_hop(self) -> dict[str, int]:
        """The ``bytes_sent`` by level, ``{"world": ..., "intra": ..., "inter": ...}``."""
        return dict(zip(HOPS, self._counter._bytes_by_hop[0].tolist(), strict=True))

    @property
    def bytes_received(self) -> int:
        """The bytes this rank has received; a collective's are what it sends, a
        point-to-point receive's its message."""
        return int(self._counter._bytes_by_hop[1].sum())

    @property
    def bytes_received_by_hop(self) -> dict[str, int]:
        """The ``bytes_received`` by level, ``{"world": ..., "intra": ..., "inter": ...}``."""
        return dict(zip(HOPS, self._counter._bytes_by_hop[1].tolist(), strict=True))

    def reset_bytes_sent(self) -> int:
        """Zeroes the count of bytes sent (every level) and returns the count it had."""
        old = self.bytes_sent
        self._counter._bytes_by_hop[0].zero_()
        return old

    def reset_bytes_received(self) -> int:
        """Zeroes the count of bytes received (every level) and returns the count it had."""
        old = self.bytes_received
        self._counter._bytes_by_hop[1].zero_()
        return old

    def _count(self, kind: str, x: torch.Tensor) -> None:
        """Counts what this rank sends and receives in a ``kind`` collective (or ``send``,
        ``recv``) of its ``x`` over this comm."""
        nbytes, size = x.numel() * x.element_size(), self.world_size
        counts = self._counter._bytes_by_hop
        sent = getattr(_traffic, f"{kind}_bytes")(nbytes, size)
        counts[0, self._hop].add_(sent)
        counts[1, self._hop].add_(_traffic.received_bytes(kind, nbytes, sent))


def check_split(world_size: int, local_world_size: int) -> None:
    if (
        isinstance(local_world_size, bool)
        or not isinstance(local_world_size, int)
        or local_world_size < 1
    ):
        raise ValueError(f"local_world_size must be a positive int, got {local_world_size!r}")
    if world_size % local_world_size:
        raise ValueError(
            f"local_world_size={local_world_size} does not divide world_size={world_size}"
        )


def check_op(op: str) -> None:
    if op not in ("mean", "sum"):
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")


def check_chunked(x: torch.Tensor, world_size: int, name: str) -> None:
    if x.dim() == 0 or x.shape[0] != world_size:
        raise ValueError(
            f"{name} takes a [world_size={world_size}, *chunk] tensor, got shape {tuple(x.shape)}"
        )


class Local(ByteCounter):
    """Local()

    World size 1: every collective returns its input's value; nothing is sent.

    Example:
        >>> comm = fn.collectives.Local()
        >>> comm.all_reduce(torch.tensor([1.0, 2.0])), comm.all_gather(torch.tensor([1.0]))
        (tensor([1., 2.]), tensor([[1.]]))
        >>> comm.bytes_sent
        0
    """

    @property
    def world_size(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "Local()"

    def split(self, local_world_size: int) -> tuple[Local, Local]:
        """``(intra, inter)`` groups of one rank: both are this comm."""
        check_split(1, local_world_size)
        return self, self

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        check_op(op)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        check_chunked(x, 1, "all_to_all")
        return x

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        check_op(op)
        check_chunked(x, 1, "reduce_scatter")
        return x[0]
