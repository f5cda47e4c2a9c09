"""fn's 1-bit Adam on an FSDP2-sharded model in a PyTorch Lightning ``Trainer``
(``ModelParallelStrategy``), with an LR schedule, checkpoints and resume.

    torchrun --standalone --nproc-per-node 2 lightning_fsdp.py --output-dir DIR --max-steps 40 \
        --freeze-step 10 --save-steps 20 [--ckpt-path DIR/checkpoint-20.ckpt]

(or ``python lightning_fsdp.py ...`` alone: Lightning then starts the second process itself).
The network, data and loader are those of lightning_ddp.py; here ``configure_model`` shards the
MLP with ``fully_shard`` over the strategy's data-parallel mesh, and ``configure_optimizers``
returns ``fn.fsdp.OnebitAdam`` (with a per-step ``ExponentialLR``). Warmup updates
reduce-scatter the gradients densely; from ``--freeze-step`` on every FSDP2 module's
reduce-scatter sends the momentum as 1 bit per element. Checkpoints (``DIR/checkpoint-S.ckpt``)
are ``torch.distributed.checkpoint`` directories, every rank writing its shards and its own error
feedback; a run resumed from one (``--ckpt-path``) ends with the same params, bit for bit, as the
uninterrupted run. At the end rank 0 saves the all-gathered params to ``DIR/final.pt``, and the
ranks check that they agree. The only fn-specific lines are the optimizer and ``FnCallback()``.

Needs fn with the ``lightning`` extra. The network and its loss, the data, the arguments, the
Trainer's settings and the final check come from ``fn.app.examples``, so the script runs alone,
downloaded into an empty folder.
"""

from __future__ import annotations

import os

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard

import fn.fsdp
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


class ShardedClassifier(ClassifierMixin, lightning.LightningModule):
    """A 2-layer MLP (``self.net``) with weights drawn from ``seed`` and its training step
    (``ClassifierMixin``), sharded by FSDP2 (its first layer, then the rest) and trained by
    ``fn.fsdp.OnebitAdam``."""

    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):  # Lightning may call it again
            return
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def configure_optimizers(self) -> dict:
        optimizer = fn.fsdp.OnebitAdam(self, lr=self.lr, freeze_step=self.freeze_step)
        schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.98)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    args = parse_stack_args("1-bit Adam on FSDP2 in a PyTorch Lightning Trainer", "--ckpt-path")
    ranks = int(os.environ.get("WORLD_SIZE", 2))
    model = ShardedClassifier(args.lr, args.freeze_step)
    trainer = lightning.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1),
        callbacks=[FnCallback(), ModelCheckpoint(**checkpoint_settings(args))],
        **trainer_settings(args),  # CPU or GPUs, --max-steps, quiet and deterministic
    )
    x, y = synthetic_data()
    loader = ResumableBatches(x, y, args.batch_size, trainer.global_rank, trainer.world_size)
    trainer.fit(model, loader, ckpt_path=args.ckpt_path)
    final = {name: p.full_tensor() for name, p in model.named_parameters()}  # collective
    if trainer.is_global_zero:
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save(final, os.path.join(args.output_dir, "final.pt"))
        optimizer = trainer.optimizers[0]
        print(f"{optimizer.count} updates, fn bytes sent (rank 0) {optimizer.bytes_sent}")
    check_ranks_agree(model)


if __name__ == "__main__":
    main()
    exit_distributed()  # destroys the group; gloo can abort if interpreter exit tears it down
