"""fn's 1-bit Adam in an ``accelerate`` loop under ``torchrun``, with checkpoints and resume.

    torchrun --standalone --nproc-per-node 2 accelerate_loop.py --output-dir DIR --max-steps 40 \
        --freeze-step 10 --save-steps 20 [--resume]

Trains a tiny random-weight GPT-2 on synthetic tokens (no downloads), checkpoints every
``--save-steps`` steps with ``accelerator.save_state(DIR/checkpoint-S)`` (default settings:
safetensors for the model) and saves the final model with ``accelerator.save_model(model,
DIR/final)``. ``--resume`` continues from the newest ``DIR/checkpoint-S`` with
``accelerator.load_state``; the run then ends with the same params, bit for bit, as the
uninterrupted run, and every rank ends with the same params (checked). The only fn-specific lines
are the optimizer and ``fn.integrations.accelerate.attach``.

Needs fn with the ``integrations`` extra. The model, the data, the arguments and the final check
come from ``fn.app.examples``, so the script runs alone, downloaded into an empty folder.
"""

from __future__ import annotations

import os
import re

import torch
from accelerate import Accelerator

import fn.optim
from fn.app.examples import SyntheticTokens, check_ranks_agree, parse_stack_args, tiny_gpt2
from fn.collectives import exit_distributed
from fn.integrations.accelerate import attach


def newest_checkpoint(output_dir: str) -> tuple[str, int]:
    """``(DIR/checkpoint-S, S)`` for the largest ``S`` in ``output_dir``."""
    steps = [
        int(m.group(1))
        for name in os.listdir(output_dir)
        if (m := re.fullmatch(r"checkpoint-(\d+)", name))
    ]
    if not steps:
        raise FileNotFoundError(f"--resume: no checkpoint-<step> directory in {output_dir}")
    return os.path.join(output_dir, f"checkpoint-{max(steps)}"), max(steps)


def main() -> None:
    args = parse_stack_args("1-bit Adam in an accelerate loop", "--resume")
    # cpu=True on a machine without GPUs: gloo ranks (accelerate then still wraps the model in DDP)
    accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    model = tiny_gpt2()
    # GPT-2's tensors differ in gradient scale (a compression scale each: flatten=False), and
    # its last position's embedding gets no gradient ("auto" keeps it still): without these the
    # variance freezes out of range (docs/troubleshooting.md, "The variance froze")
    optimizer = fn.optim.OnebitAdam(
        model.parameters(),
        lr=args.lr,
        freeze_step=args.freeze_step,
        flatten=False,
        exp_avg_mask="auto",
    )
    loader = torch.utils.data.DataLoader(SyntheticTokens(), batch_size=args.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    attach(accelerator, model, optimizer, max_steps=args.max_steps)

    step = 0
    if args.resume:
        checkpoint, step = newest_checkpoint(args.output_dir)
        accelerator.load_state(checkpoint)
    model.train()
    while step < args.max_steps:
        epoch_step = step % len(loader)
        batches = accelerator.skip_first_batches(loader, epoch_step) if epoch_step else loader
        for batch in batches:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % args.save_steps == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{step}"))
            if step == args.max_steps:
                break
        if accelerator.is_main_process:
            print(f"step {step}: loss {loss.item():.4f}")
    accelerator.wait_for_everyone()
    accelerator.save_model(model, os.path.join(args.output_dir, "final"))
    check_ranks_agree(model)


if __name__ == "__main__":
    main()
    exit_distributed()  # destroys the group; gloo can abort if interpreter exit tears it down
