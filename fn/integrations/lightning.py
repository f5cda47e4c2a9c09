"""PyTorch Lightning glue: :class:`FnCallback`.

Example (under ``torchrun``; the full script is ``examples/lightning_ddp.py``)::

    class Model(lightning.LightningModule):
        ...
        def configure_optimizers(self):
            return fn.optim.OnebitAdam(self.parameters(), lr=1e-3, freeze_step=100)

    trainer = lightning.Trainer(strategy="ddp", callbacks=[FnCallback()], ...)
    trainer.fit(Model())  # or trainer.fit(Model(), ckpt_path=...): every rank resumes exactly
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from fn.integrations._common import register_ddp, unwrap_optimizer
from fn.optim import FunctionalOptimizer, OnebitFamily

__all__ = ["FnCallback", "check_strategy"]

# Strategies that shard or average the gradients themselves, with what to use instead.
_UNSUPPORTED = (
    (
        FSDPStrategy,
        "Lightning's FSDPStrategy shards the params and reduce-scatters the gradients itself",
    ),
    (
        ModelParallelStrategy,
        "Lightning's ModelParallelStrategy (FSDP2 / tensor parallel) shards the params and "
        "reduce-scatters the gradients itself",
    ),
    (DeepSpeedStrategy, "Lightning's DeepSpeedStrategy averages the gradients itself"),
)


def check_strategy(strategy: Any, optimizer: FunctionalOptimizer) -> None:
    """Raises unless ``optimizer`` can run under the Lightning ``strategy``.

    fn.optim's 1-bit family communicates the gradients itself, over whole param groups. Under
    ``strategy="ddp"`` (any ``DDPStrategy``) ``fn.ddp.register`` makes DDP step aside in the
    compressed phase; the sharded strategies (FSDP, FSDP2 via ``ModelParallelStrategy``,
    DeepSpeed) hold only a shard of each param and gradient, for which ``fn.optim`` has no
    1-bit optimizer.

    Args:
        strategy: the trainer's strategy (``trainer.strategy``).
        optimizer: an ``fn.optim`` optimizer of the run.

    Raises:
        NotImplementedError: a 1-bit family optimizer under a sharded strategy, naming what to
            use instead.

    Example:
        >>> import torch
        >>> from lightning.pytorch.strategies import FSDPStrategy, SingleDeviceStrategy
        >>> from fn.collectives import Local
        >>> opt = fn.optim.OnebitAdam(torch.nn.Linear(2, 1).parameters(), comm=Local())
        >>> check_strategy(SingleDeviceStrategy("cpu"), opt)
        >>> check_strategy(FSDPStrategy(), opt)
        Traceback (most recent call last):
        ...
        NotImplementedError: fn.integrations.lightning: OnebitAdam cannot run under ...
    """
    if not isinstance(optimizer, OnebitFamily):
        return
    for kind, why in _UNSUPPORTED:
        if isinstance(strategy, kind):
            raise NotImplementedError(
                f"fn.integrations.lightning: {type(optimizer).__name__} cannot run under "
                f"{type(strategy).__name__}: {why}, and fn.optim's 1-bit family needs whole "
                "params and local gradients. Use Trainer(strategy='ddp') with it; for a sharded "
                "model, fn.fsdp.OnebitAdam runs 1-bit Adam on FSDP2 in a plain training loop "
                "(not through Lightning's strategies yet), and a torch optimizer with "
                "fn.fsdp.loco_reduce_scatter sends 4-bit gradients under any FSDP2 setup"
            )


def _fn_optimizers(trainer: Trainer) -> list[tuple[int, FunctionalOptimizer]]:
    """``(index in trainer.optimizers, fn.optim optimizer)`` for each of the trainer's
    ``fn.optim`` optimizers.

    Raises:
        TypeError: the trainer has none.
    """
    found = []
    for index, optimizer in enumerate(trainer.optimizers):
        try:
            found.append((index, unwrap_optimizer(optimizer)))
        except TypeError:
            continue
    if not found:
        names = [type(o).__name__ for o in trainer.optimizers] or "no optimizer"
        raise TypeError(
            "fn.integrations.lightning.FnCallback needs an fn.optim optimizer (e.g. "
            f"fn.optim.OnebitAdam) from configure_optimizers, got {names}"
        )
    return found


class FnCallback(Callback):
    """Connects the ``fn.optim`` optimizers of a Lightning run to its strategy:
    ``Trainer(callbacks=[FnCallback()])``.

    - At fit start (after the strategy wrapped the model in DDP and built the optimizers,
      before the first backward pass and before a checkpoint's optimizer state is loaded):
      checks the strategy (:func:`check_strategy`), passes the DDP model
      (``trainer.strategy.model``, under ``strategy="ddp"`` and its variants) to
      ``fn.ddp.register`` (DDP then averages in warmup and is silent once compressed), and
      warns when no update within the run's ``trainer.estimated_stepping_batches`` would be
      compressed (``FunctionalOptimizer.warn_if_never_compressed``).
    - On every checkpoint (``on_save_checkpoint``, which Lightning runs on every rank while it
      builds the checkpoint that rank 0 writes): gathers every rank's error feedback into rank
      0's optimizer state (``gather_error_feedback``, a collective) and puts that state into
      the checkpoint, so ``trainer.fit(model, ckpt_path=...)`` resumes every rank bit for bit.

    Example:
        One process, no DDP (under ``torchrun`` with ``strategy="ddp"`` the same lines register
        the DDP model):

        >>> import lightning, torch
        >>> class Model(lightning.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Linear(4, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         return self.net(batch[0]).pow(2).mean()
        ...     def configure_optimizers(self):
        ...         return fn.optim.OnebitAdam(self.parameters(), lr=1e-2, freeze_step=2)
        >>> data = torch.utils.data.TensorDataset(torch.randn(8, 4))
        >>> trainer = lightning.Trainer(
        ...     accelerator="cpu", devices=1, max_steps=4, callbacks=[FnCallback()],
        ...     logger=False, enable_checkpointing=False, enable_progress_bar=False,
        ...     enable_model_summary=False)
        >>> trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=2))
        >>> trainer.global_step
        4
    """

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Checks the strategy, registers the DDP model with the optimizer, and warns if no
        update within the run would be compressed."""
        del pl_module
        steps = trainer.estimated_stepping_batches
        for _, optimizer in _fn_optimizers(trainer):
            check_strategy(trainer.strategy, optimizer)
            register_ddp(trainer.strategy.model, optimizer)
            if math.isfinite(steps):
                optimizer.warn_if_never_compressed(
                    int(steps), "the Trainer's estimated_stepping_batches"
                )

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Gathers every rank's error feedback and saves rank 0's optimizer state with it."""
        del pl_module
        for index, optimizer in _fn_optimizers(trainer):
            optimizer.gather_error_feedback()
            # Lightning takes the optimizer states before it calls this hook: take them again.
            states = checkpoint.get("optimizer_states")
            if states is not None:
                states[index] = trainer.strategy.optimizer_state(trainer.optimizers[index])
