"""Run under ``torchrun`` (4 ranks) by test_lightning_hsdp.py: ``fn.fsdp.OnebitAdam`` on HSDP in
Lightning's ``ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)`` with
``FnCallback``: ``configure_model`` builds the ``("replicate", "shard")`` mesh of 2 nodes x 2
(one machine standing for 2 nodes) and shards on ``mesh["shard"]``, ``configure_optimizers``
passes ``replicate=mesh["replicate"]``, and the loader deals the batches by global rank
(``use_distributed_sampler=False``: a loader Lightning can resume in the middle of an epoch).

    torchrun --nproc-per-node 4 tests/integrations/_lightning_hsdp.py OUT_DIR [SCENARIO ...]

The scenarios (both, in one launch, unless named): ``main``:

- ``full``: an uninterrupted run of ``STEPS`` updates, a checkpoint after every update: per
  update fn's bytes sent, fn's warnings, the final params (all-gathered) and this rank's final
  optimizer state;
- ``bare``: the same updates in a plain loop on the same HSDP mesh, no Lightning;
- ``resumed``: per checkpoint in ``RESUME``, a new model and trainer resumed from it;
- ``other shape``: a run on the 1 x 4 mesh resumed from a 2 x 2 checkpoint (resharded): whether
  it fitted, fn's warnings and the final params;
- ``sampler``: under Lightning's own distributed sampler, the rows this rank trained on in one
  epoch with the recipe's strategy (``"world"``), and the refusal with the strategy's default
  sizes, ``data_parallel_size=2`` (``"by node"``: the error, and whether the params stayed as
  built).

``accumulation``: ``_lightning_fsdp.accumulation_runs`` on this HSDP model and strategy
(``accumulate_grad_batches=4``, ``gradient_clip_val=1.0``).

Writes ``OUT_DIR/<scenario>/rank<r>.pt``.
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
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_ddp import Classifier  # noqa: E402

import fn.fsdp  # noqa: E402
from fn.app.examples import synthetic_data  # noqa: E402
from fn.collectives import exit_distributed  # noqa: E402
from fn.integrations.lightning import FnCallback  # noqa: E402
from tests.integrations import _lightning_fsdp as lightning_fsdp  # noqa: E402
from tests.integrations._lightning_fsdp import fn_warnings, full_params, local_state  # noqa: E402

NODES, PER_NODE = 2, 2
STEPS, FREEZE, BATCH, LR, GAMMA = 5, 3, 2, 1e-2, 0.98  # 8 batches per epoch
RESUME = (1, 2, 3)  # warmup; the last warmup update; the first compressed


class HsdpClassifier(Classifier):
    """:class:`lightning_ddp.Classifier` on HSDP: sharded inside the node, 1-bit Adam across,
    on ``nodes`` nodes of the 4 ranks."""

    def __init__(self, lr: float, freeze_step: int, nodes: int = NODES) -> None:
        super().__init__(lr, freeze_step)
        self.nodes = nodes

    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):  # Lightning may call it again
            return
        # on a cluster: (self.trainer.num_nodes, self.trainer.num_devices)
        shape = (self.nodes, NODES * PER_NODE // self.nodes)
        self.hsdp = init_device_mesh(
            self.device_mesh.device_type, shape, mesh_dim_names=("replicate", "shard")
        )
        fully_shard(self.net[0], mesh=self.hsdp["shard"])
        fully_shard(self.net, mesh=self.hsdp["shard"])

    def configure_optimizers(self) -> dict:
        optimizer = fn.fsdp.OnebitAdam(
            self, lr=self.lr, freeze_step=self.freeze_step, replicate=self.hsdp["replicate"]
        )
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=GAMMA)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class SteepHsdpClassifier(lightning_fsdp.Steep, HsdpClassifier):
    pass


def strategy(data_parallel_size: int = NODES * PER_NODE) -> ModelParallelStrategy:
    """The recipe's strategy: every rank a data-parallel rank (or ``data_parallel_size``)."""
    return ModelParallelStrategy(
        data_parallel_size=data_parallel_size,
        tensor_parallel_size=NODES * PER_NODE // data_parallel_size,
        timeout=timedelta(seconds=60),
    )


def fit(
    model: lightning.LightningModule,
    steps: int = STEPS,
    callbacks: tuple = (),
    ckpt_path: str | None = None,
    **options: Any,
) -> lightning.Trainer:
    return lightning_fsdp.fit(
        model,
        steps,
        callbacks,
        ckpt_path,
        devices=NODES * PER_NODE,
        batch=BATCH,
        strategy=strategy(),
        **options,
    )


def full_run(out_dir: Path) -> dict:
    return lightning_fsdp.full_run(out_dir, HsdpClassifier, fit)


def bare_run(
    rank: int, steps: int = STEPS, accumulate: int = 1, steep: float = 1.0, **options: Any
) -> dict:
    """The full run's updates without Lightning: the same model, mesh, data and schedule
    (``options``: the optimizer's further options)."""
    model = Classifier(LR, FREEZE)
    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    fully_shard(model.net[0], mesh=mesh["shard"])
    fully_shard(model.net, mesh=mesh["shard"])
    optimizer = fn.fsdp.OnebitAdam(
        model, lr=LR, freeze_step=FREEZE, replicate=mesh["replicate"], **options
    )
    ranks = NODES * PER_NODE
    lightning_fsdp.bare_loop(model, optimizer, rank, ranks, BATCH, steps, accumulate, steep)
    return full_params(model)


def resumed_run(checkpoint: Path) -> dict:
    model = HsdpClassifier(LR, FREEZE)
    trainer = fit(model, ckpt_path=str(checkpoint))
    return {"params": full_params(model), "state": local_state(trainer.optimizers[0])}


def other_shape(checkpoint: Path) -> dict:
    """Resumes the 2 x 2 checkpoint on the 1 x 4 mesh: fn's warnings and the final params."""
    model = HsdpClassifier(LR, FREEZE, nodes=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(model, ckpt_path=str(checkpoint))
    return {
        "warnings": fn_warnings(caught),
        "params": full_params(model),
        "step": trainer.global_step,
    }


class Batches(lightning.Callback):
    """The inputs of every batch this rank trains on."""

    def __init__(self) -> None:
        self.x: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.x.append(batch[0].clone())


def sampler_runs() -> dict:
    """Fits under Lightning's own distributed sampler for one epoch: with the recipe's strategy,
    the rows of the data this rank trained on; with the strategy's default sizes (by node), the
    error and whether the params stayed as built."""
    x, y = synthetic_data()
    out: dict[str, Any] = {}
    for case, data_parallel_size in (("world", NODES * PER_NODE), ("by node", NODES)):
        seen = Batches()
        trainer = lightning.Trainer(
            accelerator="cpu",
            devices=NODES * PER_NODE,
            strategy=strategy(data_parallel_size),
            max_epochs=1,
            callbacks=[FnCallback(), seen],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = HsdpClassifier(LR, FREEZE)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), BATCH, shuffle=True
        )
        try:
            trainer.fit(model, loader)
            error = None
        except ValueError as refused:
            error = str(refused)
        after = full_params(model)
        rows = torch.cat(seen.x) if seen.x else x[:0]
        out[case] = {
            "rows": (rows[:, None] == x[None]).all(dim=-1).nonzero()[:, 1],  # index per row seen
            "batches": len(seen.x),
            "error": error,
            "unchanged": all(torch.equal(after[n], before[n]) for n in before),
        }
    return out


def main_runs(out_dir: Path, rank: int) -> dict[str, Any]:
    """The ``main`` scenario (the module's docstring), its files in ``out_dir``."""
    results: dict[str, Any] = {"full": full_run(out_dir / "full"), "bare": bare_run(rank)}
    results["resumed"] = {
        step: resumed_run(out_dir / "full" / f"checkpoint-{step}.ckpt") for step in RESUME
    }
    results["other shape"] = other_shape(out_dir / "full" / f"checkpoint-{FREEZE}.ckpt")
    results["sampler"] = sampler_runs()
    return results


def accumulation_runs(out_dir: Path, rank: int) -> dict[str, Any]:
    """The ``accumulation`` scenario, its files in ``out_dir``."""
    del rank
    return lightning_fsdp.accumulation_runs(out_dir, SteepHsdpClassifier, fit, bare_run)


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    scenarios = {"main": main_runs, "accumulation": accumulation_runs}
    for name in sys.argv[2:] or scenarios:
        folder = out_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(scenarios[name](folder, rank), folder / f"rank{rank}.pt")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("FN_TIMEOUT", "60")
    main()
    exit_distributed()
