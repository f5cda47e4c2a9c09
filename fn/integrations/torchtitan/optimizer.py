"""``OnebitOptimizersContainer``: torchtitan's optimizer container holding one ``fn.fsdp``
1-bit optimizer (:class:`~fn.fsdp.OnebitAdam` or :class:`~fn.fsdp.OnebitLamb`) over the
model's FSDP2 modules, its hyperparameters set in the config."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import torch
import torch.distributed.device_mesh
import tyro
from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP, Configurable

from fn.fsdp import OnebitAdam, OnebitLamb, ShardedOnebitOptimizer

__all__ = ["OnebitOptimizersContainer"]

_OPTIMIZERS: dict[str, type[ShardedOnebitOptimizer]] = {
    "OnebitAdam": OnebitAdam,
    "OnebitLamb": OnebitLamb,
}
_DEFAULTS = {k: p.default for k, p in inspect.signature(OnebitAdam).parameters.items()}


class OnebitOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` holding one ``fn.fsdp`` 1-bit optimizer over the
    whole model (its FSDP2 modules sharded on the shard mesh, as
    :class:`~fn.integrations.torchtitan.OnebitTrainer` lays them out).

    ``step()``, ``zero_grad()`` and the LR schedulers act on that optimizer, which reads
    ``param_groups[0]["lr"]`` at every step. ``state_dict()`` is the optimizer's own DCP state
    dict (its shards, its packed momentum, each rank's error feedback under its own name), not
    torchtitan's per-param form, which cannot hold the compressed state; torchtitan's
    ``CheckpointManager`` saves it as it is, and
    :class:`~fn.integrations.torchtitan.OnebitCheckpointManager` loads it on any mesh shape.

    Args:
        config: the optimizer's settings (:class:`OnebitOptimizersContainer.Config`).
        model_parts: the model, one part (pipeline parallelism is refused earlier).

    Raises:
        NotImplementedError: several model parts (pipeline parallelism).
        ValueError: both ``exp_avg_mask`` and ``exp_avg_mask_fn`` set; and what the
            optimizer's constructor raises, on every rank (settings, the model's layout).

    Example:
        >>> import torch, torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> from fn.integrations.torchtitan import OnebitOptimizersContainer
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(2, 1), mesh=init_device_mesh("cpu", (1,)))
        >>> config = OnebitOptimizersContainer.Config(lr=1e-2, freeze_step=2)
        >>> container = config.build(model_parts=[model])
        >>> type(container.optimizers[0]).__name__, container.optimizers[0].count
        ('OnebitAdam', 0)
        >>> dist.destroy_process_group()
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        """The settings of the optimizer (``--optimizer.<name>`` on torchtitan's command
        line). ``max_grad_norm`` and ``replicate`` are not set here:
        :class:`~fn.integrations.torchtitan.OnebitTrainer` sets them from
        ``--training.max_norm`` and the data-parallel degrees."""

        name: Literal["OnebitAdam", "OnebitLamb"] = "OnebitAdam"
        """Which optimizer, ``fn.fsdp.OnebitAdam`` or ``fn.fsdp.OnebitLamb``."""

        lr: float = _DEFAULTS["lr"]
        """The peak learning rate (torchtitan's LR schedulers scale it)."""

        freeze_step: int | Literal["auto"] = _DEFAULTS["freeze_step"]
        """The first compressed update, or ``"auto"`` (the warmup ends once the variance has
        caught up with the gradients)."""

        betas: tuple[float, float] = _DEFAULTS["betas"]
        eps: float = _DEFAULTS["eps"]
        weight_decay: float = _DEFAULTS["weight_decay"]
        safeguard: bool = _DEFAULTS["safeguard"]
        """Clip the compressed update's ``m / (sqrt(v) + eps)`` (``fn.onebit_adam``'s)."""

        error_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
        """The storage of the error feedback."""

        exp_avg_mask: Literal["auto"] | None = None
        """``"auto"``: mask the momentum where the averaged gradient was exactly 0 at every
        warmup update (``fn.fsdp.OnebitAdam``'s ``exp_avg_mask="auto"``)."""

        exp_avg_mask_fn: Annotated[
            Callable[[str, torch.nn.Parameter], torch.Tensor | None] | None, tyro.conf.Suppress
        ] = None
        """Masks by hand, set in a Python config function. Called with each trainable
        param's name (as in torchtitan's checkpoints, ``layers.0.attention.wqkv.weight``) and
        the param, it returns the param's mask (0s and 1s, broadcastable
        to the param's full shape) or ``None`` (no mask)."""

        accumulate_dtype: Literal["float32", "bfloat16"] = "float32"
        """The dtype of the local gradient that a 1-D mesh accumulates over the
        micro-batches of a compressed update."""

        optimizer_kwargs: dict[str, float] = field(default_factory=dict)
        """Further keyword arguments of the optimizer (``OnebitLamb``'s ``max_coeff``,
        ``min_coeff``, ``coeff_beta``, ``factor_max``, ``factor_min``,
        ``factor_threshold``)."""

        max_grad_norm: Annotated[float | None, tyro.conf.Suppress] = None
        """The clipping norm, which the trainer sets from ``--training.max_norm``."""

        replicate: Annotated[
            torch.distributed.device_mesh.DeviceMesh | None, tyro.conf.Suppress
        ] = None
        """The replicate mesh of HSDP, or ``None``, which the trainer sets."""

        def to_dict(self) -> dict[str, Any]:
            """The settings as a dict, without the mesh (which has no serial form).

            Returns:
                The fields by name, as torchtitan logs and saves its config.
            """
            settings = Configurable.Config.to_dict(replace(self, replicate=None))
            settings.pop("replicate")
            return settings

    optimizers: list[ShardedOnebitOptimizer]

    def __init__(
        self, config: OnebitOptimizersContainer.Config, *, model_parts: list[torch.nn.Module]
    ) -> None:
        if len(model_parts) != 1:
            raise NotImplementedError(
                "fn.integrations.torchtitan: one model part is supported, got "
                f"{len(model_parts)} (pipeline parallelism is not built)"
            )
        (model,) = model_parts
        if config.exp_avg_mask is not None and config.exp_avg_mask_fn is not None:
            raise ValueError(
                "fn.integrations.torchtitan: set exp_avg_mask or exp_avg_mask_fn, not both"
            )
        masks: Any = config.exp_avg_mask
        if config.exp_avg_mask_fn is not None:
            masks = _hand_masks(model, config.exp_avg_mask_fn)
        optimizer = _OPTIMIZERS[config.name](
            model,
            lr=config.lr,
            freeze_step=config.freeze_step,
            betas=tuple(config.betas),
            eps=config.eps,
            weight_decay=config.weight_decay,
            safeguard=config.safeguard,
            exp_avg_mask=masks,
            error_dtype=TORCH_DTYPE_MAP[config.error_dtype],
            replicate=config.replicate,
            max_grad_norm=config.max_grad_norm,
            accumulate_dtype=TORCH_DTYPE_MAP[config.accumulate_dtype],
            **config.optimizer_kwargs,
        )
        self.optimizers = [optimizer]
        self.model_parts = model_parts
        self._post_init(optimizer.param_groups[0]["params"])

    @property
    def optimizer(self) -> ShardedOnebitOptimizer:
        """The ``fn.fsdp`` optimizer."""
        return self.optimizers[0]

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's own DCP state dict (``fn.fsdp.ShardedOnebitOptimizer.state_dict``).

        Returns:
            The state dict, one layout at every update.
        """
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict` (checked first: nothing changes when it is of another
        model or other settings).

        Args:
            state_dict: what :meth:`state_dict` returned, or a DCP read of it.
        """
        self.optimizer.load_state_dict(dict(state_dict))


def _hand_masks(
    model: nn.Module, mask_fn: Callable[[str, nn.Parameter], torch.Tensor | None]
) -> dict[nn.Parameter, torch.Tensor]:
    """``exp_avg_mask`` by param from ``mask_fn(name, param)`` over the trainable params (by
    their names in torchtitan's checkpoints, without activation checkpointing's wrapper)."""
    trainable = [(canonical_fqn(n), p) for n, p in model.named_parameters() if p.requires_grad]
    masks = {param: mask_fn(name, param) for name, param in trainable}
    return {param: mask for param, mask in masks.items() if mask is not None}
