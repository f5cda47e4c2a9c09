"""Glue for the training stacks: Hugging Face ``Trainer``, ``accelerate``, PyTorch Lightning,
torchtitan and torchft.

Each stack has its own module, imported on demand (``import fn`` never imports them, nor the
stacks; they need the ``integrations`` extra, ``pip install "fn-optim[integrations]"``,
Lightning the ``lightning`` extra, ``pip install "fn-optim[lightning]"``, and torchtitan the
``torchtitan`` extra, on torch 2.14 or later):

- ``fn.integrations.transformers.attach(trainer)``: a ``Trainer`` with an ``fn.optim`` 1-bit
  optimizer keeps DDP silent in the compressed phase and saves checkpoints that resume every rank
  bit for bit.
- ``fn.integrations.accelerate.attach(accelerator, model, optimizer)``: the same for a loop
  driven by an ``Accelerator`` (after ``accelerator.prepare``).
- ``lightning.Trainer(callbacks=[fn.integrations.lightning.FnCallback()])``: the same for a
  Lightning ``Trainer`` whose ``configure_optimizers`` returns an ``fn.optim`` optimizer
  (``trainer.fit(model, ckpt_path=...)`` resumes every rank bit for bit); Lightning's sharded
  strategies (FSDP, FSDP2, DeepSpeed) raise ``NotImplementedError`` there
  (``fn.integrations.lightning.check_strategy``).
- ``torchrun ... -m torchtitan.train --module fn.integrations.torchtitan --config llama3_8b``:
  torchtitan's own trainer with ``fn.fsdp``'s 1-bit Adam (or 1-bit LAMB) over FSDP2 or HSDP,
  its settings ``--optimizer.<name>``; its checkpoints resume every rank bit for bit, and start
  1-bit Adam from an AdamW checkpoint.
- ``fn.integrations.torchft.ElasticDiLoCo(model, inner, manager=..., process_group=...,
  sync_every=H)``: ``fn.diloco``'s outer step under torchft's ``Manager`` (the ``torchft``
  extra), so that workers leave and join without stopping the job.

What they do, and why:

- DDP: the stacks wrap the model in ``DistributedDataParallel``, which would average every
  gradient again; ``fn.ddp.register`` lets DDP average in warmup and silences it in the
  compressed phase (the optimizer's 1-bit allreduce is then the only gradient traffic).
- Checkpoints: the stacks save only rank 0's optimizer state and load it on every rank; before
  each save (Lightning: while it builds the checkpoint), every rank's error feedback is
  gathered into it (``FunctionalOptimizer.gather_error_feedback``; its memory cost is
  documented there), and each rank takes back its own at load.
- Without the glue, fn notices a DDP model it was not told about at the optimizer's first step
  and warns once with the fix (:mod:`fn.optim`, "A DDP model fn was not told about").
- ``model.to(device)`` and safetensors saving need no glue: ``fn.optim`` re-adopts replaced
  param storages and gives every param a storage of its own.
"""
