"""The mean over the ranks sent in a chosen float dtype and summed in rank order.

A ring allreduce adds the ranks' values in an order that depends on the backend and the chunk,
and sums half-precision values in half precision. ``cast_allreduce`` instead sends every value
once in ``dtype`` to the rank that owns its chunk (all_to_all), adds the ``W`` pieces there in
fp32, left to right in rank order (``fn.kernels.sum_ranks``), and all-gathers the mean rounded
to ``dtype``: the same bytes as a ring allreduce in ``dtype``, and the bits of a plain loop over
the ranks on every backend (docs/algorithms.md, "DiLoCo: local steps and a compressed outer
step").
"""

from __future__ import annotations

import torch

from fn import kernels
from fn.base import EmptyState
from fn.collectives import _sizes
from fn.collectives.comm import Comm
from fn.collectives.header import (
    HEADER_BYTES,
    Compressor,
    Exchanged,
    exchange_rows,
    flag_of,
    gathered,
    headers_only,
)
from fn.collectives.participation import participants_mean, sent
from fn.tree import tree_flatten, tree_unflatten

__all__ = ["CAST_DTYPES", "cast_allreduce", "cast_exchange_form"]

CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes :func:`cast_allreduce` sends, fp32 (the exact mean in rank order), bf16 and fp16.

Example:
    >>> torch.bfloat16 in fn.collectives.CAST_DTYPES
    True
"""

_WHAT = "cast_allreduce"


def cast_exchange_form(n: int, itemsize: int, world_size: int) -> str:
    """The form of :func:`cast_allreduce`'s ``exchange``: ``"gather"`` (one all-gather of every
    rank's values, each rank sums them all) where it sends no more bytes per rank than
    ``"owner"`` (the all_to_all to the owners of the chunks, then the all-gather of their
    means), else ``"owner"``. With ``H`` = ``HEADER_BYTES``, ``s`` = ``itemsize`` and ``N_W`` =
    ``n`` rounded up to a multiple of ``W``, per rank:

    .. math::
        \\text{gather: } (W - 1)(H + s n), \\qquad
        \\text{owner: } (W - 1)(H + s N_W / W) + (W - 1)\\, s N_W / W,

    so ``"gather"`` (one collective instead of two) at ``W = 2``, ``"owner"`` from ``W = 3`` on
    but for a few values. Both give the same bits.

    Args:
        n: the values exchanged.
        itemsize: the bytes of one value in the message (4 for fp32, 2 for bf16).
        world_size: ``W``, the ranks.

    Returns:
        ``"gather"`` or ``"owner"``.

    Example:
        >>> from fn.collectives import cast_exchange_form
        >>> [cast_exchange_form(1000, 4, w) for w in (2, 3, 8)]
        ['gather', 'owner', 'owner']
    """
    share = -(-n // world_size) * itemsize
    gather = HEADER_BYTES + itemsize * n
    return "gather" if gather <= HEADER_BYTES + 2 * share else "owner"


def cast_allreduce(dtype: torch.dtype = torch.float32, *, comm: Comm) -> Compressor:
    """Replaces every update leaf by the mean over the ranks of its values rounded to ``dtype``.

    .. math::
        u \\leftarrow \\operatorname{round}_\\text{dtype}\\Big(\\frac{1}{W}
        \\big(((0 + x_0) + x_1) + \\dots + x_{W-1}\\big)\\Big),
        \\qquad x_i = \\operatorname{round}_\\text{dtype}(u_i)

    with the sums in fp32, left to right in rank order, the same bits on every rank and every
    backend. The live leaves (not ``None``, not empty) travel as one vector of ``n`` values,
    zero-padded to a multiple of ``W``: first a 12-byte size record to every rank (``n`` and a
    checksum of the leaves' sizes, checked on every rank), then an all_to_all of the chunks and
    an all_gather of the means, ``2 (W - 1) / W`` of the padded vector in ``dtype``. Each result
    has its leaf's shape and dtype. Stateless. With ``W == 1`` the updates pass through
    unchanged. Non-finite values propagate into the mean.

    ``update(..., participation=fn.collectives.Participation(takes_part, n))``: a rank that
    sits out sends zeros (its input is not read) and the sums are divided by ``n``, the mean
    over the participants (``fn.collectives.participants_mean``).

    Args:
        dtype: what the values travel as, one of :data:`CAST_DTYPES`.
        comm: the communicator.

    ``exchange(updates, state, flag)`` (:class:`~fn.collectives.Compressor`) gives the same
    bits with this rank's flag and the size record in a header in front of its values, no
    collective of their own: the all_to_all and the all-gather, or, where that sends no more
    bytes (``W = 2``), one all-gather of every rank's values, every rank adding all ``W`` in
    rank order (:func:`cast_exchange_form`). A rank whose flag is ``False`` (or whose values
    are not finite in ``dtype``) sends zeros.

    Returns:
        A :class:`~fn.collectives.Compressor` with an ``EmptyState``.

    Raises:
        ValueError: for a ``dtype`` outside :data:`CAST_DTYPES`; from ``update``, on every rank
            and before any value is sent, if the ranks' live leaves differ in number or size.
        TypeError: from ``update``, for a leaf that is not floating point.

    Example:
        >>> from fn.collectives import Simulated, cast_allreduce, simulate
        >>> comm = Simulated(2)
        >>> tx = cast_allreduce(torch.bfloat16, comm=comm)
        >>> grads = {"w": torch.tensor([[1.0, 1 / 3], [2.0, 1 / 3]])}  # row r: rank r's values
        >>> updates, _ = simulate(tx.update, comm)(grads, tx.init(grads))
        >>> updates["w"][0]  # 1/3 in bf16 is 0.333984375
        tensor([1.5000, 0.3340])
        >>> comm.bytes_sent  # a 12-byte record to the peer, then 2 (W - 1) / W of 2 bf16 values
        16
    """
    if dtype not in CAST_DTYPES:
        allowed = ", ".join(str(d) for d in CAST_DTYPES)
        raise ValueError(f"{_WHAT}: dtype must be one of {allowed}, got {dtype!r}")

    def update_fn(updates, state, params=None, *, participation=None, **extra):
        del params, extra
        world_size = comm.world_size
        leaves, spec, live = _live(updates)
        if world_size == 1 or not live:
            return updates, state
        flat = torch.cat([sent(leaves[i], participation).reshape(-1).to(dtype) for i in live])
        n = flat.numel()
        layout = [(i, leaves[i].numel()) for i in live] + [(-1, flat.element_size())]
        checksum = _sizes.layout_checksum(layout)
        records = _sizes.with_count(flat.new_empty(world_size, 0, dtype=torch.float32), n, checksum)
        flat = _sizes.released(flat, comm.all_to_all(records), n, _WHAT, checksum)
        padded = torch.nn.functional.pad(flat, (0, -n % world_size))
        pieces = comm.all_to_all(padded.view(world_size, -1))  # row i: rank i's copy of my chunk
        total = kernels.sum_ranks(pieces.float())
        shard = participants_mean(total, world_size, participation).to(dtype)
        return _unflattened(comm.all_gather(shard).reshape(-1)[:n], leaves, spec, live), state

    def exchange_fn(updates, state, flag=None, params=None, *, extra=()):
        del params
        world_size = comm.world_size
        leaves, spec, live = _live(updates)
        if not live:
            return headers_only(comm, updates, state, flag, _WHAT, extra)
        flat = torch.cat([leaves[i].reshape(-1).to(dtype) for i in live])
        flag = flag_of(flag) & torch.isfinite(flat).all()
        if world_size == 1:
            values = torch.tensor([list(extra)], dtype=torch.int64)
            return Exchanged(updates, state, flag.reshape(1), values)
        n, size = flat.numel(), flat.element_size()
        owner = cast_exchange_form(n, size, world_size) == "owner"
        layout = [(i, leaves[i].numel()) for i in live] + [(-1, size), (-3, owner)]
        checksum = _sizes.layout_checksum(layout)
        flat = torch.where(flag, flat, 0).to(dtype)
        sent = torch.nn.functional.pad(flat, (0, -n % world_size)) if owner else flat
        payload = sent.view(world_size if owner else 1, -1).view(torch.uint8)
        got, part = exchange_rows(
            comm, payload, flag, n, _WHAT, checksum, to_each=owner, extra=extra
        )
        # the received rows as fp32 [W, values], each value rounded to dtype
        values = got.payload.clone(memory_format=torch.contiguous_format).view(dtype).float()
        total = kernels.sum_ranks(values)
        mean = participants_mean(total, world_size, part).to(dtype)
        if owner:
            mean = gathered(comm, mean).reshape(-1)[:n]
        return Exchanged(_unflattened(mean, leaves, spec, live), state, got.flags, got.extra)

    return Compressor(lambda params: EmptyState(), update_fn, exchange_fn)


def _live(updates) -> tuple[list, object, list[int]]:
    """The leaves, their spec and the positions of the floating-point leaves that communicate
    (not ``None``, not empty)."""
    leaves, spec = tree_flatten(updates)
    live = [i for i, u in enumerate(leaves) if u is not None and u.numel() > 0]
    for i in live:
        if not leaves[i].is_floating_point():
            raise TypeError(f"{_WHAT} needs floating-point leaves, got {leaves[i].dtype}")
    return leaves, spec, live


def _unflattened(mean: torch.Tensor, leaves: list, spec, live: list[int]):
    """``mean`` (the live leaves' values, one after the other) back into the tree, each leaf
    in its shape and dtype."""
    leaves, offset = list(leaves), 0
    for i in live:
        numel = leaves[i].numel()
        leaves[i] = mean[offset : offset + numel].view(leaves[i].shape).to(leaves[i].dtype)
        offset += numel
    return tree_unflatten(leaves, spec)
