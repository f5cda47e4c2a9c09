"""``loco_hook``: a DDP comm hook that allreduces every gradient bucket in 4 or 8 bits."""

# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
import datetime

import torch
import torch.distributed as dist

from fn.base import GradientTransformation
from fn.collectives import ProcessGroup, loco_allreduce
from fn.ddp._bucket_hook import BucketHookState

__all__ = ["LocoHookState", "loco_hook"]


class LocoHookState(BucketHookState):
    """The state of :func:`loco_hook`: its process group, schedule, quantization and per-bucket
    LoCo error feedback (``state_dict()`` / ``load_state_dict()`` for checkpoints: save one per
    rank).

    Args:
        process_group: the group DDP communicates over (``None``: the world).
        bits: 4 or 8.
        group_size: values per quantization group (even).
        err_beta: LoCo's error decay ``beta``.
        reset_T: zero a bucket's errors every ``reset_T`` of its compressed iterations.
        start_iter: iterations averaged densely before compression starts.
        overlap: quantize on the state's background thread, as :class:`OnebitHookState`'s.
        timeout: the limit of each quantized collective, as :class:`OnebitHookState`'s.
        nonfinite: ``"propagate"`` (default) or ``"raise"``, as :class:`OnebitHookState`'s.
        local_world_size: ranks per node for LoCo's two-hop reduce-scatter (inside each node,
            then across nodes; ``fn.collectives.loco_allreduce``), or ``None`` for one hop.
            Recorded in :meth:`state_dict`.

    Raises:
        TypeError: as :class:`OnebitHookState`'s.
        ValueError: as :class:`OnebitHookState`'s (the ranks' settings compared when it is
            built, ``bits`` among them), and where ``bits`` is not the int 4 or 8 or
            ``group_size`` not an even int >= 2.

    Example:
        One rank here (under ``torchrun`` every rank runs this; :func:`loco_hook` shows it in a
        DDP model):

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> state = fn.ddp.LocoHookState(bits=8, group_size=64, start_iter=0, overlap=False)
        >>> state.state_dict()  # no bucket compressed yet
        {'iter': 0, 'rank': 0, 'world_size': 1, 'local_world_size': None, 'buckets': {}}
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        bits: int = 4,
        group_size: int = 128,
        err_beta: float = 0.8,
        reset_T: int = 1024,  # noqa: N803 (LoCo's / DeepSpeed's name)
        start_iter: int = 100,
        overlap: bool = True,
        timeout: datetime.timedelta | float | None = None,
        nonfinite: str = "propagate",
        local_world_size: int | None = None,
    ) -> None:
        self._quantization = (bits, group_size, err_beta, reset_T)
        super().__init__(process_group, start_iter, overlap, timeout, nonfinite, local_world_size)

    def _compression_settings(self) -> dict[str, object]:
        names = ("bits", "group_size", "err_beta", "reset_T")
        return dict(zip(names, self._quantization, strict=True))

    def _make_transform(self, comm: ProcessGroup) -> GradientTransformation:
        return loco_allreduce(
            *self._quantization, comm=comm, local_world_size=self.local_world_size
        )


def loco_hook(state: LocoHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: the blockwise-quantized mean of each gradient bucket with LoCo error
    feedback. It communicates as ``fn.collectives.loco_allreduce`` does (quantized
    reduce-scatter, then quantized all-gather; 4 bits send about 1/8 of the fp32 traffic).

    For the first ``state.start_iter`` iterations the bucket is averaged densely (sum, then
    ``/ W``). Then each quantization compensates with its own error buffer of the bucket:

    .. math::
        v = x + e, \\quad q = Q(v), \\quad e' = \\beta e + (1 - \\beta) (v - DQ(q))

    (keyed by the bucket's index; a bucket that DDP rebuilt with other params starts again from
    zero error, with a log line). Use it with any optimizer, e.g. ``torch.optim.AdamW``.

    Overlap and non-finite gradients: as :func:`onebit_hook`.

    Buckets of different sizes on different ranks (DDP rules them out) raise the collective's
    ``ValueError`` on every rank before any chunk is sent, with nothing changed.

    Args:
        state: a :class:`LocoHookState`.
        bucket: DDP's gradient bucket.

    Returns:
        A future holding the bucket's averaged gradients.

    References:
        Xie et al., "LoCo: Low-Bit Communication Adaptor for Large-scale Model Training", 2024
        (arXiv:2407.04480).

    Example:
        One rank here (under ``torchrun`` every rank runs this); the state checkpoints the
        error feedback of each bucket:

        >>> import torch.distributed as dist
        >>> from torch.nn.parallel import DistributedDataParallel as DDP
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = DDP(torch.nn.Linear(4, 1))
        >>> state = fn.ddp.LocoHookState(bits=8, start_iter=0)
        >>> model.register_comm_hook(state, fn.ddp.loco_hook)
        >>> model(torch.ones(2, 4)).sum().backward()  # one compressed iteration
        >>> saved = state.state_dict()  # save it per rank, with the model and the optimizer
        >>> saved["iter"], saved["rank"], [len(b["state"]) for b in saved["buckets"].values()]
        (1, 0, [3])
        >>> dist.destroy_process_group()
    """
    return state.reduce_bucket(bucket)
