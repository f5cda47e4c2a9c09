"""HSDP with 1-bit Adam or 1-bit LAMB: FSDP2 inside each node, 1 bit per element across nodes.

fsdp_onebit.py's job (the same small transformer, bigram data and checkpoints) on a 2-D mesh of
``N`` nodes x ``L`` ranks (``L = --ranks-per-node``, ``N = WORLD_SIZE / L``). Every FSDP2
module is sharded over ``mesh["shard"]`` (the ``L`` ranks of a node), and
``fn.fsdp.OnebitAdam(..., replicate=mesh["replicate"])`` owns the other dimension: the parameter
all-gathers and the gradient reduce-scatters stay inside the node, and the only traffic across
nodes is the average of each rank's gradient shard over its ``N`` peers, dense up to
``--freeze-step``, then the 1-bit allreduce of the shard's momentum with error feedback
(docs/algorithms.md, "1-bit Adam and 1-bit LAMB on HSDP"). Each rank draws its data from its
global rank. Checkpoints (``--checkpoint DIR``, ``fn.fsdp.TrainingCheckpoint``) resume on the
same mesh shape, at any step, bit for bit; on another (``--ranks-per-node``, or the world size)
they load resharded, the error feedback restarting from zero with a warning. At the end the
ranks check that they hold the same params.

Run (2 nodes x 2 ranks, on one machine; on a cluster the same with ``--nnodes 2``):
    torchrun --standalone --nproc-per-node 4 hsdp_onebit.py --max-steps 40 --freeze-step 10
    torchrun --standalone --nproc-per-node 4 hsdp_onebit.py --max-steps 40 --optimizer lamb
    torchrun --standalone --nproc-per-node 4 hsdp_onebit.py --max-steps 12 --checkpoint ck
    torchrun --standalone --nproc-per-node 4 hsdp_onebit.py --max-steps 40 --checkpoint ck --resume

The transformer, the data, the arguments, the training loop and the final check come from
``fn.app.examples``, so the script runs alone, downloaded into an empty folder.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fn.app.examples import (
    check_ranks_agree,
    onebit_parser,
    parse_fsdp_args,
    positive_int,
    sharded_transformer,
    train,
)
from fn.collectives import exit_distributed
from fn.fsdp import OnebitAdam, OnebitLamb, TrainingCheckpoint


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = onebit_parser(__doc__)
    p.add_argument("--ranks-per-node", type=positive_int, default=2, help="L, the shard dimension")
    args = parse_fsdp_args(p, argv)
    if int(os.environ.get("WORLD_SIZE", 1)) % args.ranks_per_node:
        p.error("WORLD_SIZE must be a multiple of --ranks-per-node (N nodes of L ranks)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, nodes = dist.get_rank(), dist.get_world_size() // args.ranks_per_node
    try:
        mesh = init_device_mesh(
            "cpu", (nodes, args.ranks_per_node), mesh_dim_names=("replicate", "shard")
        )
        model = sharded_transformer(args, mesh["shard"])  # FSDP2 inside the node only
        optimizer_class = OnebitLamb if args.optimizer == "lamb" else OnebitAdam
        optimizer = optimizer_class(
            model,
            lr=args.lr,
            freeze_step=args.freeze_step,
            weight_decay=0.01,
            replicate=mesh["replicate"],
        )
        checkpoint = TrainingCheckpoint(model, optimizer)
        if args.resume:
            checkpoint.load(args.checkpoint)
        final = train(model, optimizer, checkpoint, args, rank)  # data from the global rank
        if args.checkpoint:
            checkpoint.save(args.checkpoint)
        if rank == 0:
            print(
                f"hsdp {nodes}x{args.ranks_per_node}: held-out loss {final:.6f} after "
                f"{checkpoint.step} steps, fn bytes sent (rank 0) {optimizer.bytes_sent}"
            )
        model.reshard()  # the root keeps its params unsharded after a forward without backward
        check_ranks_agree(model)  # all-gathers the params: the same on all N x L ranks
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_distributed()  # FSDP2's DTensor caches hold the group: do not let exit tear it down
