"""``TrainingCheckpoint``: model, optimizer, step and error feedback in one DCP checkpoint.

FSDP2's checkpoints are ``torch.distributed.checkpoint`` (DCP) checkpoints of sharded state
dicts (``torch.distributed.checkpoint.state_dict.get_state_dict``): every rank writes its own
shards. fn's error feedback is per rank too; a :class:`~fn.fsdp.LocoReduceScatterHandle` keys it
by rank, so the same ``dcp.save`` / ``dcp.load`` carries it. Resuming needs the same world size
and model: the error feedback of one rank means nothing to another.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fn.fsdp.loco import LocoReduceScatterHandle

__all__ = ["TrainingCheckpoint"]


class TrainingCheckpoint:
    """A DCP ``Stateful`` of an FSDP2 model, its optimizer, a step count and fn's handle.

    Args:
        model: the FSDP2 model.
        optimizer: its ``torch.optim`` optimizer.
        handle: the :func:`~fn.fsdp.loco_reduce_scatter` handle, or ``None``.
        step: the number of optimizer steps taken (saved, and set again by a load).

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> from fn.fsdp import TrainingCheckpoint
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> ckpt = TrainingCheckpoint(model, torch.optim.AdamW(model.parameters()), step=3)
        >>> path = tempfile.mkdtemp()
        >>> ckpt.save(path)
        >>> ckpt.step = 0
        >>> ckpt.load(path)
        >>> ckpt.step
        3
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        handle: LocoReduceScatterHandle | None = None,
        *,
        step: int = 0,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.handle = handle
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optim", "step"[, "loco"]}``: sharded model and optimizer state dicts."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {
            "model": model_state,
            "optim": optim_state,
            "step": torch.tensor(self.step, dtype=torch.int64),
        }
        if self.handle is not None:
            state["loco"] = self.handle.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output into the model, optimizer and handle."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        if self.handle is not None:
            self.handle.load_state_dict(state_dict["loco"])
        self.step = int(state_dict["step"])

    def save(self, path: str | os.PathLike) -> None:
        """Writes this rank's part of the checkpoint to the directory ``path`` (collective)."""
        dcp.save({"training": self}, checkpoint_id=path)

    def load(self, path: str | os.PathLike) -> None:
        """Restores everything from the checkpoint directory ``path`` (collective)."""
        dcp.load({"training": self}, checkpoint_id=path)
