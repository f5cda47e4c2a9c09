"""Run under ``torchrun`` by test_lightning_fsdp.py: ``fn.fsdp.OnebitAdam`` in Lightning's
``ModelParallelStrategy`` with ``FnCallback`` (examples/lightning_fsdp.py's model, loader and LR
schedule), on every rank.

    torchrun --nproc-per-node 2 tests/integrations/_lightning_fsdp.py OUT_DIR

- ``full``: an uninterrupted run of ``STEPS`` updates, a checkpoint after every update: per
  update fn's bytes sent, fn's warnings, the final params (all-gathered) and this rank's final
  optimizer state;
- ``bare``: the same updates in a plain loop with ``fn.fsdp.OnebitAdam``, no Lightning;
- ``resumed``: per checkpoint in ``RESUME``, a new model and trainer resumed from it to
  ``STEPS``: the final params and optimizer state;
- ``refused``: per bad set-up (among them checkpoints of other settings and of a torch
  optimizer), the error (type and message) and whether the params stayed as built;
- ``short``: fn's warnings of a run too short to compress;
- ``lamb``: ``fn.fsdp.OnebitLamb`` with ``freeze_step="auto"`` (``LAMB_SWITCH``): an
  uninterrupted run (as ``full``; its state holds the switch) and runs resumed from
  ``LAMB_RESUME``.

Writes ``OUT_DIR/rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from lightning_ddp import Classifier, ResumableBatches, synthetic_data  # noqa: E402
from lightning_fsdp import ShardedClassifier  # noqa: E402

import fn.fsdp  # noqa: E402
from fn.collectives import exit_distributed  # noqa: E402
from fn.integrations.lightning import FnCallback  # noqa: E402

STEPS, FREEZE, BATCH, LR, GAMMA = 7, 3, 4, 1e-2, 0.98
RESUME = (1, 2, 3, 5)  # warmup; the last warmup update; the first compressed; compressed
# 1-bit LAMB's automatic switch, decided by the criterion or at the latest by max_updates
LAMB_SWITCH = fn.AutoFreeze(min_updates=2, max_updates=3)
LAMB_RESUME = (2, 3, 5)  # each side of the decision (made at the end of update 2 or 3)


class StepTraffic(lightning.Callback):
    """Per update: fn's bytes sent by the optimizer."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = trainer.optimizers[0].bytes_sent

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.sent.append(trainer.optimizers[0].bytes_sent - self.start)


def strategy(**options: Any) -> ModelParallelStrategy:
    settings = dict(data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=60))
    return ModelParallelStrategy(**{**settings, **options})


def fit(
    model: lightning.LightningModule,
    steps: int = STEPS,
    callbacks: tuple = (),
    ckpt_path: str | None = None,
    fn_callback: bool = True,
    devices: int = 2,
    batch: int = BATCH,
    **options: Any,
) -> lightning.Trainer:
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=options.pop("strategy", None) or strategy(),
        max_steps=steps,
        use_distributed_sampler=False,
        callbacks=[FnCallback()] * fn_callback + list(callbacks),
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )
    loader = ResumableBatches(*synthetic_data(), batch, trainer.global_rank, trainer.world_size)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's params, all-gathered (collective)."""
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def local_state(optimizer: fn.fsdp.ShardedOnebitOptimizer) -> dict[str, torch.Tensor]:
    """This rank's optimizer state, flat, its shards as local tensors."""
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else key, item)
        else:
            flat[prefix] = value.to_local() if isinstance(value, DTensor) else value

    walk("", optimizer.state_dict())
    return {k: v.clone() for k, v in flat.items()}


def fn_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("fn.")]


def full_run(out_dir: Path, make_model: type = ShardedClassifier, train: Any = fit) -> dict:
    """An uninterrupted run of ``make_model`` fitted by ``train`` with a checkpoint after every
    update: fn's bytes sent per update, fn's warnings, the final params and this rank's final
    optimizer state."""
    traffic = StepTraffic()
    saving = ModelCheckpoint(
        dirpath=out_dir,
        filename="checkpoint-{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=1,
        save_top_k=-1,
    )
    model = make_model(LR, FREEZE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(model, callbacks=(traffic, saving))
    return {
        "sent": traffic.sent,
        "warnings": fn_warnings(caught),
        "params": full_params(model),
        "state": local_state(trainer.optimizers[0]),
    }


def bare_run(rank: int) -> dict[str, torch.Tensor]:
    """The full run's updates without Lightning: the same model, shards, data and schedule."""
    model = Classifier(LR, FREEZE)
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model.net[0], mesh=mesh)
    fully_shard(model.net, mesh=mesh)
    optimizer = fn.fsdp.OnebitAdam(model, lr=LR, freeze_step=FREEZE)
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=GAMMA)
    batches = iter(ResumableBatches(*synthetic_data(), BATCH, rank, 2))
    for _ in range(STEPS):
        x, y = next(batches)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model.net(x), y).backward()
        optimizer.step()
        schedule.step()
    return full_params(model)


def resumed_run(checkpoint: Path, make_model: type = ShardedClassifier) -> dict:
    model = make_model(LR, FREEZE)
    trainer = fit(model, ckpt_path=str(checkpoint))
    return {"params": full_params(model), "state": local_state(trainer.optimizers[0])}


class AdamWClassifier(ShardedClassifier):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def adamw_checkpoint(out_dir: Path) -> Path:
    """A checkpoint of the sharded model with a torch optimizer, after 1 update."""
    saving = ModelCheckpoint(dirpath=out_dir, filename="adamw", every_n_train_steps=1)
    fit(AdamWClassifier(LR, FREEZE), steps=1, callbacks=(saving,), fn_callback=False)
    return out_dir / "adamw.ckpt"


def refused(make_model, checkpoint: Path | None = None, **options: Any) -> tuple[str, bool]:
    """Fits a new model that must fail: the error, and whether its params stayed as built."""
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        fit(model, ckpt_path=None if checkpoint is None else str(checkpoint), **options)
        message = "fitted"
    except Exception as error:  # noqa: BLE001 -- the test checks which one
        message = f"{type(error).__name__}: {error}"
    after = full_params(model)  # sharded by configure_model
    unchanged = all(torch.equal(after[n], before[n]) for n in before)
    return message, unchanged


class LambClassifier(ShardedClassifier):
    def configure_optimizers(self) -> dict:
        optimizer = fn.fsdp.OnebitLamb(self, lr=self.lr, freeze_step=LAMB_SWITCH)
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def lamb_runs(out_dir: Path) -> dict:
    full = full_run(out_dir, LambClassifier)
    resumed = {
        step: resumed_run(out_dir / f"checkpoint-{step}.ckpt", LambClassifier)
        for step in LAMB_RESUME
    }
    return {"full": full, "resumed": resumed}


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    results = {"full": full_run(out_dir / "full"), "bare": bare_run(rank)}
    results["resumed"] = {
        step: resumed_run(out_dir / "full" / f"checkpoint-{step}.ckpt") for step in RESUME
    }
    checkpoint = out_dir / "full" / f"checkpoint-{FREEZE}.ckpt"
    results["refused"] = {
        "other settings": refused(lambda: ShardedClassifier(LR, FREEZE + 1), checkpoint),
        "other optimizer": refused(
            lambda: ShardedClassifier(LR, FREEZE), adamw_checkpoint(out_dir / "adamw")
        ),
        "mesh of one rank": refused(  # ModelParallelStrategy's default sizes on one node
            lambda: ShardedClassifier(LR, FREEZE),
            strategy=strategy(data_parallel_size=1, tensor_parallel_size=2),
        ),
        "accumulation": refused(lambda: ShardedClassifier(LR, FREEZE), accumulate_grad_batches=2),
        "clipping": refused(lambda: ShardedClassifier(LR, FREEZE), gradient_clip_val=1.0),
        "full checkpoint": refused(
            lambda: ShardedClassifier(LR, FREEZE),
            strategy=strategy(save_distributed_checkpoint=False),
        ),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(ShardedClassifier(LR, 100), steps=2)
    results["short"] = fn_warnings(caught)
    results["lamb"] = lamb_runs(out_dir / "lamb")
    torch.save(results, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("FN_TIMEOUT", "60")
    main()
    exit_distributed()
