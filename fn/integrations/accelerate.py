"""``accelerate`` glue: :func:`attach`.

Example (under ``torchrun``; the full script is ``examples/accelerate_loop.py``)::

    accelerator = Accelerator()  # initializes torch.distributed
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=100)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    fn.integrations.accelerate.attach(accelerator, model, opt)
    ...  # accelerator.backward(loss); opt.step(); accelerator.save_state() / load_state()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fn.integrations._common import register_ddp, unwrap_optimizer

__all__ = ["attach"]


def attach(
    accelerator: Any, model: torch.nn.Module, optimizer: Any, *, max_steps: int | None = None
) -> Any:
    """Connects an ``fn.optim`` optimizer to a prepared model and its ``Accelerator``.

    - ``fn.ddp.register(model, optimizer)`` when ``accelerator.prepare`` wrapped the model in DDP
      (DDP then averages in warmup and is silent once compressed).
    - A save-state pre-hook gathers every rank's error feedback on rank 0 before
      ``accelerator.save_state()`` (which keeps rank 0's optimizer state and loads it on every
      rank), so ``accelerator.load_state()`` resumes every rank bit for bit.
    - With ``max_steps``, a warning when no update within it would be compressed
      (``FunctionalOptimizer.warn_if_never_compressed``).

    ``accelerator.clip_grad_norm_`` acts on the averaged gradient in the warmup and on each
    rank's local gradient, with that rank's own factor, once compressed; the optimizer's
    ``max_grad_norm=`` clips by one factor on every rank (docs/guides/accelerate.md).

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the model returned by ``accelerator.prepare``.
        optimizer: the optimizer returned by ``accelerator.prepare`` (or the ``fn.optim``
            optimizer itself).
        max_steps: the number of optimizer updates the run makes (the ``num_training_steps`` a
            scheduler gets), or ``None`` when unknown.

    Returns:
        The handle of the save-state hook (``handle.remove()`` detaches it).

    Raises:
        TypeError: ``optimizer`` does not hold an ``fn.optim`` optimizer, or ``model`` is not
            DDP-wrapped while Accelerate runs several processes with DDP (``attach`` was called
            before ``accelerator.prepare``, or with the model that ``prepare`` was given rather
            than the one it returned): raised on every rank.
        NotImplementedError: (from ``accelerator.save_state()``, on every rank, nothing saved)
            ``ProjectConfiguration(save_on_each_node=True)`` on several nodes: each node's
            first rank would write an optimizer state, and only rank 0's holds every rank's
            error feedback.

    Example:
        One process (under ``accelerate launch`` the same lines register the DDP model):

        >>> import tempfile, accelerate
        >>> from fn.integrations.accelerate import attach
        >>> accelerator = accelerate.Accelerator(cpu=True)
        >>> model = torch.nn.Linear(3, 2)
        >>> opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
        >>> model, opt = accelerator.prepare(model, opt)
        >>> handle = attach(accelerator, model, opt, max_steps=10)
        >>> model(torch.ones(1, 3)).sum().backward()
        >>> opt.step()
        >>> _ = accelerator.save_state(tempfile.mkdtemp())  # every rank's error feedback in it
        >>> handle.remove()
    """
    fn_optimizer = unwrap_optimizer(optimizer)
    if not register_ddp(model, fn_optimizer) and _wraps_in_ddp(accelerator):
        raise TypeError(
            "fn.integrations.accelerate.attach: the model is not the DistributedDataParallel "
            f"module that accelerator.prepare returns (got {type(model).__name__}) while "
            f"Accelerate runs {accelerator.num_processes} processes with DDP: call "
            "accelerator.prepare(model, optimizer, ...) first, then attach(accelerator, model, "
            "optimizer) with the model and optimizer it returned (else DDP averages every "
            "gradient densely all run)"
        )
    if max_steps is not None:
        fn_optimizer.warn_if_never_compressed(max_steps, "max_steps")

    def gather_before_save(models: list, weights: list, output_dir: str) -> None:
        del models, weights, output_dir
        _check_one_writer(accelerator)
        fn_optimizer.gather_error_feedback()

    return accelerator.register_save_state_pre_hook(gather_before_save)


def _wraps_in_ddp(accelerator: Any) -> bool:
    """Whether ``accelerator.prepare`` wraps a model in ``DistributedDataParallel`` (several
    processes, a ``MULTI_*`` distributed type: not FSDP, DeepSpeed or Megatron)."""
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    return accelerator.num_processes > 1 and kind.startswith("MULTI_")


def _check_one_writer(accelerator: Any) -> None:
    """Refuses a save in which more than one process writes the optimizer state (with
    ``save_on_each_node``, every node's first process; a collective call where it is set).

    Raises:
        NotImplementedError: on every rank, several processes would write it.
    """
    if not accelerator.project_configuration.save_on_each_node or not dist.is_initialized():
        return
    writers = torch.tensor([int(accelerator.is_local_main_process)])
    dist.all_reduce(writers)
    if int(writers) > 1:
        raise NotImplementedError(
            "fn.integrations.accelerate: save_state() with save_on_each_node=True on "
            f"{int(writers)} nodes is not built: fn gathers every rank's error feedback onto "
            "rank 0, whose optimizer state every rank loads, so the other nodes' copies would "
            "resume their ranks with the error feedback reset; save to storage that every node "
            "reads, with save_on_each_node=False; nothing was saved"
        )
