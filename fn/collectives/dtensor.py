"""Params sharded by FSDP2 (``torch.distributed.tensor.DTensor``), as the packages over it
(``fn.fsdp``, ``fn.diloco``) read and write them: this rank's local shard of a param, and a
local shard laid out again as its param, for ``torch.distributed.checkpoint``."""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["as_sharded_like", "local_shard"]

_DTENSOR_MODULE = "torch.distributed.tensor"


def _is_dtensor(x: Any) -> bool:
    # A DTensor exists only once its module is imported: reading it from sys.modules keeps
    # ``import fn`` from loading it (about 0.8 s of every process's start on CPU).
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and isinstance(x, module.DTensor)


def local_shard(x: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``x``: a ``DTensor``'s local tensor (a view: writing it in place
    writes the param), or ``x`` itself.

    Args:
        x: a tensor or a ``DTensor``.

    Returns:
        ``x.to_local()`` for a ``DTensor``, else ``x``.

    Example:
        >>> from fn.collectives import local_shard
        >>> local_shard(torch.ones(2))
        tensor([1., 1.])
    """
    return x.to_local() if _is_dtensor(x) else x


def as_sharded_like(local: Any, param: torch.Tensor) -> Any:
    """``local`` (this rank's shard of a tensor shaped like ``param``) as a ``DTensor`` laid out
    as ``param`` (its mesh, placements, shape and stride), so that
    ``torch.distributed.checkpoint`` saves one copy of each shard and can reshard it.

    Args:
        local: this rank's shard, or anything else (returned as it is).
        param: the param whose layout ``local`` takes.

    Returns:
        The ``DTensor``; ``local`` itself where ``param`` is a plain tensor or ``local`` is no
        tensor.

    Example:
        >>> from fn.collectives import as_sharded_like
        >>> as_sharded_like(torch.zeros(2), torch.ones(2))
        tensor([0., 0.])
    """
    if not _is_dtensor(param) or not isinstance(local, torch.Tensor):
        return local
    return sys.modules[_DTENSOR_MODULE].DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


def rows_of_ranks(row: torch.Tensor, param: torch.Tensor) -> Any:
    """``row``, this rank's 1-D row, as its part of a ``DTensor`` of every rank's row over
    ``param``'s mesh (its ``W`` ranks' rows end to end, ``W * len(row)`` values), so that
    ``torch.distributed.checkpoint`` saves each rank's row under one name.

    Args:
        row: this rank's row, 1-D, the same length on every rank.
        param: a ``DTensor`` param on the 1-D mesh whose ranks hold the rows.

    Returns:
        The ``DTensor``, sharded along its only dimension.

    Example:
        One rank here (under ``torchrun`` every rank holds its own row):

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor import distribute_tensor
        >>> from fn.collectives.dtensor import rows_of_ranks
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> param = distribute_tensor(torch.zeros(4), init_device_mesh("cpu", (1,)))
        >>> rows_of_ranks(torch.arange(3.0), param).full_tensor()
        tensor([0., 1., 2.])
        >>> dist.destroy_process_group()
    """
    tensor = sys.modules[_DTENSOR_MODULE]
    mesh = param.device_mesh
    shape = (mesh.size() * row.numel(),)
    return tensor.DTensor.from_local(row, mesh, [tensor.Shard(0)], shape=shape, stride=(1,))
