"""Run under ``torchrun`` by test_lightning_ddp_accumulation.py: ``fn.optim.OnebitAdam`` in
Lightning's DDP with ``accumulate_grad_batches=ACCUMULATE`` and ``gradient_clip_val=CLIP``
(examples/lightning_ddp.py's model and loader, the loss scaled so that the clipping acts), on
every rank.

    torchrun --nproc-per-node 2 tests/integrations/_lightning_ddp_accumulation.py OUT_DIR

- ``full``: an uninterrupted run of ``STEPS`` updates, a checkpoint after every update: the
  final params, and what the optimizer and the trainer held during and after the fit;
- ``bare``: the same updates in a plain loop: DDP with ``fn.ddp.register``,
  ``OnebitAdam(max_grad_norm=CLIP)``, the micro-batches but the last under ``no_sync()``, each
  loss divided by ``ACCUMULATE`` as Lightning does; ``unclipped``: the same without clipping;
- ``resumed``: per checkpoint in ``RESUME``, a new model and trainer resumed from it to
  ``STEPS``: the final params.

Writes ``OUT_DIR/rank<r>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from lightning_ddp import Classifier  # noqa: E402

import fn.ddp  # noqa: E402
import fn.optim  # noqa: E402
from fn.app.examples import ResumableBatches, synthetic_data  # noqa: E402
from fn.collectives import exit_distributed  # noqa: E402
from fn.integrations.lightning import FnCallback  # noqa: E402

STEPS, FREEZE, BATCH, LR, ACCUMULATE, CLIP, SCALE = 6, 3, 4, 1e-2, 4, 1.0, 20.0
RESUME = (2, 4)  # the last warmup update; a compressed one


class Scaled(Classifier):
    """The example's classifier with its loss times ``SCALE`` (gradient norms above ``CLIP``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * SCALE


class Seen(lightning.Callback):
    """What the optimizer's ``max_grad_norm`` and the trainer's ``gradient_clip_val`` were
    during the fit."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.during = (trainer.optimizers[0].max_grad_norm, trainer.gradient_clip_val)


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _fit(out_dir: Path, ckpt_path: Path | None = None) -> dict[str, Any]:
    model, seen = Scaled(LR, FREEZE), Seen()
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        use_distributed_sampler=False,
        callbacks=[
            FnCallback(),
            seen,
            ModelCheckpoint(
                dirpath=out_dir,
                filename="checkpoint-{step}",
                auto_insert_metric_name=False,
                every_n_train_steps=1,
                save_top_k=-1,
            ),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    loader = ResumableBatches(*synthetic_data(), BATCH, trainer.global_rank, trainer.world_size)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return {
        "params": _params(model),
        "during": seen.during,
        "after": (trainer.optimizers[0].max_grad_norm, trainer.gradient_clip_val),
        "steps": trainer.global_step,
    }


class _Step(torch.nn.Module):
    """The loss of a batch as Lightning's DDP wrapper computes it (``training_step``)."""

    def __init__(self, model: Classifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.training_step((x, y), 0)


def _bare(max_grad_norm: float | None) -> torch.Tensor:
    model = Scaled(LR, FREEZE)
    opt = fn.optim.OnebitAdam(
        model.parameters(), lr=LR, freeze_step=FREEZE, max_grad_norm=max_grad_norm
    )
    net = DDP(_Step(model))
    fn.ddp.register(net, opt)
    batches = ResumableBatches(*synthetic_data(), BATCH, dist.get_rank(), dist.get_world_size())
    micro = (b for _ in range(STEPS) for b in batches)
    for _ in range(STEPS):
        opt.zero_grad()
        for k in range(ACCUMULATE):
            x, y = next(micro)
            if k < ACCUMULATE - 1:
                with net.no_sync():
                    (net(x, y) / ACCUMULATE).backward()
            else:
                (net(x, y) / ACCUMULATE).backward()
        opt.step()
    return _params(model)


def main() -> None:
    out_dir = Path(sys.argv[1])
    full = _fit(out_dir / "full")
    rank = dist.get_rank()
    result = {
        "full": full,
        "bare": _bare(CLIP),
        "unclipped": _bare(None),
        "resumed": {
            step: _fit(out_dir / f"resumed-{step}", out_dir / "full" / f"checkpoint-{step}.ckpt")
            for step in RESUME
        },
    }
    torch.save(result, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
    exit_distributed()
