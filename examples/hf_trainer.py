"""fn's 1-bit Adam in a Hugging Face ``Trainer`` under ``torchrun``, with checkpoints and resume.

    torchrun --standalone --nproc-per-node 2 hf_trainer.py --output-dir DIR --max-steps 40 \
        --freeze-step 10 --save-steps 20 [--resume-from-checkpoint DIR/checkpoint-20]

Trains a tiny random-weight GPT-2 on synthetic tokens (no downloads), checkpoints every
``--save-steps`` with Trainer's own ``save_steps`` and saves the final model with
``trainer.save_model(DIR/final)``. A run resumed from ``DIR/checkpoint-S`` ends with the same
params, bit for bit, as the uninterrupted run; every rank ends with the same params (checked).
The only fn-specific lines are the optimizer and ``fn.integrations.transformers.attach``.

Needs fn with the ``integrations`` extra. The model, the data, the arguments and the final check
come from ``fn.app.examples``, so the script runs alone, downloaded into an empty folder.
"""

from __future__ import annotations

import os

import torch
from transformers import Trainer, TrainingArguments

import fn.optim
from fn.app.examples import SyntheticTokens, check_ranks_agree, parse_stack_args, tiny_gpt2
from fn.collectives import exit_distributed
from fn.integrations.transformers import attach


def main() -> None:
    args = parse_stack_args("1-bit Adam in a Hugging Face Trainer", "--resume-from-checkpoint")
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        save_steps=args.save_steps,
        per_device_train_batch_size=args.batch_size,
        logging_steps=max(1, args.max_steps // 4),
        report_to=[],
        ddp_find_unused_parameters=False,  # every param gets a gradient (no DDP warning)
        seed=0,
        dataloader_num_workers=0,
        use_cpu=not torch.accelerator.is_available(),  # gloo ranks on a machine without GPUs
    )
    training_args.device  # noqa: B018 (sets up torch.distributed before the optimizer exists)
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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=SyntheticTokens(),
        optimizers=(optimizer, scheduler),
    )
    attach(trainer)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(os.path.join(args.output_dir, "final"))
    check_ranks_agree(trainer.model)


if __name__ == "__main__":
    main()
    exit_distributed()  # destroys the group; gloo can abort if interpreter exit tears it down
