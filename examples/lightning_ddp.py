"""fn's 1-bit Adam in a PyTorch Lightning ``Trainer`` with ``strategy="ddp"``, checkpoints and
resume.

    torchrun --nproc-per-node 2 examples/lightning_ddp.py --output-dir DIR --max-steps 40 \
        --freeze-step 10 --save-steps 20 [--ckpt-path DIR/checkpoint-20.ckpt]

(or ``python examples/lightning_ddp.py ...`` alone: Lightning then starts the second process
itself). Trains a small MLP classifier on fixed synthetic data (no downloads), 2 ranks on the
CPU (gloo) or one GPU each, checkpoints every ``--save-steps`` with Lightning's
``ModelCheckpoint`` (``DIR/checkpoint-S.ckpt``) and saves the final weights to
``DIR/final.pt``. A run resumed with ``--ckpt-path DIR/checkpoint-S.ckpt``
(``trainer.fit(model, ckpt_path=...)``) ends with the same params, bit for bit, as the
uninterrupted run, from any step ``S``; every rank ends with the same params (checked). The
only fn-specific lines are the optimizer and ``FnCallback()``.

Resuming in the middle of an epoch needs a resumable data loader, one with ``state_dict`` and
``load_state_dict`` (:class:`ResumableBatches` here; torchdata's ``StatefulDataLoader`` is
one): Lightning restarts a plain ``DataLoader``'s epoch from its first batch (it warns so),
and the resumed run then sees other batches than the uninterrupted one. With a plain
``DataLoader`` resume from checkpoints at the end of an epoch.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning
import torch
from _common import check_ranks_agree, parse_args
from lightning.pytorch.callbacks import ModelCheckpoint

import fn.optim
from fn.collectives import exit_distributed
from fn.integrations.lightning import FnCallback

FEATURES, CLASSES, SAMPLES = 16, 4, 64


class Classifier(lightning.LightningModule):
    """A 2-layer MLP (about 1.2k params) with weights drawn from ``seed``, the same on every
    rank, trained by fn's 1-bit Adam."""

    def __init__(self, lr: float, freeze_step: int | str, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(), torch.nn.Linear(64, CLASSES)
        )
        self.lr, self.freeze_step = lr, freeze_step

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return fn.optim.OnebitAdam(self.parameters(), lr=self.lr, freeze_step=self.freeze_step)


def synthetic_data(samples: int = SAMPLES, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` fixed inputs and the labels of a random linear teacher, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=gen)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    return x, (x @ teacher).argmax(dim=1)


class ResumableBatches:
    """This rank's batches of ``(x, y)``: each epoch a permutation of the rows drawn from the
    epoch's number, cut into batches of ``batch_size`` per rank, dealt round the ranks. Its
    position (epoch, batch) goes into Lightning's checkpoints (``state_dict``), so a run resumed
    in the middle of an epoch continues with the next batch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int, ranks: int):
        self.x, self.y, self.batch_size, self.rank, self.ranks = x, y, batch_size, rank, ranks
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return len(self.x) // (self.batch_size * self.ranks)

    def __iter__(self):
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.epoch))
        while self.position < len(self):
            start = (self.position * self.ranks + self.rank) * self.batch_size
            rows = order[start : start + self.batch_size]
            self.position += 1
            yield self.x[rows], self.y[rows]
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def fit(
    model: lightning.LightningModule, strategy: Any, args: argparse.Namespace
) -> lightning.Trainer:
    """Trains ``model`` under ``strategy`` on 2 ranks (or ``torchrun``'s), with fn's callback
    and a checkpoint every ``args.save_steps``, from ``args.ckpt_path`` if given."""
    gpu = torch.cuda.is_available()
    trainer = lightning.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
        strategy=strategy,
        max_steps=args.max_steps,
        use_distributed_sampler=False,  # ResumableBatches deals the batches round the ranks
        callbacks=[
            FnCallback(),  # the only fn glue
            ModelCheckpoint(
                dirpath=args.output_dir,
                filename="checkpoint-{step}",
                auto_insert_metric_name=False,
                every_n_train_steps=args.save_steps,
                save_top_k=-1,
            ),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    loader = ResumableBatches(
        *synthetic_data(), args.batch_size, trainer.global_rank, trainer.world_size
    )
    trainer.fit(model, loader, ckpt_path=args.ckpt_path)
    return trainer


def main() -> None:
    args = parse_args("1-bit Adam in a PyTorch Lightning Trainer (DDP)", "--ckpt-path")
    model = Classifier(args.lr, args.freeze_step)
    trainer = fit(model, "ddp", args)
    if trainer.is_global_zero:
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.output_dir, "final.pt"))
    check_ranks_agree(model)


if __name__ == "__main__":
    main()
    exit_distributed()  # destroys the group; gloo can abort if interpreter exit tears it down
