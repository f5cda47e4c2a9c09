"""HSDP with 1-bit Adam or 1-bit LAMB: FSDP2 inside each node, 1 bit per element across nodes.

examples/fsdp_onebit.py's job (the same small transformer, bigram data and checkpoints) on a
2-D mesh of ``N`` nodes x ``L`` ranks (``L = --ranks-per-node``, ``N = WORLD_SIZE / L``).
Every FSDP2 module is sharded over ``mesh["shard"]`` (the ``L`` ranks of a node), and
``fn.fsdp.OnebitAdam(..., replicate=mesh["replicate"])`` owns the other dimension: the
parameter all-gathers and the gradient reduce-scatters stay inside the node, and the only
traffic across nodes is the average of each rank's gradient shard over its ``N`` peers, dense
up to ``--freeze-step``, then the 1-bit allreduce of the shard's momentum with error feedback
(docs/algorithms.md, "1-bit Adam and 1-bit LAMB on HSDP"). Each rank draws its data from its
global rank. Checkpoints (``--checkpoint DIR``, ``fn.fsdp.TrainingCheckpoint``) resume on the
same mesh shape, at any step, bit for bit; on another (``--ranks-per-node``, or the world size)
they load resharded, the error feedback restarting from zero with a warning. At the end the ranks check that they hold the same
params.

Run (2 nodes x 2 ranks, on one machine; on a cluster the same with ``--nnodes 2``):
    torchrun --nproc-per-node 4 examples/hsdp_onebit.py --max-steps 40 --freeze-step 10
    torchrun --nproc-per-node 4 examples/hsdp_onebit.py --max-steps 40 --optimizer lamb
    torchrun --nproc-per-node 4 examples/hsdp_onebit.py --max-steps 12 --checkpoint /tmp/ck
    torchrun --nproc-per-node 4 examples/hsdp_onebit.py --max-steps 40 --checkpoint /tmp/ck --resume
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples._common import check_ranks_agree  # noqa: E402
from examples.fsdp_loco import Transformer, parse_training_args, train  # noqa: E402
from examples.fsdp_onebit import OPTIMIZERS, onebit_parser  # noqa: E402
from fn.collectives import exit_distributed  # noqa: E402
from fn.fsdp import TrainingCheckpoint  # noqa: E402


def hsdp_transformer(args: argparse.Namespace, mesh: DeviceMesh) -> nn.Module:
    """The transformer (the same random weights on every rank), every block and the root an
    FSDP2 module sharded over the node: ``mesh["shard"]``, never the 2-D mesh."""
    torch.manual_seed(args.seed)
    model = Transformer(args.vocab, args.d_model, args.heads, args.layers, args.context)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return model


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = onebit_parser(__doc__)
    p.add_argument("--ranks-per-node", type=int, default=2, help="L, the shard dimension")
    args = parse_training_args(p, argv)
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
        model = hsdp_transformer(args, mesh)
        optimizer = OPTIMIZERS[args.optimizer](
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
