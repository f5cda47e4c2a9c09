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
      a new best metric (``"best"``: the gather then follows every evaluation); any callback
      may also set ``control.should_save`` in ``on_step_end``, ``on_epoch_end``, ``on_log`` or
      ``on_evaluate`` (the same on every rank: the gather is a collective). This callback
      moves itself after every other at train begin, so it sees those requests.

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
        self._gathered_step: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Moves this callback after every other one, registers the DDP-wrapped model with the
        optimizer, and warns if the compressed phase would never start within
        ``state.max_steps``."""
        # Where the gather goes: the Trainer saves in _maybe_log_save_evaluate, which follows
        # on_step_end (or on_epoch_end) and runs, in order, on_log (when it logs), on_evaluate
        # (when it evaluates), the "best" decision, then _save_checkpoint (rank 0 alone writes
        # the optimizer state; every rank gets there). Any callback may set should_save in any
        # of these events, so the gather runs in each of them where should_save is set, and this
        # callback runs last in each: here it moves to the end of the handler's list (callbacks
        # added after attach() included). A new list, not an in-place move: call_event is
        # iterating over the old one now.
        handler = self.trainer.callback_handler
        handler.callbacks = [c for c in handler.callbacks if c is not self] + [self]
        self._gathered_step = None
        optimizer = unwrap_optimizer(self.trainer.optimizer)
        register_ddp(self.trainer.model_wrapped, optimizer)
        if state.max_steps > 0:
            optimizer.warn_if_never_compressed(state.max_steps, "the Trainer's max_steps")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Gathers the error feedback into rank 0's optimizer state before a checkpoint."""
        self._gather_if_saving(state, control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """As :meth:`on_step_end`: ``save_strategy="epoch"`` decides at the end of an epoch."""
        self._gather_if_saving(state, control)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """As :meth:`on_step_end`, for a save that a callback requests when the Trainer logs."""
        self._gather_if_saving(state, control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """As :meth:`on_step_end`; with ``save_strategy="best"`` always, since the Trainer
        decides to save a new best metric's checkpoint after this callback."""
        self._gather_if_saving(state, control, always=args.save_strategy == "best")

    def _gather_if_saving(self, state: Any, control: Any, *, always: bool = False) -> None:
        # once per update: the error feedback changes only in optimizer.step()
        if (always or control.should_save) and self._gathered_step != state.global_step:
            unwrap_optimizer(self.trainer.optimizer).gather_error_feedback()
            self._gathered_step = state.global_step


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
