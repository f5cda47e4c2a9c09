"""Gradients that something averaged before ``step()``: a DDP model that fn was not told about
(the policy and its cost: :mod:`fn.optim`).

An ``fn.optim`` optimizer that communicates its gradients itself expects each rank's ``.grad`` to
hold its LOCAL gradient; under ``DistributedDataParallel`` (directly, or by Lightning, Hugging
Face ``Trainer`` or ``accelerate``) without ``fn.ddp.register``, DDP averages every gradient
densely too, and a 1-bit optimizer's compressed phase saves nothing. DDP's allreduce leaves the
same bits on every rank, while local gradients of different batches never agree in all of the
fingerprints of :func:`averaged_already`: bit-identical, non-zero gradients were averaged before
the optimizer saw them (or every rank trained on the same batch), and :func:`warn_if_averaged`
says so once, with the fix. (Looking for a DDP module that holds the params through ``gc``
referrers instead would walk every object of the process, read DDP's private attributes and
know no other wrapper.)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from fn.base import CompressedOptimizer
from fn.collectives.agreement import bit_checksum
from fn.errors import user_stacklevel

_REGISTER_FIX = (
    "hand the DDP model to fn.ddp.register(ddp_model, opt) before the first backward pass (DDP "
    "then averages only in warmup and is silent once compressed), or use the integration that "
    "does it: PyTorch Lightning Trainer(callbacks=[fn.integrations.lightning.FnCallback()]), "
    "Hugging Face fn.integrations.transformers.attach(trainer), accelerate "
    "fn.integrations.accelerate.attach(accelerator, model, opt)"
)
_SYNC_FIX = (
    "build the optimizer with sync_grads=False when DDP averages the gradients, or do not wrap "
    "the model in DDP"
)


def communicates_gradients(optimizer: Any) -> bool:
    """Whether ``optimizer`` (an ``fn.optim.FunctionalOptimizer``) averages its gradients over
    the ranks itself: some group's gradients are averaged by the adapter (``sync_grads``) or go
    to a ``CompressedOptimizer`` that was not told that they arrive averaged
    (``fn.ddp.register``)."""
    registered = getattr(optimizer, "takes_averaged_grads", False)
    return any(
        runtime.sync or (isinstance(runtime.transform, CompressedOptimizer) and not registered)
        for runtime in optimizer.group_runtimes
    )


def _fingerprint(g: torch.Tensor) -> torch.Tensor:
    """int64 ``[bit checksum of all elements, of the odd elements, any element non-zero]``."""
    g = g.detach().reshape(-1)
    nonzero = (torch.count_nonzero(g) > 0).to(torch.int64)
    return torch.stack([bit_checksum(g), bit_checksum(g[1::2]), nonzero])


def averaged_already(comm: Any, grads: Sequence[torch.Tensor]) -> bool:
    """Whether every rank holds the same gradients, bit for bit, and some are non-zero (one
    all_gather of ``3 * len(grads)`` int64 per rank; a collective: every rank must call it).

    Args:
        comm: the optimizer's communicator (more than one rank).
        grads: this rank's gathered gradient of every param group.

    Returns:
        The same answer on every rank.
    """
    if not grads:
        return False
    device = grads[0].device
    rows = torch.stack([_fingerprint(g).to(device) for g in grads])
    gathered = comm.all_gather(rows.reshape(-1)).view(comm.world_size, len(grads), 3).cpu()
    same = (gathered == gathered[0]).all()
    return bool(same) and bool(gathered[0, :, 2].any())


def warn_if_averaged(optimizer: Any, grads: Sequence[torch.Tensor]) -> bool:
    """Warns once (``UserWarning``, on every rank) when ``optimizer`` averages its gradients
    itself but they arrived averaged already (:func:`averaged_already`): a DDP model that was
    not passed to ``fn.ddp.register``, or every rank trained on the same batch.

    Nothing happens with one rank or when the optimizer does not average (registered with
    DDP, or ``sync_grads=False``).

    Args:
        optimizer: an ``fn.optim.FunctionalOptimizer`` at its first ``step()``.
        grads: its gathered gradient of every param group.

    Returns:
        Whether it warned.
    """
    comm = optimizer.comm
    if comm.world_size == 1 or not communicates_gradients(optimizer):
        return False
    if not averaged_already(comm, grads):
        return False
    onebit = any(isinstance(r.transform, CompressedOptimizer) for r in optimizer.group_runtimes)
    cost = (
        "DDP averages every gradient densely, in the compressed phase too, so the 1-bit "
        "compression saves no traffic"
        if onebit
        else "the optimizer averages them a second time (as much traffic again)"
    )
    warnings.warn(
        f"fn.optim: the gradients of {type(optimizer).__name__}'s first step are bit-identical "
        f"on all {comm.world_size} ranks: they were averaged before step(), most likely by a "
        f"DistributedDataParallel model that fn was not told about; {cost}. Fix: "
        f"{_REGISTER_FIX if onebit else _SYNC_FIX}. (If every rank trains on the same batch on "
        "purpose, ignore this; it is checked once.)",
        stacklevel=user_stacklevel(),
    )
    return True
