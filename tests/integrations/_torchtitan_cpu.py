"""A test-only shim that runs torchtitan 0.3.0's Trainer on CPU processes over gloo (torchtitan
targets CUDA): :func:`install` before any torchtitan import, then torchtitan's command-line
arguments with :data:`CPU_ARGS`; :func:`write_assets` writes the tokenizer and the data that
the wheel does not ship. Nothing here is part of fn.

What :func:`install` changes, and why:

- the device type is ``"cpu"`` (torchtitan picks it when it is imported), with a stand-in device
  module for its memory monitor and its ``set_device`` / ``synchronize`` calls;
- flex attention has no CPU backward: its call becomes SDPA with the block mask made dense (the
  same masked attention), and the block mask is built eagerly (not compiled);
- torchtitan calls ``torch.distributed.set_timeout``, which torch 2.13 names
  ``distributed_c10d._set_pg_timeout``;
- gloo has no ``PREMUL_SUM``: FSDP2's own reductions are forced to sums (fn's reduce-scatter
  applies the factor itself).
"""

from __future__ import annotations

import json
import random
import types
from pathlib import Path

import torch
import torch._utils
import torch.distributed as dist

# torchtitan's arguments for CPU: the backend fn runs on, and fp32 matmuls (bf16 is slow here)
CPU_ARGS = ["--parallelism.spmd_backend", "partial_dtensor"]
CPU_ARGS += ["--training.mixed_precision_param", "float32"]


class _CpuDeviceModule:
    """``torch.cpu`` with what torchtitan asks of a device module."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cpu, name)

    def set_device(self, device: object) -> None:
        del device

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_name(self, device: object = None) -> str:
        return "cpu"

    def get_device_properties(self, device: object = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(total_memory=1 << 34)

    def memory_stats(self, device: object = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: object = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def synchronize(self, device: object = None) -> None:
        pass


def install() -> None:
    """Patches torch and torchtitan for CPU processes (call before importing torchtitan)."""
    device_module = _CpuDeviceModule()
    device_of = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda kind="cuda": (
        device_module if kind == "cpu" else device_of(kind)
    )
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = dist.distributed_c10d._set_pg_timeout

    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.models.common.attention as attention
    import torchtitan.models.common.decoder as decoder
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    attention.create_attention_mask = decoder.create_attention_mask = create_block_mask

    def dense_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, **_):
        assert score_mod is None and not return_aux.lse
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], q.device)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out, None

    attention.FlexAttention.compiled_flex_attn = staticmethod(dense_attention)
    undivided = titan_fsdp.disable_fsdp_gradient_division

    def summed(model: torch.nn.Module) -> None:
        undivided(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = summed


def write_assets(folder: Path, documents: int = 400) -> tuple[Path, Path]:
    """A byte-level BPE tokenizer (fewer tokens than the debug model's vocabulary) and a JSON
    lines text dataset of made-up words, under ``folder``.

    Returns:
        The tokenizer's folder (``--hf_assets_path``) and the data's
        (``--dataloader.dataset_path``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    letters = "abcdefghijklmnop"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 6))) for _ in range(300)]
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    with open(data / "train.jsonl", "w") as out:
        for _ in range(documents):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
            out.write(json.dumps({"text": text}) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(data / "train.jsonl")], trainer)
    assets = folder / "tokenizer"
    assets.mkdir(exist_ok=True)
    tokenizer.save(str(assets / "tokenizer.json"))
    config = {"bos_token": special[0], "eos_token": special[1]}
    (assets / "tokenizer_config.json").write_text(json.dumps(config))
    return assets, data
