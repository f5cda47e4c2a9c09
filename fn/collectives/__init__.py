"""Communication backends (Local, Simulated, ProcessGroup) and collective transforms that thread
explicit error-feedback state (1-bit allreduce, quantized allreduce with LoCo)."""

__all__: list[str] = []
