"""Communication backends and collective transforms that thread explicit error-feedback state.

Backends (the ``Comm`` protocol, see ``comm.py``):

- ``Local()``: one rank; collectives return their input, compressed allreduces are the identity.
- ``Simulated(W)``: W ranks in one process. ``simulate(f, comm)(*args)`` runs ``f`` per rank
  under ``torch.func.vmap`` over the leading rank axis of every tensor argument;
  ``replicate(tree, comm)`` stacks W copies (params, states). Works under ``torch.compile``.
- ``ProcessGroup(group=None)``: ``torch.distributed`` (gloo, nccl, ...), e.g. under torchrun;
  ``exit_distributed()`` ends such a process without the abort gloo can cause at exit.

``comm.split(L)`` gives the intra-node and inter-node comms of a two-level topology. Every
comm counts the bytes each rank sends (``bytes_sent``, ``bytes_sent_by_hop``; the formulas of
``_traffic.py``).

Collectives: ``dense_allreduce`` (the fp32 baseline, as a transform), ``compressed_allreduce`` /
``onebit_allreduce`` (error-compensated 1-bit, ~1/32 of the fp32 traffic; with
``local_world_size``, hierarchical: dense inside each node, 1 bit across nodes; its result
can stay in the ``PackedSigns`` form it arrives in),
``quantized_allreduce`` / ``loco_allreduce`` / ``quantized_reduce_scatter`` (blockwise 4/8-bit,
LoCo error feedback, optional two-hop mode). Their error-feedback buffers are marked by type
(``ErrorFeedback``, ``ErrorFeedbackField``; see ``error_feedback.py``). In-place forms, as plain
functions in ``torch.distributed``'s flat layout: ``quantized_reduce_scatter_into`` (with LoCo
error buffers the caller keeps) and ``quantized_all_gather_into`` (what ``fn.fsdp`` installs in
FSDP2). The outer compressors of ``fn.diloco``: ``cast_allreduce`` (the mean sent in fp32, bf16
or fp16, summed in rank order) and ``topk_allreduce`` (chunk-wise top-k in 2 bits with error
feedback, averaged by an all-gather or reduced on owners: ``exchange=``). Their
``update(..., participation=Participation(...))`` averages over the ranks that take part
(``participation.py``): a sitter sends zeros and keeps its error feedback. ``Compressor``: a
transform that can also exchange with its flag (whether it takes part) and size record in a
header on its messages (``header.py``), as ``fn.diloco``'s outer step does.
"""

import torch

from fn.collectives.cast import *  # noqa: F403
from fn.collectives.cast import __all__ as _cast_all
from fn.collectives.comm import Comm, Local
from fn.collectives.dense import dense_allreduce
from fn.collectives.dtensor import as_sharded_like, local_shard
from fn.collectives.error_feedback import *  # noqa: F403
from fn.collectives.error_feedback import ErrorFeedback
from fn.collectives.error_feedback import __all__ as _error_feedback_all
from fn.collectives.header import HEADER_BYTES, Compressor, Exchanged
from fn.collectives.onebit import (
    ERROR_DTYPES,
    OnebitAllreduceState,
    PackedSigns,
    check_error_dtype,
    compressed_allreduce,
    init_error_feedback,
    onebit_allreduce,
    padded_numel,
)
from fn.collectives.participation import Participation, participants_mean
from fn.collectives.process_exit import exit_distributed
from fn.collectives.process_group import CollectiveTimeoutError, ProcessGroup
from fn.collectives.quantized import *  # noqa: F403
from fn.collectives.quantized import LocoAllreduceState, QuantizedError
from fn.collectives.quantized import __all__ as _quantized_all
from fn.collectives.simulated import *  # noqa: F403
from fn.collectives.simulated import __all__ as _simulated_all
from fn.collectives.topk import *  # noqa: F403
from fn.collectives.topk import TopkAllreduceState, TopkOwnerState
from fn.collectives.topk import __all__ as _topk_all

# The state classes, for torch.load's default weights_only=True (see fn/__init__.py).
torch.serialization.add_safe_globals(
    [
        ErrorFeedback,
        LocoAllreduceState,
        OnebitAllreduceState,
        PackedSigns,
        QuantizedError,
        TopkAllreduceState,
        TopkOwnerState,
    ]
)

__all__ = [
    "Comm",
    "Local",
    *_simulated_all,
    "ProcessGroup",
    "CollectiveTimeoutError",
    "exit_distributed",
    "dense_allreduce",
    "as_sharded_like",
    "local_shard",
    *_cast_all,
    *_error_feedback_all,
    "padded_numel",
    "init_error_feedback",
    "compressed_allreduce",
    "PackedSigns",
    "ERROR_DTYPES",
    "check_error_dtype",
    "OnebitAllreduceState",
    "onebit_allreduce",
    *_quantized_all,
    *_topk_all,
    "HEADER_BYTES",
    "Compressor",
    "Exchanged",
    "Participation",
    "participants_mean",
]
