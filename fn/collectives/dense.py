"""The uncompressed baseline: a dense allreduce of every update leaf, as a transform."""

from __future__ import annotations

from fn.base import GradientTransformation, stateless
from fn.collectives.comm import Comm
from fn.tree import tree_map

__all__ = ["dense_allreduce"]


def dense_allreduce(*, comm: Comm) -> GradientTransformation:
    """Replaces every update leaf by its mean over the ranks (one full-precision allreduce each).

    .. math::
        u \\leftarrow \\frac{1}{W} \\sum_{i=1}^{W} u_i

    This is plain data parallelism: ``fn.chain(dense_allreduce(comm=c), fn.adam())`` is Adam on
    averaged gradients, the baseline that ``onebit_allreduce`` and ``loco_allreduce`` compress.
    ``None`` leaves pass through.

    Args:
        comm: the communicator.

    Returns:
        A stateless GradientTransformation.

    Example:
        >>> from fn.collectives import Simulated, dense_allreduce, simulate
        >>> comm = Simulated(2)
        >>> tx = dense_allreduce(comm=comm)
        >>> grads = {"w": torch.tensor([[1.0, 2.0], [3.0, 6.0]])}  # row r: rank r's gradient
        >>> state = tx.init(grads)
        >>> simulate(tx.update, comm)(grads, state)[0]
        {'w': tensor([[2., 4.],
                [2., 4.]])}
        >>> comm.bytes_sent  # ring allreduce: 2 (W - 1) / W of the 8 payload bytes per rank
        8
    """

    return stateless(
        lambda updates, params: tree_map(lambda u: comm.all_reduce(u, op="mean"), updates)
    )
