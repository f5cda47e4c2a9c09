"""What the examples share: their arguments and a check that every rank ends with the same
params."""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def parse_args(description: str, resume_flag: str) -> argparse.Namespace:
    """``--output-dir --max-steps --freeze-step --save-steps`` and the stack's resume flag."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument(
        "--freeze-step",
        type=freeze_step_arg,
        default=10,
        help='1-bit Adam\'s warmup updates, or "auto" to let the warmup decide',
    )
    parser.add_argument("--save-steps", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    if resume_flag == "--resume":
        parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    else:
        parser.add_argument(resume_flag, default=None, help="the checkpoint to resume from")
    return parser.parse_args()


def freeze_step_arg(text: str) -> int | str:
    """``--freeze-step``'s value: ``"auto"`` or an int."""
    return text if text == "auto" else int(text)


def check_ranks_agree(model: torch.nn.Module) -> str:
    """The SHA-256 of the params (sharded ones all-gathered, a collective), the same on every
    rank (else ``RuntimeError``); rank 0 prints it."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if isinstance(p, DTensor):
            p = p.full_tensor()
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    mine = digest.hexdigest()
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if len(set(every)) != 1:
            raise RuntimeError(f"the ranks ended with different params: {every}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"final params sha256 {mine} (the same on every rank)")
    return mine
