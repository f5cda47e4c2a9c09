"""SparseLoCo's outer rule: an error-feedback accumulator in place of the outer momentum, sent as
chunk-wise top-k in 2 bits."""

from __future__ import annotations

from fn.base import GradientTransformation
from fn.collectives import Comm, topk_allreduce
from fn.collectives.header import compressor_chain
from fn.errors import check_closed_fraction, check_lr
from fn.transforms import scale_by_learning_rate

__all__ = ["sparseloco"]


def sparseloco(
    lr: float = 2.0,
    beta: float = 0.95,
    k: int = 64,
    chunk_size: int = 4096,
    *,
    comm: Comm,
    exchange: str = "auto",
    server_k: int | None = None,
    round_trip_bytes: int = 0,
) -> GradientTransformation:
    """SparseLoCo's outer rule (Sarfi et al. 2025, arXiv:2508.15706): no outer momentum; each
    rank's accumulator takes the pseudo-gradient, sends its chunk-wise top-``k`` and keeps the
    rest.

    .. math::
        v_r = \\beta e_r + \\delta_r, \\qquad c_r = T(v_r), \\qquad e_r' = v_r - c_r, \\qquad
        u = -\\eta \\frac{1}{W} \\sum_r c_r

    ``chain(fn.collectives.topk_allreduce(k, chunk_size, comm=comm, decay=beta,
    exchange=exchange, server_k=server_k, round_trip_bytes=round_trip_bytes),
    fn.scale_by_learning_rate(lr))``: the accumulator
    ``e_r`` is the compressor's error feedback, ``state[0].error`` (per rank, fp32, like the
    params). With the owner-partitioned exchange (``exchange="owner"``, or ``"auto"`` where it
    sends fewer bytes: ``fn.collectives.topk_exchange_form``), each owner compresses the mean of
    its chunks again, to ``server_k`` values per chunk, with an error feedback of its own,
    ``state[0].server_error``, and ``u`` is ``-eta`` times that second compression.

    The outer learning rate defaults to 2, where the paper takes 1: at 1/32 and 1/64 of the
    values the accumulator holds back most of each pseudo-gradient and delivers it over many
    outer steps, and the step is the mean of what was sent, no more, where dense DiLoCo's
    Nesterov step grows to ``0.7 / (1 - 0.9) = 7`` times a steady mean. At the inner learning
    rate dense DiLoCo wants, ``lr=2`` gave a lower held-out loss than ``lr=1`` on each of three
    tasks at 4 and 16 workers, after 20 and after 100 outer steps (``benchmarks/README.md``,
    "diloco_quality.py"); ``lr=1`` is the paper's rule, which wants about three times the inner
    learning rate instead.

    Args:
        lr: the outer learning rate ``eta`` (1: the step is the mean of the compressed
            accumulators, SparseLoCo's own setting).
        beta: the accumulator's decay, in [0, 1].
        k: values kept per chunk.
        chunk_size: values per chunk, a power of two from 2 to 2^16.
        comm: the group of workers.
        exchange: how the messages are averaged, one of ``fn.collectives.TOPK_EXCHANGES``.
        server_k: the values an owner keeps per chunk (``None``: ``k``); not with
            ``exchange="gather"``.
        round_trip_bytes: with ``exchange="auto"``, the bytes per worker that the owners'
            second round trip is worth on the link (``fn.collectives.topk_exchange_form``).

    Returns:
        A GradientTransformation from this rank's pseudo-gradient to the anchor's update; its
        state is ``(TopkAllreduceState or TopkOwnerState, ScaleByLearningRateState)``.

    Raises:
        ValueError: for settings out of range.

    Example:
        >>> from fn.collectives import Local
        >>> outer = fn.diloco.sparseloco(beta=0.5, k=1, chunk_size=2, comm=Local())
        >>> delta = {"w": torch.tensor([4.0, 1.0])}
        >>> state = outer.init(delta)
        >>> updates, state = outer.update(delta, state)
        >>> updates["w"], state[0].error["w"]  # 4 sent as 3 M / 4, times lr 2; the rest kept
        (tensor([-6., -0.]), tensor([1., 1.]))
        >>> updates, state = outer.update(delta, state)  # v = 0.5 e + delta = [4.5, 1.5]
        >>> updates["w"], state[0].error["w"]
        (tensor([-6.7500, -0.0000]), tensor([1.1250, 1.5000]))
    """
    check_lr("sparseloco", lr)
    check_closed_fraction("sparseloco", beta=beta)
    compressor = topk_allreduce(
        k,
        chunk_size,
        comm=comm,
        decay=beta,
        exchange=exchange,
        server_k=server_k,
        round_trip_bytes=round_trip_bytes,
    )
    return compressor_chain(compressor, scale_by_learning_rate(lr))
