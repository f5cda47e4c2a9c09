"""Glue for the training stacks: Hugging Face ``Trainer`` and ``accelerate``.

Each stack has its own module, imported on demand (``import fn`` never imports them, nor the
stacks; they need the ``integrations`` extra: ``pip install "fn-optim[integrations]"``):

- ``fn.integrations.transformers.attach(trainer)``: a ``Trainer`` with an ``fn.optim`` 1-bit
  optimizer keeps DDP silent in the compressed phase and saves checkpoints that resume every rank
  bit for bit.
- ``fn.integrations.accelerate.attach(accelerator, model, optimizer)``: the same for a loop
  driven by an ``Accelerator`` (after ``accelerator.prepare``).

What both do, and why:

- DDP: the stacks wrap the model in ``DistributedDataParallel``, which would average every
  gradient again; ``fn.ddp.register`` lets DDP average in warmup and silences it in the
  compressed phase (the optimizer's 1-bit allreduce is then the only gradient traffic).
- Checkpoints: the stacks save only rank 0's optimizer state and load it on every rank; before
  each save, every rank's error feedback is gathered into it
  (``FunctionalOptimizer.gather_error_feedback``; its memory cost is documented there), and each
  rank takes back its own at load.
- ``model.to(device)`` and safetensors saving need no glue: ``fn.optim`` re-adopts replaced
  param storages and gives every param a storage of its own (``fn.optim._flat``).
"""
