"""FSDP2 (``fully_shard``) training with 1-bit Adam or 1-bit LAMB: a small transformer on CPU.

Every transformer block and the root are FSDP2 modules; ``fn.fsdp.OnebitAdam`` (or
``fn.fsdp.OnebitLamb`` with ``--optimizer lamb``) updates their shards. Up to ``--freeze-step``
the gradients are reduce-scattered densely (the warmup, ``m`` and ``v`` sharded); from then on
each module's reduce-scatter sends its momentum as 1 bit per element with error feedback, and
every rank keeps the full momentum as packed signs. The model and the data are those of
fsdp_loco.py (a random bigram chain, each rank its own stream). Checkpoints (``--checkpoint
DIR``) are ``torch.distributed.checkpoint`` directories with the model, the optimizer (its
shards, its packed momentum, every rank's error feedback) and the step; ``--resume`` continues
one, at any step, and the resumed run equals the uninterrupted one bit for bit. At the end the
ranks check that their all-gathered params are identical.

Run:
    torchrun --standalone --nproc-per-node 2 fsdp_onebit.py --max-steps 40 --freeze-step 10
    torchrun --standalone --nproc-per-node 2 fsdp_onebit.py --max-steps 40 --optimizer lamb
    torchrun --standalone --nproc-per-node 2 fsdp_onebit.py --max-steps 12 --checkpoint ck
    torchrun --standalone --nproc-per-node 2 fsdp_onebit.py --max-steps 40 --checkpoint ck --resume

The transformer, the data, the arguments, the training loop and the final check come from
``fn.app.examples``, so the script runs alone, downloaded into an empty folder.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fn.app.examples import (
    check_ranks_agree,
    onebit_parser,
    parse_fsdp_args,
    sharded_transformer,
    train,
)
from fn.collectives import exit_distributed
from fn.fsdp import OnebitAdam, OnebitLamb, TrainingCheckpoint


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_fsdp_args(onebit_parser(__doc__), argv)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        model = sharded_transformer(args, init_device_mesh("cpu", (world_size,)))
        optimizer_class = OnebitLamb if args.optimizer == "lamb" else OnebitAdam
        optimizer = optimizer_class(
            model, lr=args.lr, freeze_step=args.freeze_step, weight_decay=0.01
        )
        checkpoint = TrainingCheckpoint(model, optimizer)
        if args.resume:
            checkpoint.load(args.checkpoint)
        final = train(model, optimizer, checkpoint, args, rank)
        if args.checkpoint:
            checkpoint.save(args.checkpoint)
        if rank == 0:
            print(
                f"onebit: held-out loss {final:.6f} after {checkpoint.step} steps, "
                f"fn bytes sent (rank 0) {optimizer.bytes_sent}"
            )
        model.reshard()  # the root keeps its params unsharded after a forward without backward
        check_ranks_agree(model)  # all-gathers the params: the same on every rank
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_distributed()  # FSDP2's DTensor caches hold the group: do not let exit tear it down
