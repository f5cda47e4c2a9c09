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
from fn.collectives.simulated import Simulated, replicate, simulate

__all__ = [
    "Comm",
    "Local",
    "Simulated",
    "ProcessGroup",
    "simulate",
    "replicate",
    "padded_numel",
    "init_error_feedback",
    "compressed_allreduce",
    "OnebitAllreduceState",
    "onebit_allreduce",
]
