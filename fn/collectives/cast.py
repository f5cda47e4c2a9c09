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
from fn.base import EmptyState, GradientTransformation
from fn.collectives import _sizes
from fn.collectives.comm import Comm
from fn.collectives.participation import participants_mean, sent
from fn.tree import tree_flatten, tree_unflatten

__all__ = ["CAST_DTYPES", "cast_allreduce"]

CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes :func:`cast_allreduce` sends, fp32 (the exact mean in rank order), bf16 and fp16.

Example:
    >>> torch.bfloat16 in fn.collectives.CAST_DTYPES
    True
"""

_WHAT = "cast_allreduce"


def cast_allreduce(dtype: torch.dtype = torch.float32, *, comm: Comm) -> GradientTransformation:
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

    Returns:
        A GradientTransformation with an ``EmptyState``.

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

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, participation=None, **extra):
        del params, extra
        world_size = comm.world_size
        leaves, spec = tree_flatten(updates)
        live = [i for i, u in enumerate(leaves) if u is not None and u.numel() > 0]
        if world_size == 1 or not live:
            return updates, state
        for i in live:
            if not leaves[i].is_floating_point():
                raise TypeError(f"{_WHAT} needs floating-point leaves, got {leaves[i].dtype}")
        flat = torch.cat([sent(leaves[i], participation).reshape(-1).to(dtype) for i in live])
        n = flat.numel()
        checksum = _sizes.layout_checksum((i, leaves[i].numel()) for i in live)
        records = _sizes.with_count(flat.new_empty(world_size, 0, dtype=torch.float32), n, checksum)
        flat = _sizes.released(flat, comm.all_to_all(records), n, _WHAT, checksum)
        padded = torch.nn.functional.pad(flat, (0, -n % world_size))
        pieces = comm.all_to_all(padded.view(world_size, -1))  # row i: rank i's copy of my chunk
        total = kernels.sum_ranks(pieces.float())
        shard = participants_mean(total, world_size, participation).to(dtype)
        mean = comm.all_gather(shard).reshape(-1)[:n]
        offset = 0
        for i in live:
            numel = leaves[i].numel()
            leaves[i] = mean[offset : offset + numel].view(leaves[i].shape).to(leaves[i].dtype)
            offset += numel
        return tree_unflatten(leaves, spec), state

    return GradientTransformation(init_fn, update_fn)
