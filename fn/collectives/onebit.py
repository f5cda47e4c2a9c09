"""Error-compensated 1-bit allreduce (DeepSpeed's compressed allreduce) and its transform.

References:
    Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed", ICML 2021 (arXiv:2102.02888), Algorithm 1's compressed allreduce.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from fn import kernels
from fn.base import donated_state
from fn.collectives import _sizes
from fn.collectives._fusion_barrier import fusion_barrier
from fn.collectives.comm import Comm, check_split
from fn.collectives.error_feedback import ErrorFeedback, ErrorFeedbackField
from fn.collectives.header import (
    Compressor,
    Exchanged,
    Opened,
    alone,
    exchange_rows,
    flag_of,
    gathered,
    headers_only,
)
from fn.collectives.participation import Participation, kept, participants_mean, sent
from fn.errors import NonFiniteError, check_int, finite_or_raise
from fn.tree import donated_leaves, eager, fitting, live_leaves, tree_map, tree_unflatten

__all__ = [
    "padded_numel",
    "ERROR_DTYPES",
    "check_error_dtype",
    "init_error_feedback",
    "compressed_allreduce",
    "PackedSigns",
    "CompressedExchange",
    "compressed_allreduce_exchange",
    "write_errors",
    "write_result",
    "OnebitAllreduceState",
    "onebit_allreduce",
]


def padded_numel(numel: int, world_size: int, local_world_size: int | None = None) -> int:
    """How many elements a :func:`compressed_allreduce` of ``numel`` elements works on.

    Flat (``local_world_size`` ``None`` or 1): ``numel`` rounded up to a multiple of
    ``W * lcm(W, 8)``. Every rank's chunk of ``N / W`` signs is then a whole number of bytes,
    and split again into ``W`` byte-aligned pieces.

    Hierarchical (``L = local_world_size``): ``L`` shards, each of ``padded_numel(ceil(numel /
    L), W / L)`` elements, the flat padding of one shard among the ``W / L`` nodes.

    Args:
        numel: the number of elements allreduced.
        world_size: ``W``.
        local_world_size: ranks per node ``L`` (it must divide ``W``), or ``None`` for flat.

    Returns:
        The padded element count ``N``.

    Raises:
        ValueError: ``numel`` is no int >= 0, ``world_size`` no int >= 1, or
            ``local_world_size`` does not divide it.

    Example:
        >>> from fn.collectives import padded_numel
        >>> padded_numel(10, 2), padded_numel(10, 3), padded_numel(32, 4)
        (16, 72, 32)
        >>> padded_numel(100, 4, local_world_size=2)  # 2 shards of padded_numel(50, 2) = 64
        128
    """
    check_int("numel", numel)
    check_int("world_size", world_size, minimum=1)
    if local_world_size is not None:
        check_split(world_size, local_world_size)
        nodes = world_size // local_world_size
        return local_world_size * padded_numel(-(-numel // local_world_size), nodes)
    unit = world_size * math.lcm(world_size, 8)
    return -(-numel // unit) * unit


def init_error_feedback(
    numel: int,
    *,
    comm: Comm,
    local_world_size: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> ErrorFeedback:
    """Zero error-feedback buffers for a ``numel``-element :func:`compressed_allreduce`.

    Args:
        numel: the number of elements that will be allreduced.
        comm: the communicator (its world size fixes the padding).
        local_world_size: ranks per node ``L`` for the hierarchical collective, or ``None``.
        device: where the buffers live.
        dtype: their storage, one of :data:`ERROR_DTYPES` (fp32, DeepSpeed's, by default).

    Returns:
        ``ErrorFeedback(worker [N / L], server [N / W])`` with ``N = padded_numel(numel,
        W, L)`` and ``L = 1`` when flat (a NamedTuple: ``worker_error, server_error =
        init_error_feedback(...)`` works). Hierarchical, the worker error covers this rank's
        shard of its node's mean: ``L`` times smaller than flat.

    Example:
        >>> from fn.collectives import Simulated, init_error_feedback
        >>> worker, server = init_error_feedback(10, comm=Simulated(2))
        >>> worker.shape, server.shape
        (torch.Size([16]), torch.Size([8]))
        >>> worker, server = init_error_feedback(100, comm=Simulated(4), local_world_size=2)
        >>> worker.shape, server.shape
        (torch.Size([64]), torch.Size([32]))
    """
    check_error_dtype("init_error_feedback", dtype)
    sizes = _error_numels(numel, comm.world_size, local_world_size)
    return ErrorFeedback(*(torch.zeros(k, dtype=dtype, device=device) for k in sizes))


def _error_numels(n: int, world_size: int, local_world_size: int | None) -> tuple[int, int]:
    """The sizes of the worker and the server error of a call of ``n`` elements."""
    n_padded = padded_numel(n, world_size, local_world_size)
    return n_padded // (local_world_size or 1), n_padded // world_size


# The storage dtypes of the 1-bit allreduce's error feedback: it always computes in fp32.
ERROR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes that 1-bit error feedback may be stored in (``error_dtype=`` of the 1-bit
family and :func:`init_error_feedback`). fp32 is DeepSpeed's and the default; bf16 and fp16
halve the buffers' memory.

Example:
    >>> torch.bfloat16 in fn.collectives.ERROR_DTYPES
    True
"""


def check_error_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """Checks the storage dtype of 1-bit error feedback (``error_dtype=`` of the 1-bit family).

    Args:
        name: who asks, for the message.
        dtype: the dtype to check.

    Returns:
        ``dtype``, if it is one of :data:`ERROR_DTYPES` (fp32, bf16, fp16).

    Raises:
        ValueError: naming ``name``, for any other value.

    Example:
        >>> from fn.collectives import check_error_dtype
        >>> check_error_dtype("opt", torch.bfloat16)
        torch.bfloat16
    """
    if dtype not in ERROR_DTYPES:
        allowed = ", ".join(str(d) for d in ERROR_DTYPES)
        raise ValueError(f"{name}: error_dtype must be one of {allowed}, got {dtype!r}")
    return dtype


class PackedSigns(NamedTuple):
    """A vector kept as one bit per element and one fp32 scale per chunk: the form of the 1-bit
    allreduce's result (``compressed_allreduce(..., packed=True)``).

    With ``R`` rows of ``chunk`` signs, value ``i`` is ``scales[i // chunk] * s_i`` with
    ``s_i = +1`` where bit ``i`` is set (MSB first, as ``fn.kernels.packbits``) and ``-1``
    where it is not; a vector of ``n <= R * chunk`` elements is the first ``n`` values. It holds
    ``n / 8`` bytes and ``4 R`` where the vector itself takes ``4 n``.

    Attributes:
        packed: uint8 ``[R, chunk / 8]``, the signs.
        scales: fp32 ``[R]``, one scale per chunk.

    Example:
        >>> from fn.collectives import PackedSigns
        >>> signs = PackedSigns(
        ...     torch.tensor([[0b10000000], [0b01000000]], dtype=torch.uint8),
        ...     torch.tensor([1.0, 2.0]),
        ... )
        >>> signs.unpacked(torch.empty(10))
        tensor([ 1., -1., -1., -1., -1., -1., -1., -1., -2.,  2.])
    """

    packed: torch.Tensor
    scales: torch.Tensor

    def values(self, numel: int) -> torch.Tensor:
        """The first ``numel`` values, 1-D fp32 (a view of a fresh padded tensor).

        Args:
            numel: how many values, at most ``R * chunk``.

        Returns:
            The values.
        """
        rows = self.scales.numel()
        n_padded = self.packed.numel() * 8
        y = kernels.unpackbits(self.packed.reshape(-1), n_padded).view(rows, n_padded // rows)
        y = y.mul_(self.scales.reshape(rows, 1)).reshape(-1)
        if torch.compiler.is_compiling():
            y = fusion_barrier(y)
        return y[:numel]

    def unpacked(self, like: torch.Tensor) -> torch.Tensor:
        """The first ``like.numel()`` values in ``like``'s shape and dtype (fresh).

        Args:
            like: a tensor of the vector's shape and dtype.

        Returns:
            The values, a new tensor.
        """
        return self.values(like.numel()).view(like.shape).to(like.dtype)


AllreduceOut = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def compressed_allreduce(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    *,
    comm: Comm,
    local_world_size: int | None = None,
    out: AllreduceOut | None = None,
    packed: bool = False,
    participation: Participation | None = None,
) -> tuple[torch.Tensor | PackedSigns, torch.Tensor, torch.Tensor]:
    """Error-compensated 1-bit allreduce: an estimate of the mean of ``x`` over the ranks.

    With ``n = x.numel()``, ``N = padded_numel(n, W)``, ``s(v) = +1 if v >= 0 else -1`` (so
    ``-0.0 -> +1``) and ``x`` flattened and zero-padded to ``N``:

    .. math::
        m_i &= x_i + e_{w,i}, \\quad a_i = \\lVert m_i \\rVert_2 / \\sqrt{N},
            \\quad e_{w,i}' = m_i - a_i s(m_i) \\\\
        c_r &= \\tfrac{1}{W} \\textstyle\\sum_i a_i s(m_i)[r] + e_{s,r}, \\quad
            b_r = \\lVert c_r \\rVert_2 / \\sqrt{N/W}, \\quad e_{s,r}' = c_r - b_r s(c_r) \\\\
        y &= \\mathrm{concat}_r\\, b_r s(c_r) \\text{ sliced to } n

    where ``[r]`` is the ``r``-th of ``W`` equal chunks, reduced by rank ``r`` (its server part).
    Wire: the packed signs (MSB first) go by all_to_all, the scales ``a_i`` by all_gather (with
    ``n`` next to them, 8 bytes, checked by every rank); the packed ``s(c_r)`` and ``b_r`` by
    all_gather. Every rank gets the same ``y``, bit for bit.

    Error feedback telescopes: ``y = mean_i(x_i + e_{w,i} - e_{w,i}') + E_s - E_s'`` with
    ``E_s = concat_r e_{s,r}``, so over T steps the sum of ``y`` is the sum of the means up to the
    initial minus the final errors.

    Hierarchical (``local_world_size=L``, ranks ``node * L + local`` as torchrun lays them out):
    a dense fp32 reduce-scatter inside each node, the 1-bit allreduce above of this rank's shard
    of its node's exact mean among the ``W / L`` ranks of its local index (the only traffic
    across nodes: ``1 / L`` of the flat collective's), and an all-gather of the packed results
    inside each node (docs/algorithms.md, "Hierarchical 1-bit allreduce"). With one node
    (``L = W``) ``y`` is the exact mean and the errors stay untouched; ``L = 1`` is the flat
    collective, bit for bit.

    Args:
        x: this rank's tensor (any shape, floating point).
        worker_error: fp32[N / L], this rank's worker error (``L = 1`` when flat).
        server_error: fp32[N / W], this rank's server error (for chunk ``rank``).
        comm: the communicator.
        local_world_size: ranks per node ``L`` (a divisor of ``W``) for the hierarchical
            collective, or ``None`` for flat. Every rank must pass the same value.
        out: optional output buffers ``(y, worker, server)`` (buffer donation), each ``None``
            (a fresh tensor) or a contiguous tensor to write: ``y`` of ``x``'s shape and dtype
            (it may be ``x`` itself), ``worker``/``server`` fp32 of the errors' shapes (they may
            be ``worker_error``/``server_error`` themselves). Eager calls then make no
            full-size temporary and write nothing before every rank's checks passed; under
            ``Simulated`` (vmap) and ``torch.compile`` the results are computed as without
            buffers and copied into them.
        packed: return ``y`` as the :class:`PackedSigns` it arrives as instead of unpacking
            it (``out``'s ``y`` must then be ``None``); where nothing is compressed (``W == 1``,
            ``n == 0``, one node) ``y`` stays a tensor.
        participation: which ranks take part (:class:`~fn.collectives.Participation`), or
            ``None`` (every rank): a rank that sits out sends worker scale ``a_i = 0`` (its
            ``x`` is not read) and keeps its worker error as it was; the server's sum weighs
            the scales by ``1 / n`` in place of ``1 / W`` (``participants_mean``), and every
            rank's server part (and server error) runs as usual. Flat only, on the reference
            path (``out`` is then filled by copies).

    The error buffers may also be bf16 or fp16 (:data:`ERROR_DTYPES`), computed in fp32 and
    rounded once (the in-place path takes fp32 only).

    Returns:
        ``(y, worker_error', server_error')``, the buffers of ``out`` where given; ``y`` has
        ``x``'s shape and dtype (or is a :class:`PackedSigns`, with ``packed``). With
        ``W == 1`` it is ``(x, worker_error, server_error)`` (nothing is written); with
        ``n == 0`` it is ``x`` and zeroed errors, without communication.

    Raises:
        ValueError: if the error or buffer shapes do not match or ``local_world_size`` does not
            divide ``W``, or (on every rank at once, before any sign is sent) if the ranks' ``x``
            differ in element count or ``local_world_size``, or some rank's ``x +
            worker_error`` is not finite. Nothing is changed.
        NotImplementedError: ``participation`` with ``local_world_size`` (hierarchical).

    Example:
        One call sends only signs and scales: every rank gets the same coarse estimate.

        >>> from fn.collectives import (
        ...     Simulated, compressed_allreduce, init_error_feedback, replicate, simulate)
        >>> comm = Simulated(2)
        >>> x = torch.tensor([[1.0, -2.0, 3.0, -4.0], [3.0, 2.0, 1.0, 0.0]])  # row r: rank r
        >>> x.mean(0)
        tensor([ 2.,  0.,  2., -2.])
        >>> car = simulate(lambda x, ew, es: compressed_allreduce(x, ew, es, comm=comm), comm)
        >>> worker, server = replicate(tuple(init_error_feedback(4, comm=comm)), comm)
        >>> y, worker, server = car(x, worker, server)
        >>> y
        tensor([[ 1.0039, -1.0039,  1.0039, -1.0039],
                [ 1.0039, -1.0039,  1.0039, -1.0039]])

        The error feedback carries what was lost into the next calls, so the average of the
        outputs over repeated calls approaches the true mean:

        >>> total = y
        >>> for _ in range(99):
        ...     y, worker, server = car(x, worker, server)
        ...     total = total + y
        >>> total[0] / 100
        tensor([ 1.9857,  0.0040,  1.9778, -1.9448])
    """
    world_size = comm.world_size
    n = x.numel()
    _check_errors(n, worker_error, server_error, world_size, local_world_size)
    if participation is not None and local_world_size not in (None, 1):
        raise NotImplementedError(
            "compressed_allreduce: participation= is built for the flat collective only "
            "(hierarchical, a node's dense mean would need its own participants)"
        )
    if out is not None:
        _check_out(out, x, worker_error, server_error)
        if packed and out[0] is not None:
            raise ValueError("compressed_allreduce: with packed=True, out's y must be None")
    if world_size == 1:
        return x, worker_error, server_error
    if n == 0:
        buffers = zip(out[1:] if out else (None, None), (worker_error, server_error), strict=True)
        return x, *(torch.zeros_like(e) if b is None else b.zero_() for b, e in buffers)
    if not x.is_floating_point():
        raise TypeError(f"compressed_allreduce needs a floating-point x, got {x.dtype}")
    if out is not None and participation is None and eager(x, worker_error, server_error, *out):
        errors = (worker_error, server_error)
        exchange = _exchange(x.reshape(-1), None, 0.0, *errors, comm, local_world_size)
        if exchange is not None:
            worker, server = write_errors(exchange, out[1], out[2])
            if packed:
                return PackedSigns(exchange.packed, exchange.scales), worker, server
            y = torch.empty_like(x) if out[0] is None else out[0]
            return write_result(exchange, y), worker, server
    dtype = worker_error.dtype
    errors = (worker_error.float(), server_error.float())
    if local_world_size not in (None, 1):
        y, worker, server = _pure_hierarchical(x, *errors, comm, local_world_size)
    else:
        flat = _padded_flat(sent(x, participation), worker_error.numel())
        signs, scales, worker, server = _pure_exchange(flat, n, *errors, comm, participation)
        y = PackedSigns(signs, scales)
    if isinstance(y, PackedSigns) and not packed:
        y = y.unpacked(x)
    pure = (y, worker.to(dtype), server.to(dtype))
    if out is None:
        return pure
    return tuple(r if b is None else b.copy_(r) for b, r in zip(out, pure, strict=True))


def _check_errors(
    n: int,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    world_size: int,
    local_world_size: int | None,
) -> None:
    if worker_error.dtype not in ERROR_DTYPES or server_error.dtype != worker_error.dtype:
        raise ValueError(
            "compressed_allreduce: the error buffers must share one of the dtypes "
            f"{ERROR_DTYPES}, got {worker_error.dtype} and {server_error.dtype}"
        )
    shapes = tuple((k,) for k in _error_numels(n, world_size, local_world_size))
    if (tuple(worker_error.shape), tuple(server_error.shape)) != shapes:
        level = "" if local_world_size is None else f" ({local_world_size} per node)"
        raise ValueError(
            f"compressed_allreduce of {n} elements over {world_size} ranks{level} needs errors "
            f"of shapes {shapes[0]} and {shapes[1]}, got {tuple(worker_error.shape)} and "
            f"{tuple(server_error.shape)} (see init_error_feedback)"
        )


def _padded_flat(x: torch.Tensor, n_padded: int) -> torch.Tensor:
    """``x`` flattened, in fp32, zero-padded to ``n_padded`` elements."""
    flat = x.reshape(-1).float()
    if n_padded > flat.numel():
        flat = torch.nn.functional.pad(flat, (0, n_padded - flat.numel()))
    return flat


def _worker_scales(comm: Comm, scale: torch.Tensor, n: int) -> torch.Tensor:
    """Every rank's worker scale, ``[W]``. The element count ``n`` travels with the scale:
    ranks with different sizes raise here, together, as they do for a non-finite scale. A
    negative "scale" is a hierarchical rank's first record (:func:`_agree`): the ranks differ in
    ``local_world_size``, and raise together (the hierarchical ones in :func:`_agree`)."""
    gathered = comm.all_gather(_sizes.with_count(scale.view(1), n))  # [W, 3]
    scales = _sizes.checked_scales(gathered, n, "compressed_allreduce").view(comm.world_size)
    if eager(scales) and bool((scales < 0).any()):
        raise _levels_differ(scales.tolist())
    return finite_or_raise(
        scales, "compressed_allreduce: non-finite values in x (or in the worker error)"
    )


def _pure_exchange(
    flat: torch.Tensor,
    n: int,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    comm: Comm,
    participation: Participation | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exchanges of the reference path for the padded ``flat`` of a call of ``n``
    elements: every rank's packed server signs ``[W, chunk / 8]`` and scales ``[W]``, and this
    rank's new errors. A rank that sits out (``participation``) sends scale 0 and keeps its
    worker error; the server weighs the scales by ``1 / n``."""
    world_size = comm.world_size
    # Non-finite values make the scale non-finite (or the kernel raise); the rank then sends a
    # NaN scale, every rank sees it after the scale all_gather and raises there, before any
    # sign is exchanged: no rank is left waiting and no error state is touched.
    try:
        packed, scale, new_worker_error = kernels.sign_compress(flat, worker_error)
    except NonFiniteError:
        packed, scale, new_worker_error = None, flat.new_full((), torch.nan), None
    if participation is not None:
        scale = torch.where(participation.takes_part, scale, 0.0)
        new_worker_error = kept(new_worker_error, worker_error, participation)
    scales = _worker_scales(comm, scale, n)

    received = comm.all_to_all(packed.view(world_size, -1))  # [W, chunk / 8]: chunk r of rank i
    server_m = _server_sum(received, scales, participation)  # [chunk]
    server_packed, server_scale, new_server_error = kernels.sign_compress(server_m, server_error)

    all_packed = comm.all_gather(server_packed)  # [W, chunk / 8]
    all_scales = comm.all_gather(server_scale)  # [W]
    return all_packed, all_scales, new_worker_error, new_server_error


def _server_sum(
    received: torch.Tensor, scales: torch.Tensor, participation: Participation | None
) -> torch.Tensor:
    """An owner's mean before its error feedback: the ``[W, chunk / 8]`` packed signs it
    received, each rank's times that rank's worker scale over the participants
    (``participants_mean``), summed in rank order; fp32 ``[chunk]``."""
    world_size, chunk = received.shape[0], received.shape[1] * 8
    # unpackbits returns fresh tensors: scaling them in place saves a full-size copy each.
    signs = kernels.unpackbits(received.reshape(-1), world_size * chunk).view(world_size, chunk)
    weights = participants_mean(scales, world_size, participation)  # [W]
    return kernels.sum_ranks(signs.mul_(weights[:, None]))


_NON_FINITE_SERVER = "compressed_allreduce: non-finite values in a server error"
_NON_FINITE_ON_SOME_RANK = (
    "compressed_allreduce: non-finite values in x or in an error-feedback buffer (on some rank)"
)


def _agree(comm: Comm, x: torch.Tensor, local_world_size: int) -> None:
    """The first exchange of a hierarchical call, over the whole group: every rank's element
    count and ``-local_world_size`` (12 bytes, the size of a flat call's first record, whose
    scale is never negative), so that ranks that disagree, flat ones included, raise together
    before any exchange whose size or group depends on them."""
    level = torch.full((1,), -float(local_world_size), device=x.device)
    gathered = comm.all_gather(_sizes.with_count(level, x.numel()))  # [W, 3]
    levels = _sizes.checked_scales(gathered, x.numel(), "compressed_allreduce").view(-1)
    if eager(levels) and bool((levels != -local_world_size).any()):
        raise _levels_differ(levels.tolist())


def _levels_differ(firsts: list[float]) -> ValueError:
    """The error of ranks whose first records (``-local_world_size``, or a flat call's scale,
    >= 0 or NaN) differ in ``local_world_size``."""
    shown = ", ".join(f"rank {i}: {int(-v) if v < 0 else None}" for i, v in enumerate(firsts))
    return ValueError(
        f"compressed_allreduce: the ranks passed different local_world_size ({shown}; None: "
        "flat); every rank must pass the same. Nothing was changed."
    )


def _node_mean(flat: torch.Tensor, intra: Comm) -> torch.Tensor:
    """This rank's shard of its node's mean of ``flat`` (``[L * S]``): the dense fp32
    reduce-scatter of step 1, its ``L`` pieces summed left to right in rank order."""
    local_world_size = intra.world_size
    pieces = intra.all_to_all(flat.view(local_world_size, -1))  # [L, S]: row i from local rank i
    return kernels.sum_ranks(pieces).div_(local_world_size)


def _pure_hierarchical(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    comm: Comm,
    local_world_size: int,
) -> tuple[torch.Tensor | PackedSigns, torch.Tensor, torch.Tensor]:
    """The reference path of the hierarchical collective (see :func:`compressed_allreduce`):
    the result as it arrives (the exact mean, as a tensor, with one node), and the new
    errors."""
    _agree(comm, x, local_world_size)  # before split, a collective over groups of that size
    intra, inter = comm.split(local_world_size)
    n_padded = local_world_size * worker_error.numel()
    mean = _node_mean(_padded_flat(x, n_padded), intra)
    if inter.world_size == 1:  # one node: the exact mean, gathered in fp32
        y = finite_or_raise(intra.all_gather(mean), _NON_FINITE_ON_SOME_RANK).reshape(-1)
        return y[: x.numel()].view(x.shape).to(x.dtype), worker_error, server_error
    failure = None
    try:
        packed, scales, worker, server = _pure_exchange(
            mean, x.numel(), worker_error, server_error, inter
        )
    except NonFiniteError as error:
        if not eager(mean):  # vmap (Simulated) or torch.compile: every rank raises together
            raise
        # This rank's across-node group raised together; tell the node before raising, so
        # that no rank of it waits in the all_gather below.
        failure = error
        nodes = inter.world_size
        packed = mean.new_zeros(nodes, mean.numel() // nodes // 8, dtype=torch.uint8)
        scales = mean.new_full((nodes,), torch.nan)
    all_packed = intra.all_gather(packed)  # [L, W / L, chunk / 8]
    all_scales = intra.all_gather(scales)  # [L, W / L]
    if failure is not None:
        raise NonFiniteError(_NON_FINITE_ON_SOME_RANK) from failure
    all_scales = finite_or_raise(all_scales, _NON_FINITE_ON_SOME_RANK)
    rows = all_scales.numel()
    return PackedSigns(all_packed.reshape(rows, -1), all_scales.reshape(rows)), worker, server


def _hierarchical_exchange(
    flat: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    intra: Comm,
    inter: Comm,
) -> CompressedExchange:
    """The hierarchical collective's exchanges of ``flat`` for :func:`write_errors` and
    :func:`write_result` over the node's ``intra`` and the ``inter`` comm of this rank's
    local index. Allocates this rank's shard (and a padded copy where ``flat`` needs one)."""
    local_world_size = intra.world_size
    mean = _node_mean(_padded_flat(flat, local_world_size * worker_error.numel()), intra)
    nodes = inter.world_size
    failure = None
    try:
        exchange = _exchange(mean, None, 0.0, worker_error, server_error, inter)
        message = torch.cat((exchange.packed.view(-1), exchange.scales.view(torch.uint8)))
    except NonFiniteError as error:  # as in _pure_hierarchical
        failure = error
        nan = torch.full((nodes,), torch.nan, device=mean.device).view(torch.uint8)
        message = torch.cat((mean.new_zeros(mean.numel() // 8, dtype=torch.uint8), nan))
    gathered = intra.all_gather(message)  # [L, S / 8 + 4 (W / L)]
    if failure is not None:
        raise NonFiniteError(_NON_FINITE_ON_SOME_RANK) from failure
    tail = 4 * nodes
    all_scales = finite_or_raise(
        gathered[:, -tail:].contiguous().view(torch.float32).view(-1), _NON_FINITE_ON_SOME_RANK
    )
    packed = gathered[:, :-tail].contiguous().view(local_world_size * nodes, -1)
    return exchange._replace(packed=packed, scales=all_scales)


class CompressedExchange(NamedTuple):
    """One rank's side of a :func:`compressed_allreduce` after every exchange and check, before
    anything is written (:func:`compressed_allreduce_exchange`): what the two writing steps,
    :func:`write_errors` and :func:`write_result`, need."""

    # [n] this rank's input, flat (the previous momentum where grad is given, maybe packed)
    x: torch.Tensor | PackedSigns
    grad: torch.Tensor | None  # [n] fp32 or None: the gradient of the momentum
    beta: float  # the momentum's beta (with grad)
    worker_error: torch.Tensor  # fp32[N]: e_w before the call
    server_error: torch.Tensor  # fp32[N / W]: e_s before the call
    scale: torch.Tensor  # [] fp32: this rank's worker scale
    received: torch.Tensor  # uint8 [W, chunk / 8]: the signs of this rank's chunk, by rank
    weights: torch.Tensor  # fp32 [W]: every rank's worker scale / W
    server_scale: torch.Tensor  # [] fp32: this rank's server scale
    packed: torch.Tensor  # uint8 [W, chunk / 8]: every rank's server signs
    scales: torch.Tensor  # fp32 [W]: every rank's server scale (all checked finite)


def compressed_allreduce_exchange(
    x: torch.Tensor | PackedSigns,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    *,
    comm: Comm,
    grad: torch.Tensor | None = None,
    beta: float = 0.0,
    local_world_size: int | None = None,
) -> CompressedExchange | None:
    """The communication of :func:`compressed_allreduce` of ``x`` without a fresh full-size
    tensor; with ``grad``, of the momentum ``beta * x + (1 - beta) * grad`` (rounded as
    ``fn.transforms``' ``moving_average``), computed on the fly, never as a tensor.

    It compresses, exchanges and checks everything, on every rank, and writes nothing; then
    :func:`write_errors` writes the new errors and :func:`write_result` (or
    ``fn.kernels.adam_apply`` with ``signs=(exchange.packed, exchange.scales)``) the result
    (docs/algorithms.md, "Error-compensated 1-bit allreduce", its output buffers and fused
    kernels).

    Args:
        x: this rank's tensor (fp32, contiguous); with ``grad``, the previous momentum, which
            may also be the :class:`PackedSigns` a 1-bit allreduce returned it as (read from
            its signs, never unpacked into a tensor; hierarchical, unpacked).
        worker_error: [N], this rank's worker error: fp32, or bf16 (the kernels read it as
            fp32 and round the new error once; fp16 takes the reference kernels).
        server_error: [N / W], this rank's server error, in the worker error's dtype.
        comm: the communicator.
        grad: optional fp32 tensor of ``x``'s shape, contiguous: the gradient of the momentum.
        beta: the momentum's beta (with ``grad``).
        local_world_size: ranks per node for the hierarchical collective, or ``None``;
            ``exchange.x`` is then this rank's shard of its node's mean (docs/algorithms.md,
            "Hierarchical 1-bit allreduce").

    Returns:
        The :class:`CompressedExchange`, or ``None`` (nothing done) where this allocation-free
        path does not apply (one rank, no elements, values other than fp32 or errors other
        than fp32 and bf16, non-contiguous tensors, errors of other shapes, packed signs
        without ``grad``, vmap, ``torch.compile``, one node): the caller then
        takes :func:`compressed_allreduce`, which raises where the call is wrong.

    Raises:
        ValueError: (on every rank at once, before any sign is sent) if the ranks' ``x`` differ
            in element count or some rank's momentum is not finite; (after the server's
            exchange) if a server error is not finite. Nothing is changed.

    Example:
        >>> from fn.collectives import Local
        >>> from fn.collectives.onebit import compressed_allreduce_exchange
        >>> x = torch.ones(3)
        >>> print(compressed_allreduce_exchange(x, x, x, comm=Local()))
        None
    """
    if isinstance(x, PackedSigns):
        if grad is None or x.packed.numel() * 8 < grad.numel() or not eager(*x):
            return None
        like, source = grad, x
    else:
        like, source = x, x.view(-1) if x.is_contiguous() else None
    values = (like, grad)
    if (
        comm.world_size == 1
        or like.numel() == 0
        or source is None
        or any(t is not None and t.dtype != torch.float32 for t in values)
        or worker_error.dtype not in (torch.float32, torch.bfloat16)
        or not eager(*values, worker_error, server_error)
        or (grad is not None and (grad.shape != like.shape or not grad.is_contiguous()))
    ):
        return None
    try:
        _check_errors(like.numel(), worker_error, server_error, comm.world_size, local_world_size)
    except ValueError:
        return None
    flat_grad = None if grad is None else grad.view(-1)
    return _exchange(source, flat_grad, beta, worker_error, server_error, comm, local_world_size)


def write_errors(
    exchange: CompressedExchange,
    worker: torch.Tensor | None = None,
    server: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the new errors of ``exchange`` into ``worker`` and ``server`` (fresh tensors
    where ``None``; they may be the old errors themselves) and returns them. The worker error
    is computed from ``exchange.x`` (and ``grad``): call this before :func:`write_result`
    writes a result that shares their memory."""
    worker = torch.empty_like(exchange.worker_error) if worker is None else worker
    server = torch.empty_like(exchange.server_error) if server is None else server
    kernels.sign_sum_apply_error(
        exchange.received, exchange.weights, exchange.server_error, exchange.server_scale, server
    )
    x, signs = _source(exchange.x)
    kernels.feedback_apply_error(
        x, exchange.worker_error, exchange.scale, worker, grad=exchange.grad, beta=exchange.beta,
        signs=signs,
    )  # fmt: skip
    return worker, server


def _source(x: torch.Tensor | PackedSigns) -> tuple[torch.Tensor | None, tuple | None]:
    """The ``x`` and ``signs`` arguments of the feedback kernels for an input in either form."""
    return (None, tuple(x)) if isinstance(x, PackedSigns) else (x, None)


def write_result(exchange: CompressedExchange, y: torch.Tensor) -> torch.Tensor:
    """Writes the result of ``exchange`` (the concatenated server signs times their scales,
    sliced to ``n``) into ``y`` (``n`` elements, contiguous, any floating dtype) by
    ``fn.kernels.unpack_scaled`` and returns ``y``."""
    if y.dtype == torch.float32:
        kernels.unpack_scaled(exchange.packed, exchange.scales, y.view(-1))
    else:
        values = torch.empty(y.numel(), dtype=torch.float32, device=y.device)
        y.view(-1).copy_(kernels.unpack_scaled(exchange.packed, exchange.scales, values))
    return y


def _check_out(
    out: AllreduceOut, x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor
) -> None:
    if not isinstance(out, tuple) or len(out) != 3:
        raise TypeError("compressed_allreduce: out must be a tuple (y, worker, server)")
    wanted = ((x, "y"), (worker_error, "worker"), (server_error, "server"))
    for buffer, (like, name) in zip(out, wanted, strict=True):
        if buffer is None:
            continue
        if buffer.shape != like.shape or buffer.dtype != like.dtype:
            raise ValueError(
                f"compressed_allreduce: out {name} must be {like.dtype} {tuple(like.shape)}, "
                f"got {buffer.dtype} {tuple(buffer.shape)}"
            )
        if not buffer.is_contiguous() or buffer.device != like.device:
            raise ValueError(
                f"compressed_allreduce: out {name} must be contiguous, on {like.device}"
            )


def _exchange(
    flat: torch.Tensor | PackedSigns,
    grad: torch.Tensor | None,
    beta: float,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    comm: Comm,
    local_world_size: int | None = None,
) -> CompressedExchange | None:
    """The allocation-free exchange: the worker compresses ``flat`` (or the momentum of
    ``flat`` and ``grad``) and exchanges; the server sums the received signs, compresses and
    exchanges; every scale is checked. Hierarchical (``local_world_size`` above 1), the
    exchanges of :func:`_hierarchical_exchange` (of the momentum, computed here, when ``grad``
    is given), or ``None`` with one node (the caller takes the pure path)."""
    if local_world_size not in (None, 1):
        if local_world_size == comm.world_size:
            return None
        if isinstance(flat, PackedSigns):
            flat = flat.values(grad.numel())
        _agree(comm, flat, local_world_size)  # before split, a collective over groups of that size
        if grad is not None:  # the momentum, rounded as fn.transforms' moving_average
            flat = (beta * flat).add_((1 - beta) * grad)
        return _hierarchical_exchange(
            flat, worker_error, server_error, *comm.split(local_world_size)
        )
    x, signs = _source(flat)
    world_size, n = comm.world_size, flat.numel() if signs is None else grad.numel()
    packed, scale = kernels.feedback_sign_compress(
        x, worker_error, grad=grad, beta=beta, signs=signs
    )
    scales = _worker_scales(comm, scale, n)
    received = comm.all_to_all(packed.view(world_size, -1))  # [W, chunk / 8]
    weights = scales / world_size
    server_packed, server_scale = kernels.sign_sum_compress(received, weights, server_error)
    # One all_gather for the signs and the scale (its 4 bytes after them): one latency less.
    message = torch.cat((server_packed, server_scale.reshape(1).view(torch.uint8)))
    gathered = comm.all_gather(message)  # [W, chunk / 8 + 4]
    all_scales = finite_or_raise(
        gathered[:, -4:].contiguous().view(torch.float32).view(world_size), _NON_FINITE_SERVER
    )
    return CompressedExchange(
        flat, grad, beta, worker_error, server_error, scale, received, weights, server_scale,
        gathered[:, :-4].contiguous(), all_scales,
    )  # fmt: skip


class OnebitAllreduceState(NamedTuple):
    """The state of :func:`onebit_allreduce` (``W`` ranks, ``L`` per node, ``L = 1`` flat).

    Attributes:
        worker_error: per leaf, fp32 ``[padded_numel(leaf.numel(), W, L) / L]``: the worker
            errors.
        server_error: per leaf, fp32 ``[padded_numel(leaf.numel(), W, L) / W]``: the server
            errors.

    Example:
        >>> tx = fn.collectives.onebit_allreduce(comm=fn.collectives.Simulated(2))
        >>> state = tx.init({"w": torch.zeros(3)})
        >>> state.worker_error["w"].shape, state.server_error["w"].shape
        (torch.Size([16]), torch.Size([8]))
    """

    worker_error: ErrorFeedbackField
    server_error: ErrorFeedbackField


def onebit_allreduce(*, comm: Comm, local_world_size: int | None = None) -> Compressor:
    """The error-compensated 1-bit allreduce of every update leaf, as a transform.

    ``update`` replaces each leaf ``u`` of every rank by :func:`compressed_allreduce` of it
    (an estimate of ``mean_i u_i``), threading one pair of error buffers per leaf in the state.
    ``None`` leaves pass through. After a momentum transform, ``chain(trace(...),
    onebit_allreduce(comm=c), scale(-lr))`` is 1-bit SGD with error feedback.

    ``init`` sizes the buffers from one rank's params: with ``Simulated``, call it on unbatched
    params and ``replicate`` the state, or run it under ``simulate``.

    ``update(..., donate=...)`` (buffer donation) writes the new errors into the donated
    state's buffers and each result into its update leaf, with the bits of the pure call.
    ``update(..., participation=...)`` (:class:`~fn.collectives.Participation`, flat only)
    averages over the ranks that take part (see :func:`compressed_allreduce`); it computes
    purely, whatever ``donate`` says.

    Args:
        comm: the communicator.
        local_world_size: ranks per node ``L`` for the hierarchical collective (dense inside a
            node, 1-bit across nodes; the worker errors are ``L`` times smaller), or ``None``
            for flat. See :func:`compressed_allreduce`.

    ``exchange(updates, state, flag)`` (:class:`~fn.collectives.Compressor`, flat): the bits of
    ``update`` with ``participation`` read from the ranks' flags, in two collectives whatever
    the number of leaves, this rank's flag and the size record in a header (``fn.diloco``'s
    outer step): one all_to_all of every leaf's signs and worker scale to their owners, one
    all-gather of every owner's server signs and scale. A rank whose flag is ``False`` (or whose
    input or worker error is not finite) sends zeros and keeps its worker error.

    Returns:
        A :class:`~fn.collectives.Compressor` with state :class:`OnebitAllreduceState`.

    With a ``ProcessGroup`` and ``local_world_size``, building the transform is a collective
    call (it builds the node groups: ``ProcessGroup.split``): every rank builds it, in the same
    order.

    Raises:
        ValueError: if ``local_world_size`` is not a positive divisor of ``comm.world_size``, or
            (``ProcessGroup``) the ranks passed different values.

    Example:
        >>> from fn.collectives import Simulated, onebit_allreduce, simulate
        >>> comm = Simulated(2)
        >>> tx = onebit_allreduce(comm=comm)
        >>> grads = {"w": torch.tensor([[1.0, 2.0], [3.0, 6.0]])}  # row r: rank r's gradient
        >>> state = simulate(tx.init, comm)(grads)
        >>> state.worker_error["w"].shape  # [W, padded_numel(2, 2)]
        torch.Size([2, 16])
        >>> updates, state = simulate(tx.update, comm)(grads, state)
        >>> updates["w"]  # 1 bit per element: the sign times one scale
        tensor([[1.1180, 1.1180],
                [1.1180, 1.1180]])
    """

    if local_world_size is not None:
        comm.split(local_world_size)  # checks it; a ProcessGroup builds its node groups now
    level = dict(comm=comm, local_world_size=local_world_size)

    def init_fn(params):
        def errors(k):
            return tree_map(
                lambda p: init_error_feedback(p.numel(), **level, device=p.device)[k], params
            )

        return OnebitAllreduceState(errors(0), errors(1))

    def update_fn(updates, state, params=None, *, donate=None, participation=None, **extra):
        del params, extra
        walk = live_leaves(updates, state.worker_error, state.server_error, check=_has_errors)
        donated = donated_state(donate, state) if participation is None else None
        live = zip(*(walk.at_live(k) for k in range(3)), strict=True)
        if donated is None:
            results = [
                compressed_allreduce(u, we, se, **level, participation=participation)
                for u, we, se in live
            ]
        else:
            spares = [donated_leaves(tree, walk.spec) for tree in donated]
            spare = zip(*([leaves[i] for i in walk.live] for leaves in spares), strict=True)
            results = _donated_allreduces(list(live), list(spare), level)
        out, worker, server = (list(column) for column in zip(*results, strict=True))
        return walk.rebuild(out), OnebitAllreduceState(
            walk.rebuild(worker, fill=1), walk.rebuild(server, fill=2)
        )

    def exchange_fn(updates, state, flag=None, params=None, *, extra=()):
        del params
        if local_world_size not in (None, 1):
            raise NotImplementedError(
                "onebit_allreduce: the exchange with a header runs flat; the hierarchical "
                "collective (local_world_size) has only update (fn.diloco's compressors are flat)"
            )
        walk = live_leaves(updates, state.worker_error, state.server_error, check=_has_errors)
        leaves = walk.leaves[0]
        live = [i for i in walk.live if leaves[i].numel() > 0]
        if comm.world_size == 1:
            return alone(updates, state, flag, leaves, live, extra)
        if not live:
            return headers_only(comm, updates, state, flag, _WHAT, extra)
        errors = [(walk.leaves[1][i], walk.leaves[2][i]) for i in live]
        for i, (worker_error, server_error) in zip(live, errors, strict=True):
            _check_errors(leaves[i].numel(), worker_error, server_error, comm.world_size, None)
        got, results = _headed_exchange(leaves, live, errors, comm, flag_of(flag), extra)
        out, worker, server = list(leaves), list(walk.leaves[1]), list(walk.leaves[2])
        for i, (y, new_worker, new_server) in zip(live, results, strict=True):
            out[i], worker[i], server[i] = y, new_worker, new_server
        new_state = OnebitAllreduceState(
            tree_unflatten(worker, walk.spec), tree_unflatten(server, walk.spec)
        )
        return Exchanged(tree_unflatten(out, walk.spec), new_state, got.flags, got.extra)

    return Compressor(init_fn, update_fn, exchange_fn)


_WHAT = "onebit_allreduce"


def _headed_exchange(
    leaves: list,
    live: list[int],
    errors: list[tuple[torch.Tensor, torch.Tensor]],
    comm: Comm,
    offered: torch.Tensor,
    extra: Sequence[int],
) -> tuple[Opened, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """:func:`compressed_allreduce` of every live leaf (flat), with ``participation`` read from
    the ranks' flags, in two collectives: an all_to_all whose row ``j`` holds chunk ``j`` of
    every leaf's signs and this rank's worker scale of every leaf, the header in front; then an
    all-gather of every leaf's server signs and server scale. Each leaf is padded and compressed
    as on its own: the bits of one call per leaf. Returns what the headers held and ``(y,
    worker_error', server_error')`` per live leaf."""
    world_size = comm.world_size
    flats = [_padded_flat(leaves[i], e.numel()) for i, (e, _) in zip(live, errors, strict=True)]
    stored = [(worker.float(), server.float()) for worker, server in errors]
    flag = offered
    for flat, (worker, _) in zip(flats, stored, strict=True):
        flag = flag & torch.isfinite(flat).all() & torch.isfinite(worker).all()
    flag, sent_signs = _worker_compressed(flats, [e for e, _ in stored], flag)
    n = sum(leaves[i].numel() for i in live)
    checksum = _sizes.layout_checksum((i, leaves[i].numel()) for i in live)
    rows = _rows(sent_signs, world_size)
    got, part = exchange_rows(comm, rows, flag, n, _WHAT, checksum, to_each=True, extra=extra)
    servers = [
        _server_compressed(signs, scales, server, part)
        for (signs, scales), (_, server) in zip(
            _columns(got.payload, sent_signs, world_size), stored, strict=True
        )
    ]
    owners = _columns(gathered(comm, _rows(servers, 1)[0]), servers, 1)
    results = []
    for k, i in enumerate(live):
        packed, scales = owners[k]
        y = PackedSigns(packed, finite_or_raise(scales, _NON_FINITE_SERVER)).unpacked(leaves[i])
        worker = torch.where(flag, sent_signs[k].error, stored[k][0]).to(errors[k][0].dtype)
        results.append((y, worker, servers[k].error.to(errors[k][1].dtype)))
    return got, results


class _Signs(NamedTuple):
    """One leaf's side of the headed exchange: its packed signs, its scale and its new error."""

    packed: torch.Tensor
    scale: torch.Tensor
    error: torch.Tensor


def _worker_compressed(
    flats: list[torch.Tensor], errors: list[torch.Tensor], flag: torch.Tensor
) -> tuple[torch.Tensor, list[_Signs]]:
    """Every leaf's worker compression; where ``flag`` is unset (or a scale is not finite) the
    flag cleared and zeros sent (a sitter's input and error are not read)."""
    try:
        signs = [
            _Signs(*kernels.sign_compress(torch.where(flag, x, 0.0), torch.where(flag, e, 0.0)))
            for x, e in zip(flats, errors, strict=True)
        ]
    except NonFiniteError:  # x + e overflowed: this rank sits out
        flag = torch.zeros_like(flag)
        zeros = [torch.zeros_like(x) for x in flats]
        signs = [_Signs(*kernels.sign_compress(z, z)) for z in zeros]
    return flag, [
        _Signs(torch.where(flag, s.packed, 0), torch.where(flag, s.scale, 0.0), s.error)
        for s in signs
    ]


def _server_compressed(
    signs: torch.Tensor, scales: torch.Tensor, server_error: torch.Tensor, part: Participation
) -> _Signs:
    """An owner's compression of the weighted sum of the ``[W, chunk / 8]`` signs it received;
    a non-finite server error sends a NaN scale, which every rank refuses after the
    all-gather."""
    server_m = _server_sum(signs, scales, part)
    try:
        return _Signs(*kernels.sign_compress(server_m, server_error))
    except NonFiniteError:
        packed = torch.zeros(server_m.numel() // 8, dtype=torch.uint8, device=signs.device)
        return _Signs(packed, server_m.new_full((), torch.nan), server_error)


def _rows(signs: list[_Signs], rows: int) -> torch.Tensor:
    """Every leaf's packed signs cut into ``rows`` rows, then every leaf's scale in each row:
    uint8 ``[rows, bytes]``."""
    parts = [s.packed.view(rows, -1) for s in signs]
    parts += [s.scale.reshape(1).view(torch.uint8).expand(rows, 4) for s in signs]
    return torch.cat(parts, dim=1)


def _columns(
    received: torch.Tensor, signs: list[_Signs], rows: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The received ``[W, bytes]`` of :func:`_rows` back into every leaf's packed signs ``[W,
    bytes]`` and its ``W`` fp32 scales, one per sender."""
    widths = [s.packed.numel() // rows for s in signs]
    parts = received.split(widths + [4] * len(signs), dim=1)
    packed, scales = parts[: len(signs)], parts[len(signs) :]
    scales = [s.clone(memory_format=torch.contiguous_format).view(torch.float32) for s in scales]
    return [(p.contiguous(), s.view(-1)) for p, s in zip(packed, scales, strict=True)]


def _has_errors(index: int, update: torch.Tensor, worker_error: torch.Tensor | None) -> None:
    del index, update
    if worker_error is None:
        raise ValueError("onebit_allreduce: an update leaf has no error state")


def _donated_allreduces(live, spare, level):
    """:func:`compressed_allreduce` of every live ``(u, worker, server)``, each result written
    into ``u`` and the errors into the ``spare`` buffers (where they fit): every leaf is
    exchanged and checked before the first is written."""
    exchanges = [compressed_allreduce_exchange(*leaf, **level) for leaf in live]
    pure = [
        compressed_allreduce(*leaf, **level) if ex is None else None
        for leaf, ex in zip(live, exchanges, strict=True)
    ]
    # every leaf exchanged and checked: now write
    results = []
    for (u, we, se), (dwe, dse), ex, result in zip(live, spare, exchanges, pure, strict=True):
        if ex is not None:
            errors = write_errors(ex, fitting(dwe, we), fitting(dse, se))
            results.append((write_result(ex, u), *errors))
        else:
            buffers = (fitting(u, u), fitting(dwe, we), fitting(dse, se))
            results.append(
                tuple(
                    r if b is None or r is x else b.copy_(r)
                    for b, r, x in zip(buffers, result, (u, we, se), strict=True)
                )
            )
    return results
