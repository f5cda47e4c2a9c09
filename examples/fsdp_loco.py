"""FSDP2 (``fully_shard``) training with 4-bit LoCo gradients: a small transformer on CPU.

Every transformer block and the root are FSDP2 modules; ``fn.fsdp.loco_reduce_scatter`` makes
their gradient reduce-scatters 4-bit (ZeRO++ qgZ) with LoCo error feedback. The model is a
random-weight causal transformer in plain torch; the tokens come from a fixed random bigram
chain (each rank its own stream), so the loss has something to learn; AdamW updates the shards.
Checkpoints (``--checkpoint DIR``) are ``torch.distributed.checkpoint`` directories with the
model, the optimizer, the step and every rank's error feedback; ``--resume`` continues one, and
the resumed run equals the uninterrupted one bit for bit.

Run:
    torchrun --standalone --nproc-per-node 2 fsdp_loco.py --max-steps 20
    torchrun --standalone --nproc-per-node 2 fsdp_loco.py --max-steps 10 --checkpoint ck
    torchrun --standalone --nproc-per-node 2 fsdp_loco.py --max-steps 20 --checkpoint ck --resume
    options: --mode dense|loco|qgz, --bits 4|8, --err-beta 0.8, --local-world-size L, --qwz

The transformer, the data, the shared arguments and the training loop come from
``fn.app.examples``, so the script runs alone, downloaded into an empty folder.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fn.app.examples import parse_fsdp_args, positive_int, sharded_transformer, train
from fn.collectives import exit_distributed
from fn.fsdp import (
    LocoReduceScatterHandle,
    TrainingCheckpoint,
    loco_reduce_scatter,
    quantized_all_gather,
)


def build(
    args: argparse.Namespace, world_size: int
) -> tuple[nn.Module, LocoReduceScatterHandle | None]:
    """The FSDP2 transformer (same random weights on every rank) and fn's handle, if any."""
    model = sharded_transformer(args, init_device_mesh("cpu", (world_size,)))
    if args.qwz:
        quantized_all_gather(model, bits=8, group_size=args.group_size)
    if args.mode == "dense":
        return model, None
    handle = loco_reduce_scatter(
        model,
        bits=args.bits,
        group_size=args.group_size,
        err_beta=args.err_beta if args.mode == "loco" else None,
        local_world_size=args.local_world_size,
    )
    return model, handle


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-steps", type=positive_int, default=50)
    p.add_argument(
        "--mode",
        choices=("dense", "loco", "qgz"),
        default="loco",
        help="dense FSDP2, LoCo (quantized + error feedback), qgZ (quantized only)",
    )
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--group-size", type=positive_int, default=128)
    p.add_argument("--err-beta", type=float, default=0.8)
    p.add_argument(
        "--local-world-size",
        type=positive_int,
        default=None,
        help="ranks per node: two-hop reduce-scatter",
    )
    p.add_argument(
        "--qwz", action="store_true", help="also all-gather the parameters in 8 bits (ZeRO++ qwZ)"
    )
    return parse_fsdp_args(p, argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        model, handle = build(args, world_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        checkpoint = TrainingCheckpoint(model, optimizer, handle)
        if args.resume:
            checkpoint.load(args.checkpoint)
        final = train(model, optimizer, checkpoint, args, rank)
        if args.checkpoint:
            checkpoint.save(args.checkpoint)
        if rank == 0:
            sent = f", fn reduce-scatter bytes sent (rank 0) {handle.bytes_sent}" if handle else ""
            print(f"{args.mode}: held-out loss {final:.6f} after {checkpoint.step} steps{sent}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_distributed()  # FSDP2's DTensor caches hold the group: do not let exit tear it down
