"""Per-rank wire traffic of each collective, the formulas every backend counts with.

For a payload of ``b`` bytes on each of ``W`` ranks (bandwidth-optimal ring/pairwise algorithms),
what one rank sends:

- ``all_reduce``: ``2 (W - 1) / W * b`` (ring: reduce-scatter then all-gather),
- ``all_gather``: ``(W - 1) * b``, i.e. ``(W - 1) / W`` of the ``W * b`` byte output,
- ``all_to_all``: ``(W - 1) / W * b`` of the ``b`` byte input (every chunk but one's own),
- ``reduce_scatter``: ``(W - 1) / W * b`` of the ``b`` byte input,
- ``send`` (point to point): ``b``; ``recv``: nothing.

Every rank of a collective receives what it sends (the collectives are symmetric: each rank's
share of the ring, or one chunk from each peer); a point-to-point ``recv`` of ``b`` bytes
receives ``b``, a ``send`` nothing. Fractions are rounded up to whole bytes. ``W == 1`` sends
and receives nothing.
"""

from __future__ import annotations


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def all_reduce_bytes(nbytes: int, world_size: int) -> int:
    return _ceil_div(2 * (world_size - 1) * nbytes, world_size)


def all_gather_bytes(nbytes: int, world_size: int) -> int:
    return (world_size - 1) * nbytes


def all_to_all_bytes(nbytes: int, world_size: int) -> int:
    return _ceil_div((world_size - 1) * nbytes, world_size)


reduce_scatter_bytes = all_to_all_bytes  # (W - 1) / W of the input, as all_to_all


def send_bytes(nbytes: int, world_size: int) -> int:
    del world_size
    return nbytes


def recv_bytes(nbytes: int, world_size: int) -> int:
    del nbytes, world_size
    return 0


def received_bytes(kind: str, nbytes: int, sent: int) -> int:
    """What one rank receives in a ``kind`` collective (or ``send`` / ``recv``) of ``nbytes``
    per rank that sends ``sent`` bytes: a collective's sent bytes, a ``recv``'s ``nbytes``, a
    ``send``'s nothing."""
    return {"send": 0, "recv": nbytes}.get(kind, sent)
