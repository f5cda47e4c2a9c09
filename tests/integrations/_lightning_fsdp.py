"""Run under ``torchrun`` by test_lightning_fsdp.py: ``fn.fsdp.OnebitAdam`` in Lightning's
``ModelParallelStrategy`` with ``FnCallback`` (examples/lightning_fsdp.py's model, loader and LR
schedule), on every rank.

    torchrun --nproc-per-node 2 tests/integrations/_lightning_fsdp.py OUT_DIR [SCENARIO ...]

The scenarios (both, in one launch, unless named): ``main``:

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

``accumulation``: :func:`accumulation_runs`, ``accumulate_grad_batches=4`` and
``gradient_clip_val=1.0`` (``ACCUMULATE``, ``CLIP``).

Writes ``OUT_DIR/<scenario>/rank<r>.pt``.
"""

from __future__ import annotations

import itertools
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
from lightning_ddp import Classifier  # noqa: E402
from lightning_fsdp import ShardedClassifier  # noqa: E402

import fn.fsdp  # noqa: E402
from fn.app.examples import ResumableBatches, synthetic_data  # noqa: E402
from fn.collectives import exit_distributed  # noqa: E402
from fn.integrations.lightning import FnCallback  # noqa: E402

STEPS, FREEZE, BATCH, LR, GAMMA = 7, 3, 4, 1e-2, 0.98
RESUME = (1, 2, 3, 5)  # warmup; the last warmup update; the first compressed; compressed
# 1-bit LAMB's automatic switch, decided by the criterion or at the latest by max_updates
LAMB_SWITCH = fn.AutoFreeze(min_updates=2, max_updates=3)
LAMB_RESUME = (2, 3, 5)  # each side of the decision (made at the end of update 2 or 3)
# accumulation and clipping: 8 micro-batches an epoch, so 2 updates; the updates after FREEZE - 1
# are compressed
ACCUMULATE, CLIP, ACC_STEPS = 4, 1.0, 5
ACC_RESUME = (2, 3)  # the last warmup update (an epoch's end); the first compressed (mid-epoch)
STEEP = 4.0  # the loss's factor in those runs: the gradient norms then exceed CLIP


class StepTraffic(lightning.Callback):
    """Per batch: fn's bytes sent by the optimizer, all and across the nodes."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.inter: list[int] = []  # across the nodes (HSDP)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = trainer.optimizers[0].bytes_sent
        self.start_inter = trainer.optimizers[0].bytes_sent_by_hop["inter"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.sent.append(trainer.optimizers[0].bytes_sent - self.start)
        self.inter.append(trainer.optimizers[0].bytes_sent_by_hop["inter"] - self.start_inter)


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


def full_run(
    out_dir: Path,
    make_model: type = ShardedClassifier,
    train: Any = fit,
    callbacks: tuple = (),
    **options: Any,
) -> dict:
    """An uninterrupted run of ``make_model`` fitted by ``train`` (with ``callbacks`` and
    ``options``) with a checkpoint after every update: fn's bytes sent per batch (all and across
    the nodes), fn's warnings, the final params, this rank's final optimizer state, the optimizer's
    ``max_grad_norm`` and the checkpoints saved."""
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
        trainer = train(model, callbacks=(traffic, saving, *callbacks), **options)
    return {
        "sent": traffic.sent,
        "inter": traffic.inter,
        "warnings": fn_warnings(caught),
        "params": full_params(model),
        "state": local_state(trainer.optimizers[0]),
        "max_grad_norm": trainer.optimizers[0].max_grad_norm,
        "saved": sorted(p.name for p in out_dir.iterdir()),
    }


def bare_loop(
    model: torch.nn.Module,
    optimizer: fn.fsdp.ShardedOnebitOptimizer,
    rank: int,
    ranks: int,
    batch: int = BATCH,
    steps: int = STEPS,
    accumulate: int = 1,
    steep: float = 1.0,
) -> None:
    """``steps`` updates of ``optimizer`` without Lightning, as ``fit`` makes them: the same
    batches (epoch after epoch), the loss (times ``steep``) of each of the ``accumulate``
    micro-batches of an update divided by ``accumulate`` (as Lightning's), and the LR
    schedule."""
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=GAMMA)
    loader = ResumableBatches(*synthetic_data(), batch, rank, ranks)
    batches = itertools.chain.from_iterable(itertools.repeat(loader))  # an epoch per pass
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulate):
            x, y = next(batches)
            loss = steep * torch.nn.functional.cross_entropy(model.net(x), y)
            (loss / accumulate).backward()
        optimizer.step()
        schedule.step()


def bare_run(
    rank: int, steps: int = STEPS, accumulate: int = 1, steep: float = 1.0, **options: Any
) -> dict:
    """The full run's updates without Lightning: the same model, shards, data and schedule
    (``options``: the optimizer's further options)."""
    model = Classifier(LR, FREEZE)
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model.net[0], mesh=mesh)
    fully_shard(model.net, mesh=mesh)
    optimizer = fn.fsdp.OnebitAdam(model, lr=LR, freeze_step=FREEZE, **options)
    bare_loop(model, optimizer, rank, 2, steps=steps, accumulate=accumulate, steep=steep)
    return full_params(model)


def resumed_run(
    checkpoint: Path, make_model: type = ShardedClassifier, train: Any = fit, **options: Any
) -> dict:
    model = make_model(LR, FREEZE)
    trainer = train(model, ckpt_path=str(checkpoint), **options)
    return {"params": full_params(model), "state": local_state(trainer.optimizers[0])}


class AdamWClassifier(ShardedClassifier):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def adamw_checkpoint(out_dir: Path) -> Path:
    """A checkpoint of the sharded model with a torch optimizer, after 1 update."""
    saving = ModelCheckpoint(dirpath=out_dir, filename="adamw", every_n_train_steps=1)
    fit(AdamWClassifier(LR, FREEZE), steps=1, callbacks=(saving,), fn_callback=False)
    return out_dir / "adamw.ckpt"


def refused(
    make_model, checkpoint: Path | None = None, train: Any = fit, **options: Any
) -> tuple[str, bool]:
    """Fits a new model that must fail: the error, and whether its params stayed as built."""
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        train(model, ckpt_path=None if checkpoint is None else str(checkpoint), **options)
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


class Steep:
    """A ``Classifier`` mixin: the loss times ``STEEP``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return STEEP * super().training_step(batch, batch_idx)


class SteepClassifier(Steep, ShardedClassifier):
    pass


class ClippedClassifier(SteepClassifier):
    """Its optimizer built with ``max_grad_norm=CLIP / 2``."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return fn.fsdp.OnebitAdam(
            self, lr=self.lr, freeze_step=self.freeze_step, max_grad_norm=CLIP / 2
        )


class HookClipping(SteepClassifier):
    """Clips to ``CLIP / 2`` in its ``configure_gradient_clipping``."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, **_: Any) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=CLIP / 2, gradient_clip_algorithm="norm")


class SaveAfterBatch(lightning.Callback):
    """``trainer.save_checkpoint(path)`` after the batch ``batch_idx``."""

    def __init__(self, path: Path, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


class UpdateParams(lightning.Callback):
    """The model's params (all-gathered) after each update."""

    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > len(self.params):
            self.params.append(full_params(pl_module))


def accumulation_runs(
    out_dir: Path, make_model: type = SteepClassifier, train: Any = fit, bare: Any = bare_run
) -> dict:
    """``accumulate_grad_batches=ACCUMULATE`` and ``gradient_clip_val=CLIP`` for ``ACC_STEPS``
    updates of ``make_model`` (a :class:`Steep` one): ``full`` (as :func:`full_run`, with
    ``"warmed"``, the params after the last warmup update), ``bare`` (the same updates in a
    plain loop with ``max_grad_norm=CLIP``), ``resumed`` (per checkpoint in ``ACC_RESUME``),
    ``unclipped`` (without ``gradient_clip_val``: ``"warmup"``, the params after the warmup of
    a new run; ``"compressed"``, the final params of a run resumed from the full run's
    checkpoint at the end of its warmup) and ``refused`` (clipping by value; a
    ``gradient_clip_val`` other than the optimizer's ``max_grad_norm``; another norm in
    ``configure_gradient_clipping``; a checkpoint between the micro-batches of an update)."""
    rank = int(os.environ["RANK"])
    options = dict(steps=ACC_STEPS, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP)
    unclipped = {**options, "gradient_clip_val": None}
    updates = UpdateParams()
    full = full_run(out_dir / "full", make_model, train, callbacks=(updates,), **options)
    full["warmed"] = updates.params[FREEZE - 2]
    checkpoints = out_dir / "full"
    warmup = make_model(LR, FREEZE)
    train(warmup, **{**unclipped, "steps": FREEZE - 1})
    resumed = {
        step: resumed_run(checkpoints / f"checkpoint-{step}.ckpt", make_model, train, **options)
        for step in ACC_RESUME
    }
    compressed = resumed_run(
        checkpoints / f"checkpoint-{FREEZE - 1}.ckpt", make_model, train, **unclipped
    )
    value = {**options, "gradient_clip_algorithm": "value"}
    midway = SaveAfterBatch(out_dir / "midway.ckpt", batch_idx=1)  # in the first update
    return {
        "full": full,
        "bare": bare(rank, steps=ACC_STEPS, accumulate=ACCUMULATE, steep=STEEP, max_grad_norm=CLIP),
        "resumed": resumed,
        "unclipped": {"warmup": full_params(warmup), "compressed": compressed["params"]},
        "refused": {
            "by value": refused(lambda: make_model(LR, FREEZE), train=train, **value),
            "other norm": refused(lambda: ClippedClassifier(LR, FREEZE), train=train, **options),
            "hook's norm": refused(lambda: HookClipping(LR, FREEZE), train=train, **unclipped),
            "between micro-batches": refused(
                lambda: make_model(LR, FREEZE), train=train, callbacks=(midway,), **options
            ),
        },
    }


def main_runs(out_dir: Path, rank: int) -> dict:
    """The ``main`` scenario (the module's docstring), its files in ``out_dir``."""
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
    return results


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    scenarios = {"main": main_runs, "accumulation": lambda folder, _: accumulation_runs(folder)}
    for name in sys.argv[2:] or scenarios:
        folder = out_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(scenarios[name](folder, rank), folder / f"rank{rank}.pt")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("FN_TIMEOUT", "60")
    main()
    exit_distributed()
