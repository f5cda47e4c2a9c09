"""``OnebitCheckpointManager``: torchtitan's ``CheckpointManager`` that loads an ``fn.fsdp``
1-bit optimizer's state on any mesh shape, and starts it from a torchtitan AdamW checkpoint
(``m`` and ``v`` carried over, the error feedback from zero)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpoint import OPTIMIZER, TRAIN_STATE, CheckpointManager
from torchtitan.components.checkpointer.utils import canonical_fqn

from fn.fsdp import ShardedOnebitOptimizer, read_onebit_state
from fn.integrations.torchtitan.optimizer import OnebitOptimizersContainer

__all__ = ["OnebitCheckpointManager"]

_NAME = "fn.integrations.torchtitan"


class OnebitCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` (every setting and the save path its own) whose loads
    read the optimizer's state by what the checkpoint holds:

    - an ``fn.fsdp`` optimizer's state (its ``header``): read with
      :func:`fn.fsdp.read_onebit_state`, checked against this model and these settings before
      anything changes; the same mesh shape resumes bit for bit, another (another world size,
      HSDP to FSDP or back) reshards ``v`` and the momentum and restarts the error feedback;
    - torchtitan's AdamW (or Adam) state (``state.<param>.exp_avg``, ...): the optimizer starts
      from it (:meth:`fn.fsdp.ShardedOnebitOptimizer.load_adam_state`: ``m``, ``v`` and the step
      count carried over, the error feedback from zero, one warning), so a job trained with
      AdamW goes on with 1-bit Adam. DCP reshards the moments from whatever mesh saved them.

    The model, the data loader, the LR schedulers and the train state load as torchtitan
    loads them. Checkpoints on the local filesystem.

    Args:
        config: torchtitan's checkpoint settings.
        **kwargs: ``CheckpointManager``'s.

    Example:
        >>> from fn.integrations.torchtitan import OnebitCheckpointManager
        >>> config = OnebitCheckpointManager.Config(enable=True, interval=100)
        >>> config.interval, config.build is not None
        (100, True)
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's ``CheckpointManager.Config``."""

    def __init__(self, config: OnebitCheckpointManager.Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)  # the base's, with fn's Config in the signature

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """``CheckpointManager.dcp_load``, with the optimizer's state read as the checkpoint
        holds it (see the class docstring).

        Args:
            state_dict: the states to load (torchtitan's, flattened).
            checkpoint_id: the checkpoint's directory.
            from_hf: whether it is a Hugging Face checkpoint (model only).
            from_quantized: whether that is quantized.

        Raises:
            ValueError: the checkpoint holds neither form of optimizer state, or an ``fn``
                state of another model or other settings; nothing was loaded.
        """
        container = state_dict.get(OPTIMIZER)
        if from_hf or not isinstance(container, OnebitOptimizersContainer):
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        optimizer = container.optimizer
        rest = {k: v for k, v in state_dict.items() if k != OPTIMIZER}
        saved = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
        if f"{OPTIMIZER}.header" in saved:
            state = read_onebit_state(optimizer, checkpoint_id, OPTIMIZER)
            super().dcp_load(rest, checkpoint_id, from_hf, from_quantized)
            optimizer.load_state_dict(state)
        elif any(key.startswith(f"{OPTIMIZER}.state.") for key in saved):
            count, exp_avg, exp_avg_sq = _adam_state(container, checkpoint_id)
            super().dcp_load(rest, checkpoint_id, from_hf, from_quantized)
            optimizer.load_adam_state(count, exp_avg, exp_avg_sq)
        elif not any(key.startswith(TRAIN_STATE) for key in saved):
            raise ValueError(
                f"{_NAME}: {checkpoint_id} holds the model only (torchtitan's last save under "
                "--checkpoint.last_save_model_only, its default), which a job cannot go on "
                "from: resume from an earlier full checkpoint (--checkpoint.load_step), or "
                "start a new job from this model (--checkpoint.initial_load_path with another "
                "--dump_folder: the optimizer starts afresh); nothing was loaded"
            )
        else:
            raise ValueError(
                f"{_NAME}: {checkpoint_id} holds no optimizer state that {optimizer.name} "
                "reads (neither its own nor torchtitan's Adam or AdamW state); leave the "
                "optimizer out (--checkpoint.exclude_from_loading optimizer) to load the rest; "
                "nothing was loaded"
            )


def _adam_state(
    container: OnebitOptimizersContainer, checkpoint_id: str
) -> tuple[int, dict[torch.Tensor, torch.Tensor], dict[torch.Tensor, torch.Tensor]]:
    """torchtitan's Adam or AdamW state in ``checkpoint_id``, read into tensors laid out as the
    model's params: the step count and ``exp_avg``, ``exp_avg_sq`` by param."""
    optimizer: ShardedOnebitOptimizer = container.optimizer
    (model,) = container.model_parts
    moments: dict[str, dict[torch.Tensor, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    template: dict[str, torch.Tensor] = {}
    step_key = None
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        fqn = canonical_fqn(name)
        step_key = step_key or f"state.{fqn}.step"
        for field, by_param in moments.items():
            by_param[param] = template[f"state.{fqn}.{field}"] = torch.zeros_like(param)
    template[step_key] = torch.zeros((), dtype=torch.float32)
    try:
        dcp.load({OPTIMIZER: template}, checkpoint_id=checkpoint_id)
    except CheckpointException as error:
        rank, (cause, _) = next(iter(error.failures.items()))
        raise ValueError(
            f"{_NAME}: {checkpoint_id} holds no Adam state of this model for "
            f"{optimizer.name} to start from: rank {rank}: {type(cause).__name__}: {cause}; "
            "nothing was loaded"
        ) from None
    return round(float(template[step_key])), moments["exp_avg"], moments["exp_avg_sq"]
