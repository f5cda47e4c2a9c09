"""Communication backends (Local, Simulated, ProcessGroup) and collective transforms that thread
explicit error-feedback state (1-bit allreduce, quantized allreduce with LoCo)."""

from fn.collectives.comm import Comm, Local
from fn.collectives.onebit import (
    OnebitAllreduceState,
    compressed_allreduce,
    init_error_feedback,
    onebit_allreduce,
    padded_numel,
)
from fn.collectives.process_group import ProcessGroup
from fn.collectives.quantized import (
    LocoAllreduceState,
    QuantizedError,
    loco_allreduce,
    quantized_allreduce,
    quantized_padded_numel,
    quantized_reduce_scatter,
)
from fn.collectives.simulated import Simulated, SimulatedGroup, replicate, simulate

__all__ = [
    "Comm",
    "Local",
    "Simulated",
    "SimulatedGroup",
    "ProcessGroup",
    "simulate",
    "replicate",
    "padded_numel",
    "init_error_feedback",
    "compressed_allreduce",
    "OnebitAllreduceState",
    "onebit_allreduce",
    "quantized_padded_numel",
    "quantized_reduce_scatter",
    "quantized_allreduce",
    "QuantizedError",
    "LocoAllreduceState",
    "loco_allreduce",
]
