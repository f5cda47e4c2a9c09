"""How a torchtitan model is laid out for ``fn.fsdp``: the parallelisms it runs under (FSDP2
on the data-parallel shard mesh, HSDP with fn owning the replicate dimension) and the refusal,
at start, of the others; the model's ``parallelize_fn`` wrapped so that it shards on the shard
mesh alone."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer

__all__ = ["ShardMeshParallelize", "check_supported"]

_NAME = "fn.integrations.torchtitan"

# The parallelisms fn.fsdp's optimizers do not run under, by their config field.
_REFUSED = (
    ("tensor_parallel_degree", "tensor parallelism"),
    ("pipeline_parallel_degree", "pipeline parallelism"),
    ("context_parallel_degree", "context parallelism"),
    ("expert_parallel_degree", "expert parallelism"),
)


def check_supported(config: Trainer.Config) -> None:
    """Raises unless fn's 1-bit optimizers can run under ``config``: FSDP2 over the
    data-parallel ranks (``data_parallel_shard_degree``), optionally with
    ``data_parallel_replicate_degree > 1`` (HSDP, the replicate dimension fn's), on
    torchtitan's ``partial_dtensor`` backend, without CUDA graphs or CPU offload. It reads the
    config alone, so every rank raises the same error before any process group exists.

    Args:
        config: the trainer's config.

    Raises:
        NotImplementedError: tensor, pipeline, context or expert parallelism (a degree above
            1), the ``spmd_types`` or ``full_dtensor`` backend, CPU offload, or CUDA graphs
            of the forward and backward.
        ValueError: ``training.max_norm`` is not positive.

    Example:
        >>> from torchtitan.trainer import Trainer
        >>> from torchtitan.config import ParallelismConfig, TrainingConfig
        >>> from fn.integrations.torchtitan import check_supported
        >>> config = Trainer.Config(
        ...     parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        ...     training=TrainingConfig(disable_cuda_graphs=True),
        ... )
        >>> check_supported(config)
        >>> config.parallelism.tensor_parallel_degree = 2
        >>> check_supported(config)
        Traceback (most recent call last):
        ...
        NotImplementedError: fn.integrations.torchtitan: tensor parallelism ...
    """
    parallelism, training = config.parallelism, config.training
    for name, what in _REFUSED:
        degree = getattr(parallelism, name)
        if degree != 1:
            raise NotImplementedError(
                f"{_NAME}: {what} (--parallelism.{name} {degree}) is not built: fn.fsdp's "
                "1-bit optimizers run on FSDP2 over the data-parallel ranks "
                "(--parallelism.data_parallel_shard_degree) and on HSDP "
                "(--parallelism.data_parallel_replicate_degree N, 1-bit across the N replicas)"
            )
    if parallelism.spmd_backend != "partial_dtensor":
        raise NotImplementedError(
            f"{_NAME}: --parallelism.spmd_backend {parallelism.spmd_backend} is not built: it "
            "shards the model on a mesh of every data-parallel axis, where fn shards on the "
            "shard axis and owns the replicate axis; use --parallelism.spmd_backend "
            "partial_dtensor (fn's configs set it)"
        )
    if not training.disable_cuda_graphs:
        raise NotImplementedError(
            f"{_NAME}: CUDA graphs of the forward and backward are not built: fn.fsdp's "
            "reduce-scatter decides on the host, at every backward, what it sends; set "
            "--training.disable_cuda_graphs (fn's configs set it)"
        )
    if training.enable_cpu_offload:
        raise NotImplementedError(
            f"{_NAME}: --training.enable_cpu_offload is not built: fn.fsdp's optimizers "
            "step the shards on the device of the model's collectives"
        )
    if not (isinstance(training.max_norm, (int, float)) and training.max_norm > 0):
        raise ValueError(
            f"{_NAME}: --training.max_norm must be positive (math.inf: no clipping), got "
            f"{training.max_norm!r}"
        )


class ShardMeshParallelize:
    """A model's ``parallelize_fn`` made to shard on the data-parallel shard mesh alone.

    The wrapped function sees torchtitan's ``ParallelDims`` with no replicate dimension, so
    the model's FSDP2 modules lie on the 1-D shard mesh (``fsdp``; torchtitan would shard
    them on the 2-D mesh, and FSDP2 then all-reduce densely across the replicas); fn's
    optimizer takes the replicate mesh (``replicate=``) and makes the exchange across it. The
    gradients stay summed as torchtitan sums them (``gradient_divide_factor=1``): with ``N``
    replicas each module's reduce-scatter multiplies by ``N`` (``set_gradient_divide_factor(1
    / N)``), so that fn's mean over the replicas is the sum over every rank.

    Args:
        parallelize_fn: the model's ``ModelSpec.parallelize_fn``.

    Example:
        >>> from torchtitan.models.llama3 import parallelize_llama
        >>> from fn.integrations.torchtitan import ShardMeshParallelize
        >>> ShardMeshParallelize(parallelize_llama).parallelize_fn is parallelize_llama
        True
    """

    def __init__(self, parallelize_fn: Any) -> None:
        self.parallelize_fn = parallelize_fn

    def __call__(self, model: nn.Module, *, parallel_dims: ParallelDims, **kwargs: Any) -> Any:
        """The model parallelized on the shard mesh (``parallelize_fn``'s arguments)."""
        model = self.parallelize_fn(model, parallel_dims=_WithoutReplicas(parallel_dims), **kwargs)
        if parallel_dims.dp_replicate_enabled:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0 / parallel_dims.dp_replicate)
        return model


class _WithoutReplicas:
    """``ParallelDims`` as the model's ``parallelize_fn`` sees them under fn: the replicate
    dimension is not the model's to shard on."""

    def __init__(self, dims: ParallelDims) -> None:
        self._dims = dims

    @property
    def dp_replicate_enabled(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dims, name)
