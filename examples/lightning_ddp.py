"""fn's 1-bit Adam in a PyTorch Lightning ``Trainer`` with ``strategy="ddp"``, checkpoints and
resume.

    torchrun --standalone --nproc-per-node 2 lightning_ddp.py --output-dir DIR --max-steps 40 \
        --freeze-step 10 --save-steps 20 [--ckpt-path DIR/checkpoint-20.ckpt]

(or ``python lightning_ddp.py ...`` alone: Lightning then starts the second process itself).
Trains a small MLP classifier on fixed synthetic data (no downloads), 2 ranks on the CPU (gloo)
or one GPU each, checkpoints every ``--save-steps`` with Lightning's ``ModelCheckpoint``
(``DIR/checkpoint-S.ckpt``) and saves the final weights to ``DIR/final.pt``. A run resumed with
``--ckpt-path DIR/checkpoint-S.ckpt`` (``trainer.fit(model, ckpt_path=...)``) ends with the same
params, bit for bit, as the uninterrupted run, from any step ``S``; every rank ends with the
same params (checked). The only fn-specific lines are the optimizer and ``FnCallback()``.

Resuming in the middle of an epoch needs a resumable data loader, one with ``state_dict`` and
``load_state_dict`` (``fn.app.examples.ResumableBatches`` here; torchdata's
``StatefulDataLoader`` is one): Lightning restarts a plain ``DataLoader``'s epoch from its first
batch (it warns so), and the resumed run then sees other batches than the uninterrupted one.
With a plain ``DataLoader`` resume from checkpoints at the end of an epoch.

Needs fn with the ``lightning`` extra. The network and its loss, the data, the arguments, the
Trainer's settings and the final check come from ``fn.app.examples``, so the script runs alone,
downloaded into an empty folder.
"""

from __future__ import annotations

import os

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import fn.optim
from fn.app.examples import (
    ClassifierMixin,
    ResumableBatches,
    check_ranks_agree,
    checkpoint_settings,
    parse_stack_args,
    synthetic_data,
    trainer_settings,
)
from fn.collectives import exit_distributed
from fn.integrations.lightning import FnCallback


class Classifier(ClassifierMixin, lightning.LightningModule):
    """A 2-layer MLP (``self.net``) with weights drawn from ``seed``, the same on every rank,
    and its training step (``ClassifierMixin``), trained by fn's 1-bit Adam."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return fn.optim.OnebitAdam(self.parameters(), lr=self.lr, freeze_step=self.freeze_step)


def main() -> None:
    args = parse_stack_args("1-bit Adam in a PyTorch Lightning Trainer (DDP)", "--ckpt-path")
    model = Classifier(args.lr, args.freeze_step)
    trainer = lightning.Trainer(
        strategy="ddp",
        callbacks=[FnCallback(), ModelCheckpoint(**checkpoint_settings(args))],
        **trainer_settings(args),  # CPU or GPUs, --max-steps, quiet and deterministic
    )
    x, y = synthetic_data()
    loader = ResumableBatches(x, y, args.batch_size, trainer.global_rank, trainer.world_size)
    trainer.fit(model, loader, ckpt_path=args.ckpt_path)
    if trainer.is_global_zero:
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.output_dir, "final.pt"))
    check_ranks_agree(model)


if __name__ == "__main__":
    main()
    exit_distributed()  # destroys the group; gloo can abort if interpreter exit tears it down
