"""Error-compensated 1-bit allreduce (DeepSpeed's compressed allreduce) and its transform.

References:
    Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed", ICML 2021 (arXiv:2102.02888), Algorithm 1's compressed allreduce.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from fn import kernels
from fn.base import GradientTransformation, donated_state
from fn.collectives import _sizes
from fn.collectives._fusion_barrier import fusion_barrier
from fn.collectives.comm import Comm
from fn.collectives.error_feedback import ErrorFeedback, ErrorFeedbackField
from fn.errors import NonFiniteError, finite_or_raise
from fn.tree import eager, fitting, tree_flatten, tree_map, tree_unflatten

__all__ = [
    "padded_numel",
    "init_error_feedback",
    "compressed_allreduce",
    "CompressedExchange",
    "compressed_allreduce_exchange",
    "write_errors",
    "write_result",
    "OnebitAllreduceState",
    "onebit_allreduce",
]


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``W * lcm(W, 8)``.

    Every rank's chunk of ``N / W`` signs is then a whole number of bytes, and split again into
    ``W`` byte-aligned pieces.

    Example:
        >>> from fn.collectives import padded_numel
        >>> padded_numel(10, 2), padded_numel(10, 3), padded_numel(32, 4)
        (16, 72, 32)
    """
    unit = world_size * math.lcm(world_size, 8)
    return -(-numel // unit) * unit


def init_error_feedback(
    numel: int, *, comm: Comm, device: torch.device | str | None = None
) -> ErrorFeedback:
    """Zero error-feedback buffers for a ``numel``-element :func:`compressed_allreduce`.

    Args:
        numel: the number of elements that will be allreduced.
        comm: the communicator (its world size fixes the padding).
        device: where the buffers live.

    Returns:
        ``ErrorFeedback(worker fp32[N], server fp32[N / W])`` with ``N = padded_numel(numel, W)``
        (a NamedTuple: ``worker_error, server_error = init_error_feedback(...)`` works).

    Example:
        >>> from fn.collectives import Simulated, init_error_feedback
        >>> worker, server = init_error_feedback(10, comm=Simulated(2))
        >>> worker.shape, server.shape
        (torch.Size([16]), torch.Size([8]))
    """
    world_size = comm.world_size
    n_padded = padded_numel(numel, world_size)
    return ErrorFeedback(
        torch.zeros(n_padded, dtype=torch.float32, device=device),
        torch.zeros(n_padded // world_size, dtype=torch.float32, device=device),
    )


AllreduceOut = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def compressed_allreduce(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    *,
    comm: Comm,
    out: AllreduceOut | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

    Args:
        x: this rank's tensor (any shape, floating point).
        worker_error: fp32[N], this rank's worker error.
        server_error: fp32[N / W], this rank's server error (for chunk ``rank``).
        comm: the communicator.
        out: optional output buffers ``(y, worker, server)`` (buffer donation), each ``None``
            (a fresh tensor) or a contiguous tensor to write: ``y`` of ``x``'s shape and dtype
            (it may be ``x`` itself), ``worker``/``server`` fp32 of the errors' shapes (they may
            be ``worker_error``/``server_error`` themselves). With buffers given, eager calls on
            plain tensors make no full-size temporary: the signs of ``x + e_w`` are packed
            without a padded copy, the server sums the received signs without unpacking them,
            the new errors and ``y`` are written straight into the buffers, and nothing is
            written before every rank's scales and counts have been checked (then also the
            server's, so a failure leaves every buffer intact). Under ``Simulated`` (vmap) and
            ``torch.compile`` the results are computed as without buffers and copied into them.

    Returns:
        ``(y, worker_error', server_error')``, the buffers of ``out`` where given; ``y`` has
        ``x``'s shape and dtype. With ``W == 1`` it is ``(x, worker_error, server_error)``
        (nothing is written); with ``n == 0`` it is ``x`` and zeroed errors, without
        communication.

    Raises:
        ValueError: if the error or buffer shapes do not match, or (on every rank at once,
            before any sign is sent) if the ranks' ``x`` differ in element count or some rank's
            ``x + worker_error`` is not finite. Nothing is changed.

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
    n_padded = padded_numel(n, world_size)
    if tuple(worker_error.shape) != (n_padded,) or tuple(server_error.shape) != (
        n_padded // world_size,
    ):
        raise ValueError(
            f"compressed_allreduce of {n} elements over {world_size} ranks needs errors of "
            f"shapes ({n_padded},) and ({n_padded // world_size},), got "
            f"{tuple(worker_error.shape)} and {tuple(server_error.shape)} "
            "(see init_error_feedback)"
        )
    if out is not None:
        _check_out(out, x, worker_error, server_error)
    if world_size == 1:
        return x, worker_error, server_error
    if n == 0:
        if out is None:
            return x, torch.zeros_like(worker_error), torch.zeros_like(server_error)
        return x, _zeroed(out[1], worker_error), _zeroed(out[2], server_error)
    if not x.is_floating_point():
        raise TypeError(f"compressed_allreduce needs a floating-point x, got {x.dtype}")
    if out is None:
        return _pure_allreduce(x, worker_error, server_error, comm)
    if not eager(x, worker_error, server_error, *out):
        return _copied_into(out, _pure_allreduce(x, worker_error, server_error, comm))
    exchange = _exchange(x.reshape(-1), None, 0.0, worker_error, server_error, comm)
    worker, server = write_errors(exchange, out[1], out[2])
    y = torch.empty_like(x) if out[0] is None else out[0]
    return write_result(exchange, y), worker, server


def _pure_allreduce(
    x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor, comm: Comm
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference path (fresh tensors; also the one under vmap and ``torch.compile``)."""
    world_size = comm.world_size
    n = x.numel()
    n_padded = worker_error.numel()
    chunk = n_padded // world_size

    flat = x.reshape(-1).float()
    if n_padded > n:
        flat = torch.nn.functional.pad(flat, (0, n_padded - n))
    # Non-finite values make the scale non-finite (or the kernel raise); the rank then sends a
    # NaN scale, every rank sees it after the scale all_gather and raises there, before any
    # sign is exchanged: no rank is left waiting and no error state is touched.
    try:
        packed, scale, new_worker_error = kernels.sign_compress(flat, worker_error)
    except NonFiniteError:
        packed, scale, new_worker_error = None, flat.new_full((), torch.nan), None
    # The element count travels with the scale: ranks with different sizes raise here, together.
    gathered = comm.all_gather(_sizes.with_count(scale.view(1), n))  # [W, 3]
    scales = finite_or_raise(
        _sizes.checked_scales(gathered, n, "compressed_allreduce").view(world_size),
        "compressed_allreduce: non-finite values in x (or in the worker error)",
    )

    received = comm.all_to_all(packed.view(world_size, -1))  # [W, chunk / 8]: chunk r of rank i
    # unpackbits returns fresh tensors: scaling them in place saves a full-size copy each.
    signs = kernels.unpackbits(received.reshape(-1), n_padded).view(world_size, chunk)
    server_m = kernels.sum_ranks(signs.mul_((scales / world_size)[:, None]))  # [chunk]
    server_packed, server_scale, new_server_error = kernels.sign_compress(server_m, server_error)

    all_packed = comm.all_gather(server_packed)  # [W, chunk / 8]
    all_scales = comm.all_gather(server_scale)  # [W]
    y = kernels.unpackbits(all_packed.reshape(-1), n_padded).view(world_size, chunk)
    y = y.mul_(all_scales[:, None]).reshape(-1)
    if torch.compiler.is_compiling():
        y = fusion_barrier(y)
    y = y[:n]
    return y.view(x.shape).to(x.dtype), new_worker_error, new_server_error


class CompressedExchange(NamedTuple):
    """One rank's side of a :func:`compressed_allreduce` after every exchange and check, before
    anything is written (:func:`compressed_allreduce_exchange`): what the two writing steps,
    :func:`write_errors` and :func:`write_result`, need."""

    x: torch.Tensor  # [n] this rank's input, flat (the previous momentum where grad is given)
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
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    *,
    comm: Comm,
    grad: torch.Tensor | None = None,
    beta: float = 0.0,
) -> CompressedExchange | None:
    """The communication of :func:`compressed_allreduce` of ``x`` without a fresh full-size
    tensor; with ``grad``, of the momentum ``beta * x + (1 - beta) * grad`` (rounded as
    ``fn.transforms``' ``moving_average``), computed on the fly, never as a tensor.

    It compresses, exchanges and checks everything, on every rank, and writes nothing; then
    :func:`write_errors` writes the new errors and :func:`write_result` (or
    ``fn.kernels.adam_apply`` with ``signs=(exchange.packed, exchange.scales)``) the result.
    An optimizer exchanges every leaf before it writes any, so a failure on any leaf leaves
    every buffer intact.

    Args:
        x: this rank's tensor (fp32, contiguous).
        worker_error: fp32[N], this rank's worker error.
        server_error: fp32[N / W], this rank's server error.
        comm: the communicator.
        grad: optional fp32 tensor of ``x``'s shape, contiguous: the gradient of the momentum.
        beta: the momentum's beta (with ``grad``).

    Returns:
        The :class:`CompressedExchange`, or ``None`` (nothing done) where this allocation-free
        path does not apply (one rank, no elements, dtypes other than fp32, non-contiguous
        tensors, errors of other shapes, vmap, ``torch.compile``): the caller then takes
        :func:`compressed_allreduce`, which raises where the call is wrong.

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
    tensors = (x, grad, worker_error, server_error)
    if (
        comm.world_size == 1
        or x.numel() == 0
        or any(t is not None and t.dtype != torch.float32 for t in tensors)
        or not eager(*tensors)
        or not x.is_contiguous()
        or (grad is not None and (grad.shape != x.shape or not grad.is_contiguous()))
    ):
        return None
    n_padded = padded_numel(x.numel(), comm.world_size)
    if worker_error.shape != (n_padded,) or server_error.shape != (n_padded // comm.world_size,):
        return None
    flat_grad = None if grad is None else grad.view(-1)
    return _exchange(x.view(-1), flat_grad, beta, worker_error, server_error, comm)


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
    kernels.feedback_apply_error(
        exchange.x, exchange.worker_error, exchange.scale, worker, grad=exchange.grad,
        beta=exchange.beta,
    )  # fmt: skip
    return worker, server


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


def _zeroed(buffer: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if buffer is None else buffer.zero_()


def _copied_into(
    out: AllreduceOut, results: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(r if b is None else b.copy_(r) for b, r in zip(out, results, strict=True))


def _exchange(
    flat: torch.Tensor,
    grad: torch.Tensor | None,
    beta: float,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    comm: Comm,
) -> CompressedExchange:
    """The allocation-free exchange: the worker compresses ``flat`` (or the momentum of
    ``flat`` and ``grad``) and exchanges; the server sums the received signs, compresses and
    exchanges; every scale is checked."""
    world_size, n = comm.world_size, flat.numel()
    what = "compressed_allreduce"
    packed, scale = kernels.feedback_sign_compress(flat, worker_error, grad=grad, beta=beta)
    # The element count travels with the scale: ranks with different sizes raise here, together.
    gathered = comm.all_gather(_sizes.with_count(scale.view(1), n))  # [W, 3]
    scales = finite_or_raise(
        _sizes.checked_scales(gathered, n, what).view(world_size),
        f"{what}: non-finite values in x (or in the worker error)",
    )
    received = comm.all_to_all(packed.view(world_size, -1))  # [W, chunk / 8]
    weights = scales / world_size
    server_packed, server_scale = kernels.sign_sum_compress(received, weights, server_error)
    # One all_gather for the signs and the scale (its 4 bytes after them): one latency less.
    message = torch.cat((server_packed, server_scale.reshape(1).view(torch.uint8)))
    gathered = comm.all_gather(message)  # [W, chunk / 8 + 4]
    all_scales = finite_or_raise(
        gathered[:, -4:].contiguous().view(torch.float32).view(world_size),
        f"{what}: non-finite values in a server error",
    )
    return CompressedExchange(
        flat, grad, beta, worker_error, server_error, scale, received, weights, server_scale,
        gathered[:, :-4].contiguous(), all_scales,
    )  # fmt: skip


class OnebitAllreduceState(NamedTuple):
    worker_error: ErrorFeedbackField  # per leaf: fp32[padded_numel(leaf.numel(), W)]
    server_error: ErrorFeedbackField  # per leaf: fp32[padded_numel(leaf.numel(), W) / W]


def onebit_allreduce(*, comm: Comm) -> GradientTransformation:
    """The error-compensated 1-bit allreduce of every update leaf, as a transform.

    ``update`` replaces each leaf ``u`` of every rank by :func:`compressed_allreduce` of it
    (an estimate of ``mean_i u_i``), threading one pair of error buffers per leaf in the state.
    ``None`` leaves pass through. After a momentum transform, ``chain(trace(...),
    onebit_allreduce(comm=c), scale(-lr))`` is 1-bit SGD with error feedback.

    ``init`` sizes the buffers from one rank's params: with ``Simulated``, call it on unbatched
    params and ``replicate`` the state, or run it under ``simulate``.

    ``update`` takes the extra keyword ``donate`` (``None``, ``True`` or a state like
    ``state``; the protocol of buffer donation): the new errors are written into the donated
    state's buffers and each result into its update leaf (:func:`compressed_allreduce` with
    ``out``), with the same bits as the pure call.

    Args:
        comm: the communicator.

    Returns:
        A GradientTransformation with state :class:`OnebitAllreduceState`.

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

    def init_fn(params):
        def worker(p):
            return init_error_feedback(p.numel(), comm=comm, device=p.device)[0]

        def server(p):
            return init_error_feedback(p.numel(), comm=comm, device=p.device)[1]

        return OnebitAllreduceState(tree_map(worker, params), tree_map(server, params))

    def update_fn(updates, state, params=None, *, donate=None, **extra):
        del params, extra
        leaves, spec = tree_flatten(updates)
        worker = spec.flatten_up_to(state.worker_error)
        server = spec.flatten_up_to(state.server_error)
        donated = donated_state(donate, state)
        if any(u is not None and we is None for u, we in zip(leaves, worker, strict=True)):
            raise ValueError("onebit_allreduce: an update leaf has no error state")
        if donated is None:
            results = [
                (u, we, se) if u is None else compressed_allreduce(u, we, se, comm=comm)
                for u, we, se in zip(leaves, worker, server, strict=True)
            ]
        else:
            results = _donated_allreduces(leaves, worker, server, donated, spec, comm)
        out, new_worker, new_server = (list(column) for column in zip(*results, strict=True))
        return tree_unflatten(out, spec), OnebitAllreduceState(
            tree_unflatten(new_worker, spec), tree_unflatten(new_server, spec)
        )

    return GradientTransformation(init_fn, update_fn)


def _donated_allreduces(leaves, worker, server, donated, spec, comm):
    """:func:`compressed_allreduce` of every leaf, each result written into its leaf and the
    errors into ``donated``'s buffers (where they fit): every leaf is exchanged and checked
    before the first is written."""
    spare_worker = spec.flatten_up_to(donated.worker_error)
    spare_server = spec.flatten_up_to(donated.server_error)
    exchanges, pure = [], []
    for u, we, se in zip(leaves, worker, server, strict=True):
        ex = None if u is None else compressed_allreduce_exchange(u, we, se, comm=comm)
        exchanges.append(ex)
        pure.append(
            None if u is None or ex is not None else compressed_allreduce(u, we, se, comm=comm)
        )
    # every leaf exchanged and checked: now write
    results = []
    for u, we, se, dwe, dse, ex, result in zip(
        leaves, worker, server, spare_worker, spare_server, exchanges, pure, strict=True
    ):
        if u is None:
            results.append((u, we, se))
        elif ex is not None:
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
