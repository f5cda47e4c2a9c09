"""FSDP2 integration: fn's quantized, error-compensated reduce-scatter inside ``fully_shard``.

- :func:`loco_reduce_scatter` installs a :class:`QuantizedReduceScatter` (ZeRO++ qgZ with LoCo
  error feedback, one or two hops) on every FSDP2 module of a model and returns a
  :class:`LocoReduceScatterHandle`, whose ``state_dict`` holds every rank's error feedback.
- :func:`quantized_all_gather` sends the parameter all-gathers in 8-bit groups (ZeRO++ qwZ)
  through :class:`QuantizedAllGather`.
- :class:`OnebitAdam` and :class:`OnebitLamb` are 1-bit Adam and 1-bit LAMB over FSDP2's
  shards: every module's reduce-scatter accumulates its micro-batches' gradients, and
  ``step()`` makes the update's 1-bit allreduce of the momentum (dense in the warmup), with
  ``max_grad_norm`` clipping in every phase (:class:`ShardedOnebitOptimizer` is what they
  share); :class:`ZeroOneAdam` raises
  ``NotImplementedError`` (0/1 Adam's local steps need replicated params).
- :class:`TrainingCheckpoint` saves and restores model, optimizer and that handle with
  ``torch.distributed.checkpoint``.
"""

from fn.fsdp.all_gather import QuantizedAllGather, quantized_all_gather
from fn.fsdp.checkpoint import CheckpointWriteError, TrainingCheckpoint, read_onebit_state
from fn.fsdp.loco import LocoReduceScatterHandle, loco_reduce_scatter
from fn.fsdp.onebit import OnebitAdam, ShardedOnebitOptimizer, ZeroOneAdam
from fn.fsdp.onebit_lamb import OnebitLamb
from fn.fsdp.reduce_scatter import CommCache, QuantizedReduceScatter, reduce_scale

__all__ = [
    "CommCache",
    "QuantizedReduceScatter",
    "reduce_scale",
    "LocoReduceScatterHandle",
    "loco_reduce_scatter",
    "QuantizedAllGather",
    "quantized_all_gather",
    "CheckpointWriteError",
    "TrainingCheckpoint",
    "read_onebit_state",
    "OnebitAdam",
    "OnebitLamb",
    "ShardedOnebitOptimizer",
    "ZeroOneAdam",
]
