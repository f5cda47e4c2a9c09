"""``onebit_hook``: a DDP comm hook that allreduces every gradient bucket in 1 bit per element."""

# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
import torch
import torch.distributed as dist

from fn.base import GradientTransformation
from fn.collectives import ProcessGroup, onebit_allreduce
from fn.ddp._bucket_hook import BucketHookState

__all__ = ["OnebitHookState", "onebit_hook"]


class OnebitHookState(BucketHookState):
    """The state of :func:`onebit_hook`: its process group, schedule and per-bucket error
    feedback (``state_dict()`` / ``load_state_dict()`` for checkpoints: save one per rank).

    Args:
        process_group: the group DDP communicates over (``None``: the world).
        start_iter: iterations averaged densely before compression starts (the first ones
            move the most; DDP also rebuilds its buckets after the first, or the
            second with ``static_graph=True``).
        overlap: compress on the state's background thread, overlapped with the backward pass,
            over a process group of the same ranks that the state makes for it (a collective
            call: build the state on every rank in the same order, as DDP); ``False``: inside
            the hook, over ``process_group``. The results are the same.
        timeout: the limit of each compressed collective (``fn.collectives.ProcessGroup``'s
            ``timeout``: a ``timedelta`` or seconds; ``None``: ``$FN_TIMEOUT``, else 5 minutes).
        nonfinite: what a bucket with a NaN or an Inf on some rank gives, in both phases and
            on every rank (found without a collective of its own): ``"propagate"`` (default) a
            non-finite result (dense, the mean; compressed, all NaN), as DDP without a hook
            gives, so that ``torch.amp.GradScaler`` skips the step; ``"raise"``
            ``fn.NonFiniteError`` from ``backward()`` (a ``RuntimeError`` naming it through the
            bucket's future), the iteration not counted in ``iter``. Either way no bucket keeps
            error feedback from that iteration. A setting, not part of :meth:`state_dict`.
        local_world_size: ranks per node ``L`` for the hierarchical 1-bit allreduce (a dense
            mean inside each node, 1 bit across nodes; ``fn.collectives.compressed_allreduce``),
            or ``None`` for flat. Use it with several ranks per node and a slow network between
            nodes (torchrun's ``LOCAL_WORLD_SIZE``). Recorded in :meth:`state_dict`.

    Raises:
        TypeError: ``process_group`` is neither a ``torch.distributed.ProcessGroup`` nor
            ``None``.
        ValueError: on every rank of the group, the ranks were built with other settings
            (one all-gather when the state is built); ``nonfinite`` is neither
            ``"propagate"`` nor ``"raise"``;
            ``local_world_size`` does not divide the world size.

    Example:
        One rank here (under ``torchrun`` every rank runs this): a state loaded from another's
        ``state_dict()`` resumes its schedule and error feedback:

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> state = fn.ddp.OnebitHookState(start_iter=1)
        >>> model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        >>> model.register_comm_hook(state, fn.ddp.onebit_hook)
        >>> for _ in range(2):  # one dense iteration, one compressed
        ...     model(torch.ones(2, 4)).sum().backward()
        >>> resumed = fn.ddp.OnebitHookState(start_iter=1)
        >>> resumed.load_state_dict(state.state_dict())
        >>> resumed.iter
        2
        >>> dist.destroy_process_group()
    """

    def _make_transform(self, comm: ProcessGroup) -> GradientTransformation:
        return onebit_allreduce(comm=comm, local_world_size=self.local_world_size)


def onebit_hook(
    state: OnebitHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the error-compensated 1-bit allreduce of each gradient bucket.

    For the first ``state.start_iter`` iterations the bucket is averaged densely (sum, then
    ``/ W``). Then each bucket ``g`` of rank ``i`` is replaced by ``CAR(g)``, the estimate of
    ``mean_i g_i`` of ``fn.collectives.compressed_allreduce`` (signs and one scale per rank and
    chunk, about 1/32 of the fp32 traffic):

    .. math::
        m_i = g_i + e_{w,i}, \\quad e_{w,i}' = m_i - a_i\\, s(m_i), \\quad
        \\mathrm{CAR}(g) = \\text{the server-compressed mean of } a_i\\, s(m_i)

    with per-bucket error feedback (keyed by the bucket's index; a bucket that DDP rebuilt with
    other params starts again from zero error, with a log line). Use it with any optimizer
    (e.g. ``torch.optim.AdamW``); for 1-bit Adam, 0/1 Adam and 1-bit LAMB prefer
    ``fn.ddp.register`` (they compress the momentum, which converges where compressing Adam's
    gradients may not).

    Overlap: the hook hands the bucket to ``state``'s background thread, which compresses the
    buckets one at a time in DDP's bucket order while autograd goes on, and returns a future of
    its result. An error (e.g. a ``CollectiveTimeoutError``) completes the bucket's future with
    it, so the backward pass raises on every rank; the later buckets of that iteration are not
    reduced and no bucket keeps error feedback from that iteration, as without overlap.

    Non-finite gradients: as ``state.nonfinite`` says (:class:`OnebitHookState`).

    Args:
        state: an :class:`OnebitHookState`.
        bucket: DDP's gradient bucket.

    Returns:
        A future holding the bucket's averaged (or estimated) gradients.

    References:
        Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
        Convergence Speed", ICML 2021 (arXiv:2102.02888).

    Example:
        With ``torch.optim.AdamW``, one rank here (under ``torchrun`` every rank runs this):

        >>> import torch.distributed as dist
        >>> from torch.nn.parallel import DistributedDataParallel as DDP
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = DDP(torch.nn.Linear(4, 1))
        >>> state = fn.ddp.OnebitHookState(start_iter=1)
        >>> model.register_comm_hook(state, fn.ddp.onebit_hook)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> for _ in range(2):
        ...     opt.zero_grad()
        ...     model(torch.ones(2, 4)).sum().backward()
        ...     opt.step()
        >>> state.iter, sorted(state.buckets)  # one dense iteration, one compressed
        (2, [0])
        >>> dist.destroy_process_group()
    """
    return state.reduce_bucket(bucket)
