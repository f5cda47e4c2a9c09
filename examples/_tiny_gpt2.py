"""The tiny random-weight GPT-2 and the synthetic tokens of the Trainer and Accelerate
examples."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ, SAMPLES = 128, 16, 512


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
