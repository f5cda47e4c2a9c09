"""DiLoCo with a compressed outer step: workers that train a small transformer apart and meet
every ``--sync-every`` steps.

Each rank is one worker with its own AdamW (the inner optimizer) and its own stream of tokens
from a fixed random bigram chain. ``fn.diloco.DiLoCo`` hooks the inner optimizer's ``step()``:
after every ``--sync-every`` steps the workers average their pseudo-gradients (anchor minus
parameters) through the ``--compression`` compressor (``--outer sparseloco``: SparseLoCo's
top-k with its error-feedback accumulator) and move the shared anchor with the outer rule;
the loop below is a plain torch loop. ``--checkpoint DIR`` saves, at the end, one file per rank
(the model, AdamW, DiLoCo's anchor, outer state and error feedback, the step); ``--resume``
continues it, and the resumed run equals the uninterrupted one bit for bit.

Run:
    torchrun --standalone --nproc-per-node 2 diloco.py --max-steps 40
    torchrun --standalone --nproc-per-node 2 diloco.py --max-steps 20 --checkpoint ck
    torchrun --standalone --nproc-per-node 2 diloco.py --max-steps 40 --checkpoint ck --resume
    options: --sync-every 10, --compression fp32|bf16|int8|loco4|onebit|topk,
    --outer nesterov|sparseloco, --topk 64 (values kept per chunk of 4096), --lr, --layers, ...

The transformer, the data and the shared arguments come from ``fn.app.examples``, so the
script runs alone, downloaded into an empty folder.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fn.app.examples import (
    Transformer,
    bigram_table,
    check_ranks_agree,
    held_out_loss,
    lm_loss,
    parse_fsdp_args,
    positive_int,
    train_batch,
)
from fn.collectives import exit_distributed
from fn.diloco import COMPRESSIONS, OUTER_RULES, DiLoCo


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-steps", type=positive_int, default=40)
    p.add_argument(
        "--sync-every", type=positive_int, default=10, help="inner steps per outer step (H)"
    )
    p.add_argument("--outer", choices=OUTER_RULES, default="nesterov")
    p.add_argument("--compression", choices=COMPRESSIONS, default="loco4")
    p.add_argument(
        "--topk", type=positive_int, default=64, help="values kept per chunk of 4096 (topk)"
    )
    return parse_fsdp_args(p, argv)


def build_diloco(
    args: argparse.Namespace, model: torch.nn.Module, inner: torch.optim.Optimizer
) -> DiLoCo:
    """DiLoCo around ``inner`` with the outer rule and the compressor of ``args``."""
    sparse = args.outer == "sparseloco" or args.compression == "topk"
    return DiLoCo(
        model,
        inner,
        sync_every=args.sync_every,
        outer=args.outer,
        compression="topk" if sparse else args.compression,
        compression_options={"k": args.topk} if sparse else None,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(args.seed)  # every worker starts from the same parameters
    model = Transformer(args.vocab, args.d_model, args.heads, args.layers, args.context)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    diloco = build_diloco(args, model, inner)
    start = 0
    path = os.path.join(args.checkpoint or "", f"rank-{rank}.pt")
    if args.resume:
        saved = torch.load(path)
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["inner"])
        diloco.load_state_dict(saved["diloco"])
        start = saved["step"]

    table = bigram_table(args.vocab)
    for step in range(start, args.max_steps):
        loss = lm_loss(model, train_batch(table, args, step, rank))
        loss.backward()
        inner.step()  # every --sync-every steps, DiLoCo's outer step runs in this call
        inner.zero_grad()
        if rank == 0 and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}: train loss {float(loss.detach()):.4f}", flush=True)

    if args.checkpoint:
        os.makedirs(args.checkpoint, exist_ok=True)
        state = {"model": model.state_dict(), "inner": inner.state_dict()}
        state.update(diloco=diloco.state_dict(), step=args.max_steps)
        torch.save(state, path)
    if args.max_steps % args.sync_every == 0:  # the workers just met: the same params
        check_ranks_agree(model)
    if rank == 0:
        loss = held_out_loss(model, table, args)
        print(f"held-out loss {loss:.4f} after {args.max_steps} steps", flush=True)
        print(f"outer steps {diloco.outer_steps}, {diloco.comm.bytes_sent} bytes sent by rank 0")


if __name__ == "__main__":
    main()
    exit_distributed()
