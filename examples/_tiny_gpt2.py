"""What the two examples share: a tiny random-weight GPT-2, synthetic tokens, their arguments and
a check that every rank ends with the same params."""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ, SAMPLES = 128, 16, 512


def parse_args(description: str, resume_flag: str) -> argparse.Namespace:
    """``--output-dir --max-steps --freeze-step --save-steps`` and the stack's resume flag."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--freeze-step", type=int, default=10, help="1-bit Adam's warmup updates")
    parser.add_argument("--save-steps", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    if resume_flag == "--resume":
        parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    else:
        parser.add_argument(resume_flag, default=None, help="a checkpoint-S directory")
    return parser.parse_args()


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 (about 30k params) with random weights drawn from ``seed``, the same on
    every rank; dropout off, so that a run does not depend on the random state of the stack."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


class SyntheticTokens(torch.utils.data.Dataset):
    """``SAMPLES`` fixed random token sequences (a repeating pattern plus noise, so that the loss
    can fall), drawn from ``seed`` (another seed: held-out sequences of the same kind); items
    are ``{"input_ids", "labels"}`` dicts."""

    def __init__(self, seed: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed)
        pattern = torch.arange(SEQ) % 7
        noise = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=gen)
        keep = torch.rand(SAMPLES, SEQ, generator=gen) < 0.8
        self.tokens = torch.where(keep, pattern, noise)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def check_ranks_agree(model: torch.nn.Module) -> str:
    """The SHA-256 of the params, the same on every rank (else ``RuntimeError``); rank 0 prints
    it."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
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
