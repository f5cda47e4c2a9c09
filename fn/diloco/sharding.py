"""Sharded workers: each worker's model sharded by FSDP2 (``fully_shard``, ``fn.fsdp``), its
parameters ``DTensor`` s. DiLoCo's group then spans the workers' ranks at one shard position,
each rank syncs its own local shard, and the agreement that a pseudo-gradient is finite is
summed also over the ranks inside a worker (the parameters' device mesh), so that it covers
every rank of every worker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fn.collectives import Comm, ProcessGroup

__all__ = ["worker_mesh_comms"]


def worker_mesh_comms(params: Sequence[torch.Tensor], timeout: Any) -> list[Comm]:
    """The groups of the ranks inside one worker: one per dimension of the ``DTensor``
    parameters' device mesh (a 1-D shard mesh, or HSDP's replicate and shard dimensions); none
    where the parameters are plain tensors.

    Args:
        params: the worker's parameters.
        timeout: the collectives' timeout, as :class:`fn.collectives.ProcessGroup` takes it.

    Returns:
        One :class:`~fn.collectives.ProcessGroup` per mesh dimension (summing a value over each
        in turn sums it over the worker's ranks).

    Raises:
        NotImplementedError: some parameters are ``DTensor`` s and others not, or they lie on
            more than one device mesh.

    Example:
        >>> from fn.diloco.sharding import worker_mesh_comms
        >>> worker_mesh_comms([torch.zeros(2)], timeout=None)
        []
    """
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    if not meshes:
        return []
    if len(meshes) > 1 or not all(isinstance(p, DTensor) for p in params):
        raise NotImplementedError(
            "DiLoCo: sharded parameters must all be DTensors on one device mesh (the worker's "
            f"FSDP2 mesh); found {len(meshes)} meshes and "
            f"{sum(not isinstance(p, DTensor) for p in params)} plain tensors"
        )
    (mesh,) = meshes
    return [ProcessGroup(mesh.get_group(dim), timeout=timeout) for dim in range(mesh.ndim)]
