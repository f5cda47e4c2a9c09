"""Hugging Face ``Trainer`` glue: :func:`attach` and :class:`FnTrainerCallback`.

Example (under ``torchrun``; the full script is ``examples/hf_trainer.py``)::

    args = TrainingArguments(output_dir, save_steps=50, ...)  # initializes torch.distributed
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=100)
    trainer = Trainer(model, args, train_dataset=data, optimizers=(opt, scheduler))
    fn.integrations.transformers.attach(trainer)
    trainer.train()  # or trainer.train(resume_from_checkpoint=...): every rank resumes exactly
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer, TrainerCallback

from fn.integrations._common import register_ddp, unwrap_optimizer

__all__ = ["FnTrainerCallback", "attach"]


class FnTrainerCallback(TrainerCallback):
    """Connects ``trainer``'s ``fn.optim`` optimizer to the ``Trainer``.

    - At train begin: ``fn.ddp.register(trainer.model_wrapped, optimizer)`` when the Trainer
      wrapped the model in DDP (DDP then averages in warmup and is silent once compressed), and
      a warning when no update within the run's ``max_steps`` would be compressed
      (``FunctionalOptimizer.warn_if_never_compressed``).
    - Before every checkpoint the Trainer saves: every rank's error feedback is gathered on
      rank 0 (``gather_error_feedback``), so the optimizer state that rank 0 saves alone resumes
      every rank bit for bit. The Trainer decides to save at the end of a step
      (``save_strategy="steps"``), of an epoch (``"epoch"``), or after an evaluation that found
      a new best metric (``"best"``: the gather then follows every evaluation).

    The Trainer's ``max_grad_norm`` (``clip_grad_norm_`` on ``.grad`` before every step) is left
    as it is: it acts on the averaged gradient in the warmup and on each rank's local gradient,
    with that rank's own factor, once compressed. For one factor on every rank, build the
    optimizer with ``max_grad_norm=`` and set ``TrainingArguments(max_grad_norm=0)``
    (docs/guides/hf-trainer.md).

    Args:
        trainer: the ``Trainer`` (its optimizer must be an ``fn.optim`` optimizer).

    Example:
        :func:`attach` adds it; by hand:

        >>> import tempfile, transformers
        >>> from fn.integrations.transformers import FnTrainerCallback
        >>> model = torch.nn.Linear(2, 1)
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), use_cpu=True, report_to=[])
        >>> opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=100)
        >>> trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, None))
        >>> trainer.add_callback(FnTrainerCallback(trainer))
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Registers the DDP-wrapped model with the optimizer; warns if the compressed phase
        would never start within ``state.max_steps``."""
        optimizer = unwrap_optimizer(self.trainer.optimizer)
        register_ddp(self.trainer.model_wrapped, optimizer)
        if state.max_steps > 0:
            optimizer.warn_if_never_compressed(state.max_steps, "the Trainer's max_steps")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Gathers the error feedback into rank 0's optimizer state before a checkpoint."""
        if control.should_save:
            self._gather()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """As :meth:`on_step_end`: ``save_strategy="epoch"`` decides at the end of an epoch."""
        if control.should_save:
            self._gather()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Gathers the error feedback where the Trainer saves a new best metric's checkpoint
        (``save_strategy="best"``), decided after this callback."""
        if args.save_strategy == "best":
            self._gather()

    def _gather(self) -> None:
        unwrap_optimizer(self.trainer.optimizer).gather_error_feedback()


def attach(trainer: Trainer) -> FnTrainerCallback:
    """Adds a :class:`FnTrainerCallback` to ``trainer`` (call it before ``trainer.train()``).

    Args:
        trainer: a ``Trainer`` built with ``optimizers=(an fn.optim optimizer, scheduler)``.

    Returns:
        The callback.

    Raises:
        TypeError: the trainer's optimizer is not an ``fn.optim`` optimizer, or the Trainer has
            none yet (``optimizer_cls_and_kwargs``: it builds that one inside ``train()``).

    Example:
        One process, no DDP (under ``torchrun`` the same lines register the DDP model):

        >>> import tempfile, transformers
        >>> from fn.integrations.transformers import attach
        >>> class Model(torch.nn.Module):  # a Trainer model: its forward returns the loss
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = torch.nn.Linear(4, 1)
        ...     def forward(self, x):
        ...         return {"loss": self.net(x).pow(2).mean()}
        >>> model, data = Model(), [{"x": torch.randn(4)} for _ in range(8)]
        >>> args = transformers.TrainingArguments(
        ...     tempfile.mkdtemp(), max_steps=4, use_cpu=True, report_to=[], disable_tqdm=True)
        >>> opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
        >>> trainer = transformers.Trainer(model, args, train_dataset=data, optimizers=(opt, None))
        >>> callback = attach(trainer)
        >>> trainer.remove_callback(transformers.PrinterCallback)  # no log lines here
        >>> _ = trainer.train()
        >>> trainer.state.global_step, opt.next_update_compressed()
        (4, [True])
    """
    if trainer.optimizer is None:
        raise TypeError(
            "fn.integrations.transformers.attach: the Trainer has no optimizer yet (with "
            "optimizer_cls_and_kwargs it builds one inside train(), after attach): build the "
            "fn.optim optimizer yourself and pass Trainer(..., optimizers=(optimizer, "
            "scheduler))"
        )
    unwrap_optimizer(trainer.optimizer)
    callback = FnTrainerCallback(trainer)
    trainer.add_callback(callback)
    return callback
