"""``register``: the 1-bit family of ``fn.optim`` on a ``DistributedDataParallel`` model."""

# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fn.ddp._futures import completed, dense_mean
from fn.optim import OnebitAdam, OnebitFamily, OnebitLamb, ZeroOneAdam

__all__ = ["register"]


class _Schedule:
    """What the hook needs to know: the optimizer, DDP's group and each param's group index."""

    def __init__(self, optimizer: OnebitFamily, group: dist.ProcessGroup | None) -> None:
        self.optimizer = optimizer
        self.group = group
        self.group_of = {
            id(p): index for index, g in enumerate(optimizer.param_groups) for p in g["params"]
        }


def _onebit_family_hook(
    schedule: _Schedule, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Averages the gradients of params whose group's next update is a warmup update; sends
    nothing for the others (their optimizer communicates them compressed)."""
    compressed = schedule.optimizer.next_update_compressed()
    buffer = bucket.buffer()
    dense = [not compressed[schedule.group_of[id(p)]] for p in bucket.parameters()]
    if not any(dense):
        return completed(buffer)
    if all(dense):
        return dense_mean(buffer, schedule.group)
    # Param groups in different phases share the bucket: average only the warmup groups' part.
    grads = [g for g, d in zip(bucket.gradients(), dense, strict=True) if d]

    def scatter(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        pieces = future.value().split([g.numel() for g in grads])
        for g, piece in zip(grads, pieces, strict=True):
            g.copy_(piece.view_as(g))
        return buffer

    return dense_mean(torch.cat([g.reshape(-1) for g in grads]), schedule.group).then(scatter)


def register(ddp_model: DistributedDataParallel, optimizer: OnebitFamily) -> None:
    """Attaches a 1-bit family optimizer to the ``DistributedDataParallel`` model it trains.

    Registers a DDP comm hook that makes DDP's gradient communication follow the optimizer's
    schedule, decided before each backward pass for the optimizer's next update ``t`` (a pure
    function of the update count, the same on every rank):

    - warmup update (``not optimizer.next_update_compressed()``): DDP averages the gradients
      (overlapped with the backward pass, bucket by bucket), and the optimizer takes them as
      averaged: its dense mean becomes the identity;
    - compressed update (1-bit Adam and 1-bit LAMB after ``freeze_step``; 0/1 Adam's 1-bit,
      local and synchronization updates): DDP sends nothing and each ``.grad`` keeps the local
      gradient; the optimizer's 1-bit collectives are the only gradient traffic.

    The compressed updates' 1-bit allreduce runs in ``optimizer.step()``, not overlapped with
    the backward pass: it compresses each param group's momentum as one flat buffer (README.md,
    "With DDP", says why). So the run equals the same run without DDP: bit for bit with fp32/fp64
    params on two ranks, to rounding with more ranks (DDP's buckets and fn's flat gradient may
    sum in other orders) or fp16/bf16 params (DDP averages in their dtype, fn in fp32). Param
    groups in different phases (e.g. per-group ``freeze_step``) are handled per param.

    Non-finite gradients: the hook decides nothing (a warmup update's dense mean is non-finite
    on every rank where some rank's gradient is; compressed updates send nothing), so the
    optimizer's ``nonfinite`` policy applies in both phases, the same on every rank; so it does
    to a value written into one rank's ``.grad`` after DDP averaged it (the step's vote counts
    them). The hook never raises: where ``param_groups`` holds an invalid hyperparameter, it
    follows the schedule of the last update, and ``step()`` raises.

    Gradient accumulation: run the micro-batches but the last under ``ddp_model.no_sync()`` and
    call ``optimizer.step()`` once per accumulated batch: the hook runs (averaging or not) on the
    accumulated gradients of the last backward pass. A ``step()`` after backward passes that all
    ran under ``no_sync()`` would treat local gradients as averaged in warmup updates: don't.

    Args:
        ddp_model: a ``DistributedDataParallel`` model without a comm hook.
        optimizer: an ``fn.optim.OnebitAdam``, ``ZeroOneAdam`` or ``OnebitLamb`` whose params
            are exactly the trainable params of ``ddp_model`` and whose comm spans the same
            ranks as DDP's process group, or a wrapper of one that holds it as ``.optimizer``
            (e.g. Accelerate's ``AcceleratedOptimizer``). Build it before or after wrapping the
            model (before, for a ``channels_last`` model, whose memory format the optimizer's
            flat buffers drop: docs/torch-optim.md); register before the first backward pass.

    Raises:
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel``, or ``optimizer`` is not of
            the 1-bit family (for another optimizer use ``fn.ddp.onebit_hook`` or
            ``fn.ddp.loco_hook``).
        RuntimeError: the optimizer was registered with another DDP model already, or the
            model has a comm hook. Registering it again with the same model does nothing.
        ValueError: the params or the world sizes differ.

    Example:
        One rank here (under ``torchrun`` every rank runs the same code):

        >>> import torch.distributed as dist
        >>> from torch.nn.parallel import DistributedDataParallel as DDP
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = DDP(torch.nn.Linear(4, 1))
        >>> opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=100)
        >>> fn.ddp.register(model, opt)
        >>> opt.zero_grad()
        >>> model(torch.ones(2, 4)).sum().backward()
        >>> opt.step()
        >>> dist.destroy_process_group()
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"fn.ddp.register: ddp_model must be a DistributedDataParallel, got "
            f"{type(ddp_model).__name__}"
        )
    while not isinstance(optimizer, OnebitFamily) and isinstance(
        getattr(optimizer, "optimizer", None), torch.optim.Optimizer
    ):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, OnebitFamily):
        names = ", ".join(c.__name__ for c in (OnebitAdam, ZeroOneAdam, OnebitLamb))
        raise TypeError(
            f"fn.ddp.register: optimizer must be one of fn.optim's {names}, got "
            f"{type(optimizer).__name__} (other optimizers: register fn.ddp.onebit_hook or "
            "fn.ddp.loco_hook with ddp_model.register_comm_hook)"
        )
    if optimizer.takes_averaged_grads:
        if any(
            isinstance(state, _Schedule) and state.optimizer is optimizer
            for _, state in ddp_model._comm_hooks
        ):
            return  # this model already: e.g. a second Trainer.train() on the same DDP model
        raise RuntimeError(
            "fn.ddp.register: this optimizer is registered with another DDP model already"
        )
    if ddp_model._comm_hooks:
        raise RuntimeError(
            "fn.ddp.register: ddp_model has a comm hook already (DDP takes one hook per model)"
        )
    trainable = [p for p in ddp_model._module_parameters if p.requires_grad]  # what DDP averages
    ddp_ids = {id(p) for p in trainable}
    opt_ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if ddp_ids != opt_ids:
        raise ValueError(
            f"fn.ddp.register: the optimizer's params are not the DDP model's trainable params "
            f"({len(opt_ids - ddp_ids)} of the optimizer's {len(opt_ids)} params are not in the "
            f"model, {len(ddp_ids - opt_ids)} of the model's {len(ddp_ids)} are not in the "
            "optimizer): one fn.optim optimizer holds every trainable param of the DDP model "
            "(not two, nor one beside a torch.optim optimizer)"
        )
    world_size = dist.get_world_size(ddp_model.process_group)
    if optimizer.comm.world_size != world_size:
        raise ValueError(
            f"fn.ddp.register: the optimizer's comm has world_size {optimizer.comm.world_size}, "
            f"DDP's process group {world_size}"
        )
    schedule = _Schedule(optimizer, ddp_model.process_group)
    ddp_model.register_comm_hook(schedule, _onebit_family_hook)
    optimizer.take_averaged_grads(trainable)
