"""FSDP2 (``fully_shard``) training with 4-bit LoCo gradients: a small transformer on CPU.

Every transformer block and the root are FSDP2 modules; ``fn.fsdp.loco_reduce_scatter`` makes
their gradient reduce-scatters 4-bit (ZeRO++ qgZ) with LoCo error feedback. The model is a
random-weight causal transformer in plain torch; the tokens come from a fixed random bigram
chain (each rank its own stream), so the loss has something to learn; AdamW updates the shards.
Checkpoints (``--checkpoint DIR``) are ``torch.distributed.checkpoint`` directories with the
model, the optimizer, the step and every rank's error feedback; ``--resume`` continues one, and
the resumed run equals the uninterrupted one bit for bit.

Run:
    torchrun --nproc-per-node 2 examples/fsdp_loco.py --max-steps 20
    torchrun --nproc-per-node 2 examples/fsdp_loco.py --max-steps 10 --checkpoint /tmp/ck
    torchrun --nproc-per-node 2 examples/fsdp_loco.py --max-steps 20 --checkpoint /tmp/ck --resume
    options: --mode dense|loco|qgz, --bits 4|8, --err-beta 0.8, --local-world-size L, --qwz
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fn.collectives import exit_distributed  # noqa: E402
from fn.fsdp import (  # noqa: E402
    LocoReduceScatterHandle,
    TrainingCheckpoint,
    loco_reduce_scatter,
    quantized_all_gather,
)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = nn.MultiheadAttention(d_model, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and a vocabulary head."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.randn(context, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[batch * length, vocab]`` logits (a new tensor: FSDP2 warns about returned views)."""
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))


def bigram_table(vocab: int, seed: int = 0) -> torch.Tensor:
    """A fixed random next-token distribution per token (peaked: a few likely successors)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(vocab, vocab, generator=g), dim=1)


def tokens(table: torch.Tensor, batch: int, length: int, seed: int) -> torch.Tensor:
    """``[batch, length]`` token sequences drawn from the bigram chain ``table``."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(batch, length, dtype=torch.int64)
    out[:, 0] = torch.randint(table.shape[0], (batch,), generator=g)
    for i in range(1, length):
        out[:, i] = torch.multinomial(table[out[:, i - 1]], 1, generator=g).squeeze(1)
    return out


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[:, :-1]), batch[:, 1:].flatten())


def sharded_transformer(args: argparse.Namespace, world_size: int) -> nn.Module:
    """The transformer (the same random weights on every rank), every block and the root an
    FSDP2 module."""
    torch.manual_seed(args.seed)
    model = Transformer(args.vocab, args.d_model, args.heads, args.layers, args.context)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build(
    args: argparse.Namespace, world_size: int
) -> tuple[nn.Module, LocoReduceScatterHandle | None]:
    """The FSDP2 transformer (same random weights on every rank) and fn's handle, if any."""
    model = sharded_transformer(args, world_size)
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


def train_batch(table: torch.Tensor, args: argparse.Namespace, step: int, rank: int):
    return tokens(table, args.batch, args.context + 1, seed=1_000_003 * (step + 1) + rank)


@torch.no_grad()
def held_out_loss(model: nn.Module, table: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean loss on fixed held-out sequences (the same on every rank, never trained on)."""
    batch = tokens(table, 4 * args.batch, args.context + 1, seed=-1 % 2**31)
    return float(lm_loss(model, batch))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-steps", type=int, default=50)
    p.add_argument(
        "--mode",
        choices=("dense", "loco", "qgz"),
        default="loco",
        help="dense FSDP2, LoCo (quantized + error feedback), qgZ (quantized only)",
    )
    p.add_argument("--bits", type=int, default=4, choices=(4, 8))
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--err-beta", type=float, default=0.8)
    p.add_argument(
        "--local-world-size", type=int, default=None, help="ranks per node: two-hop reduce-scatter"
    )
    p.add_argument(
        "--qwz", action="store_true", help="also all-gather the parameters in 8 bits (ZeRO++ qwZ)"
    )
    return parse_training_args(p, argv)


def parse_training_args(
    p: argparse.ArgumentParser, argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Adds the options of the FSDP2 examples' model, data, training and checkpoints to ``p``
    (examples/fsdp_onebit.py shares them) and parses ``argv``."""
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (saved at the end)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint")
    return args


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint: TrainingCheckpoint,
    args: argparse.Namespace,
    rank: int,
) -> float:
    """Trains from ``checkpoint.step`` to ``--max-steps`` (rank 0 logs the loss), counting the
    steps in ``checkpoint.step``; returns the held-out loss."""
    table = bigram_table(args.vocab)
    for step in range(checkpoint.step, args.max_steps):
        optimizer.zero_grad()
        loss = lm_loss(model, train_batch(table, args, step, rank))
        loss.backward()
        optimizer.step()
        checkpoint.step = step + 1
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}: train loss {float(loss.detach()):.4f}", flush=True)
    return held_out_loss(model, table, args)


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
