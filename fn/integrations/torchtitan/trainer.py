"""``OnebitTrainer``: torchtitan's ``Trainer`` with an ``fn.fsdp`` 1-bit optimizer, and
:func:`onebit_config`, which turns a torchtitan config into one for it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.trainer import Trainer

from fn.integrations.torchtitan.checkpoint import OnebitCheckpointManager
from fn.integrations.torchtitan.optimizer import OnebitOptimizersContainer
from fn.integrations.torchtitan.parallelize import ShardMeshParallelize, check_supported

__all__ = ["OnebitTrainer", "onebit_config"]

_NAME = "fn.integrations.torchtitan"
_ADAM_SETTINGS = ("lr", "betas", "eps", "weight_decay")


class OnebitTrainer(Trainer):
    """torchtitan's ``Trainer`` with :class:`~fn.fsdp.OnebitAdam` or
    :class:`~fn.fsdp.OnebitLamb` (:class:`OnebitOptimizersContainer`) in place of AdamW.

    Before anything else it refuses, on every rank, what fn does not run under
    (:func:`~fn.integrations.torchtitan.check_supported`). Then, as torchtitan's
    ``Trainer``, with:

    - the model's ``parallelize_fn`` sharding on the data-parallel shard mesh alone
      (:class:`~fn.integrations.torchtitan.ShardMeshParallelize`); with
      ``data_parallel_replicate_degree`` ``N > 1`` (HSDP) the optimizer gets the replicate
      mesh (``replicate=``), and its exchange across the ``N`` replicas is the 1-bit
      allreduce once compressed;
    - torchtitan's summed gradients (the loss divided by the global token count) as they are,
      over the micro-batches of ``global_batch_size`` (each backward reduce-scatters, the
      exchange across ranks or replicas runs once per step);
    - ``--training.max_norm`` as the optimizer's ``max_grad_norm``, which clips the gradient
      entering the momentum by one factor on every rank in both phases; torchtitan's own
      ``clip_grad_norm_`` then clips nothing (its limit is set to ``math.inf``), and the
      ``grad_norm`` it logs is the norm of ``.grad`` before ``step()``: the summed gradient in
      the warmup of a 1-D mesh, ``N`` times a replica's gradient on HSDP, and in the
      compressed phase of a 1-D mesh each rank's row of its own gradient;
    - a warning when no step of the run would be compressed.

    Args:
        config: :class:`OnebitTrainer.Config`, as :func:`onebit_config` makes it.

    Raises:
        NotImplementedError, ValueError: :func:`~fn.integrations.torchtitan.check_supported`'s,
            on every rank.

    Example:
        >>> from fn.integrations.torchtitan import OnebitTrainer
        >>> config = OnebitTrainer.Config()
        >>> config.optimizer.name, config.parallelism.spmd_backend
        ('OnebitAdam', 'partial_dtensor')
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """torchtitan's ``Trainer.Config`` with fn's optimizer and checkpoint manager, on the
        ``partial_dtensor`` backend, without CUDA graphs."""

        optimizer: OnebitOptimizersContainer.Config = field(
            default_factory=OnebitOptimizersContainer.Config
        )
        checkpoint: OnebitCheckpointManager.Config = field(
            default_factory=OnebitCheckpointManager.Config
        )
        parallelism: ParallelismConfig = field(
            default_factory=lambda: ParallelismConfig(spmd_backend="partial_dtensor")
        )
        training: TrainingConfig = field(
            default_factory=lambda: TrainingConfig(disable_cuda_graphs=True)
        )

    def __init__(self, config: OnebitTrainer.Config) -> None:
        check_supported(config)
        spec = config.model_spec
        if spec is not None and not isinstance(spec.parallelize_fn, ShardMeshParallelize):
            config.model_spec = replace(
                spec, parallelize_fn=ShardMeshParallelize(spec.parallelize_fn)
            )
        max_norm = float(config.training.max_norm)
        config.optimizer = replace(
            config.optimizer, max_grad_norm=None if math.isinf(max_norm) else max_norm
        )
        super().__init__(config)
        # fn clips (max_grad_norm); torchtitan's clip_grad_norm_ then multiplies by 1
        self.config.training = replace(self.config.training, max_norm=math.inf)
        self.optimizers.optimizer.warn_if_never_compressed(
            config.training.steps, "--training.steps"
        )

    def init_distributed(self) -> ParallelDims:
        """torchtitan's, and on HSDP the replicate mesh handed to the optimizer's config.

        Returns:
            torchtitan's ``ParallelDims``.
        """
        parallel_dims = super().init_distributed()
        if parallel_dims.dp_replicate_enabled:
            replicate = parallel_dims.get_mesh("dp_replicate")
            self.config.optimizer = replace(self.config.optimizer, replicate=replicate)
        return parallel_dims


def onebit_config(config: Trainer.Config, **settings: Any) -> OnebitTrainer.Config:
    """``config`` (torchtitan's ``Trainer.Config``, e.g. a model registry's config function's)
    for :class:`OnebitTrainer`: its optimizer an :class:`OnebitOptimizersContainer` with the
    AdamW param group's ``lr``, ``betas``, ``eps`` and ``weight_decay``, then ``settings``;
    its checkpoint manager an :class:`~fn.integrations.torchtitan.OnebitCheckpointManager`
    with the same settings; ``--parallelism.spmd_backend partial_dtensor`` and
    ``--training.disable_cuda_graphs``; everything else as it is.

    Args:
        config: a torchtitan ``Trainer.Config`` (not a subclass's: another trainer), or an
            :class:`OnebitTrainer.Config`, whose optimizer then takes ``settings``.
        **settings: :class:`OnebitOptimizersContainer.Config`'s fields (``freeze_step``,
            ``name="OnebitLamb"``, ``error_dtype``, ...).

    Returns:
        The config, a new object (``config`` is left as it is).

    Raises:
        NotImplementedError: a subclass of ``Trainer.Config``; several param groups with other
            settings, or another optimizer than Adam and AdamW (fn's optimizers take one
            param group); Adam with weight decay (fn's decay is decoupled, AdamW's); another
            checkpoint manager than torchtitan's ``CheckpointManager``.

    Example:
        >>> from torchtitan.models.llama3.config_registry import llama3_debugmodel
        >>> from fn.integrations.torchtitan import onebit_config
        >>> config = onebit_config(llama3_debugmodel(), freeze_step=100)
        >>> config.optimizer.name, config.optimizer.lr, config.optimizer.freeze_step
        ('OnebitAdam', 0.0008, 100)
    """
    if type(config) is OnebitTrainer.Config:
        return replace(config, optimizer=replace(config.optimizer, **settings))
    if type(config) is not Trainer.Config:
        raise NotImplementedError(
            f"{_NAME}: {type(config).__qualname__} is another trainer's config; fn's trainer "
            "is torchtitan's Trainer (its Trainer.Config)"
        )
    adam = _adam_settings(config.optimizer)
    optimizer = OnebitOptimizersContainer.Config(**{**adam, **settings})
    checkpoint = config.checkpoint
    if type(checkpoint) is CheckpointManager.Config:
        values = {f.name: getattr(checkpoint, f.name) for f in fields(checkpoint) if f.init}
        checkpoint = OnebitCheckpointManager.Config(**values)
    elif not isinstance(checkpoint, OnebitCheckpointManager.Config):
        raise NotImplementedError(
            f"{_NAME}: the checkpoint manager {type(checkpoint).__qualname__} is not built "
            "with fn's optimizer state; use torchtitan's CheckpointManager"
        )
    values = {f.name: getattr(config, f.name) for f in fields(Trainer.Config) if f.init}
    values.update(
        optimizer=optimizer,
        checkpoint=checkpoint,
        parallelism=replace(config.parallelism, spmd_backend="partial_dtensor"),
        training=replace(config.training, disable_cuda_graphs=True),
    )
    return OnebitTrainer.Config(**values)


def _adam_settings(optimizer: OptimizersContainer.Config) -> dict[str, Any]:
    """The one Adam or AdamW setting of torchtitan's optimizer config: ``lr``, ``betas``,
    ``eps``, ``weight_decay`` (those it sets)."""
    groups = optimizer.param_groups
    names = {group.optimizer_name for group in groups}
    kwargs = [{k: group.optimizer_kwargs.get(k) for k in _ADAM_SETTINGS} for group in groups]
    if not groups or not names <= {"Adam", "AdamW"} or any(k != kwargs[0] for k in kwargs):
        raise NotImplementedError(
            f"{_NAME}: fn's optimizers take one param group, from one Adam or AdamW setting; "
            f"this config has {[(g.pattern, g.optimizer_name) for g in groups]}"
        )
    if names == {"Adam"} and kwargs[0]["weight_decay"]:
        raise NotImplementedError(
            f"{_NAME}: Adam's weight decay adds to the gradient; fn's is decoupled, as "
            "AdamW's: use AdamW"
        )
    return {k: v for k, v in kwargs[0].items() if v is not None}
