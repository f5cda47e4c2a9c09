"""torchtitan glue: ``fn.fsdp``'s 1-bit Adam and 1-bit LAMB in torchtitan's trainer by a
config change (the ``torchtitan`` extra, on torch 2.14 or later, which torchtitan 0.3.0 needs)::

    torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module fn.integrations.torchtitan --config llama3_8b --optimizer.freeze_step 1000

``--module fn.integrations.torchtitan`` reads this package's ``config_registry`` module, which
has every config of torchtitan's llama3 registry under its own name, turned by
:func:`onebit_config` into a config for :class:`OnebitTrainer`: torchtitan's ``Trainer`` with

- :class:`OnebitOptimizersContainer`: one :class:`~fn.fsdp.OnebitAdam` (or
  :class:`~fn.fsdp.OnebitLamb`) over the model, its settings ``--optimizer.<name>``;
- :class:`ShardMeshParallelize`: the model sharded on the data-parallel shard mesh, the
  replicate mesh of HSDP (``--parallelism.data_parallel_replicate_degree``) the optimizer's;
- :class:`OnebitCheckpointManager`: torchtitan's checkpoints, which also start 1-bit Adam from an
  AdamW checkpoint;
- :func:`check_supported`: tensor, pipeline, context and expert parallelism refused at start.

The guide is docs/guides/torchtitan.md.
"""

from fn.integrations.torchtitan.checkpoint import OnebitCheckpointManager
from fn.integrations.torchtitan.optimizer import OnebitOptimizersContainer
from fn.integrations.torchtitan.parallelize import ShardMeshParallelize, check_supported
from fn.integrations.torchtitan.trainer import OnebitTrainer, onebit_config

__all__ = [
    "OnebitCheckpointManager",
    "OnebitOptimizersContainer",
    "OnebitTrainer",
    "ShardMeshParallelize",
    "check_supported",
    "onebit_config",
]
