"""fn's 1-bit Adam on an FSDP2-sharded model in a PyTorch Lightning ``Trainer``
(``ModelParallelStrategy``), with an LR schedule, checkpoints and resume.

    torchrun --nproc-per-node 2 examples/lightning_fsdp.py --output-dir DIR --max-steps 40 \
        --freeze-step 10 --save-steps 20 [--ckpt-path DIR/checkpoint-20.ckpt]

(or ``python examples/lightning_fsdp.py ...`` alone: Lightning then starts the second process
itself). The model, data and loader are examples/lightning_ddp.py's; here ``configure_model``
shards the MLP with ``fully_shard`` over the strategy's data-parallel mesh, and
``configure_optimizers`` returns ``fn.fsdp.OnebitAdam`` (with a per-step ``ExponentialLR``).
Warmup updates reduce-scatter the gradients densely; from ``--freeze-step`` on every FSDP2
module's reduce-scatter sends the momentum as 1 bit per element. Checkpoints
(``DIR/checkpoint-S.ckpt``) are ``torch.distributed.checkpoint`` directories, every rank writing
its shards and its own error feedback; a run resumed from one (``--ckpt-path``) ends with the
same params, bit for bit, as the uninterrupted run. At the end rank 0 saves the all-gathered
params to ``DIR/final.pt``, and the ranks check that they agree. The only fn-specific lines are
the optimizer and ``FnCallback()``.
"""

from __future__ import annotations

import os

import torch
from _common import check_ranks_agree, parse_args
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_ddp import Classifier, fit
from torch.distributed.fsdp import FSDPModule, fully_shard

import fn.fsdp
from fn.collectives import exit_distributed


class ShardedClassifier(Classifier):
    """:class:`lightning_ddp.Classifier` sharded by FSDP2 (its first layer, then the rest) and
    trained by ``fn.fsdp.OnebitAdam``."""

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
    args = parse_args("1-bit Adam on FSDP2 in a PyTorch Lightning Trainer", "--ckpt-path")
    ranks = int(os.environ.get("WORLD_SIZE", 2))
    strategy = ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1)
    model = ShardedClassifier(args.lr, args.freeze_step)
    trainer = fit(model, strategy, args)
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
