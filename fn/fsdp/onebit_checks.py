"""What the constructor of a 1-bit optimizer on FSDP2 checks on this rank before the ranks'
agreement: the model and the options (:func:`model_problem`), and on HSDP, where FSDP2 shards
every module inside the node (``fully_shard(..., mesh=mesh["shard"])``, ``L`` ranks) and the
optimizer owns the replicate dimension (``replicate=mesh["replicate"]``, ``N`` nodes), the two
meshes (:func:`replicate_problem`; then :func:`check_partitions`, one all-gather over the
world). Docs/algorithms.md, "1-bit Adam and 1-bit LAMB on FSDP2" and "... on HSDP"."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fn.collectives import ProcessGroup
from fn.fsdp._fsdp2 import installed_reduce_scatter
from fn.fsdp.loco import ROOT
from fn.fsdp.onebit_layout import one_dim
from fn.fsdp.onebit_masks import mask_problem
from fn.fsdp.onebit_reduce_scatter import OnebitReduceScatter

__all__ = ["check_partitions", "hsdp_form", "mesh_ranks", "model_problem", "replicate_problem"]

Found = list[tuple[str, list[tuple[str, DTensor]]]]


def hsdp_form(name: str) -> str:
    """How a model is set up for HSDP under the optimizer ``name``, for the messages."""
    short = name.rsplit(".", 1)[-1]
    return (
        'mesh = init_device_mesh(device, (N, L), mesh_dim_names=("replicate", "shard")); '
        'fully_shard(..., mesh=mesh["shard"]) for every module; '
        f'{short}(model, ..., replicate=mesh["replicate"])'
    )


def mesh_ranks(mesh: DeviceMesh) -> list[int]:
    """The global ranks of a 1-D mesh, in its order."""
    return [int(r) for r in mesh.mesh.reshape(-1).tolist()]


def model_problem(
    name: str,
    model: nn.Module,
    found: Found,
    non_freeze: bool,
    exp_avg_mask: Any,
    nonfinite: str,
    local_world_size: int | None,
) -> tuple[type[Exception], str] | None:
    """What this rank finds wrong with the model or the options of the optimizer ``name``,
    or ``None``."""
    if not found:
        return ValueError, "model has no FSDP2 module (fully_shard) with trainable params"
    inside = {id(p) for _, ps in found for _, p in ps}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        return ValueError, f"trainable params outside every FSDP2 module: {outside}"
    if not one_dim(found):
        return NotImplementedError, (
            "a model sharded on a 2-D mesh is not supported (FSDP2 would run its own dense "
            "all-reduce across the replicate dimension, the traffic 1-bit replaces); for HSDP "
            f"shard inside the node and pass the replicate dimension: {hsdp_form(name)}"
        )
    groups = {ps[0][1].device_mesh for _, ps in found}
    if len(groups) > 1:
        return NotImplementedError, "FSDP2 modules on different meshes are not supported"
    taken = [
        fqn or ROOT
        for fqn, module in model.named_modules()
        if isinstance(installed_reduce_scatter(module), OnebitReduceScatter)
    ]
    if taken:
        return ValueError, f"the FSDP2 modules {taken} already have an fn.fsdp optimizer"
    unsupported = {
        "non_freeze": (non_freeze, "one module's vector would mix dense and compressed params"),
        "nonfinite='skip'": (
            nonfinite == "skip",
            "the modules reduce-scattered before a non-finite one have already advanced",
        ),
        "local_world_size": (
            local_world_size is not None,
            "the hierarchical collective hands a rank another chunk than its FSDP2 shard; "
            f"across nodes use HSDP (replicate=): {hsdp_form(name)}",
        ),
    }
    for option, (used, why) in unsupported.items():
        if used:
            return NotImplementedError, f"{option} is not supported yet on FSDP2: {why}"
    if nonfinite != "raise":
        return ValueError, f"nonfinite must be 'raise', got {nonfinite!r}"
    return mask_problem(found, exp_avg_mask)


def replicate_problem(
    name: str, replicate: Any, found: Found
) -> tuple[type[Exception], str] | None:
    """What this rank finds wrong with ``replicate`` and the model's 1-D shard mesh (``found``,
    the FSDP2 modules, all on that mesh), or ``None``. Without ``replicate``, the shard mesh
    must hold every rank of the default group."""
    shard = found[0][1][0][1].device_mesh
    world, rank = dist.get_world_size(), dist.get_rank()
    if replicate is None:
        if shard.size() < world:
            return ValueError, (
                f"the model's 1-D shard mesh holds {shard.size()} of the {world} ranks: the "
                "ranks outside it would drift apart unnoticed. Shard over every rank (under "
                "Lightning: ModelParallelStrategy(data_parallel_size=<world size>, "
                "tensor_parallel_size=1), whose default data_parallel_size is the number of "
                "nodes), or for HSDP pass replicate= (the mesh across the nodes): "
                f"{hsdp_form(name)}"
            )
        return None
    if not isinstance(replicate, DeviceMesh) or replicate.ndim != 1:
        got = replicate.ndim if isinstance(replicate, DeviceMesh) else type(replicate).__name__
        return TypeError, (
            f'replicate must be a 1-D DeviceMesh (mesh["replicate"]), got {got}'
            + (" dims" if isinstance(got, int) else "")
        )
    shards, replicas = mesh_ranks(shard), mesh_ranks(replicate)
    if rank not in shards or rank not in replicas:
        return ValueError, f"rank {rank} is not in both the shard mesh and replicate"
    if set(shards) & set(replicas) != {rank}:
        return ValueError, (
            f"the shard mesh {shards} and replicate {replicas} share more ranks than this one "
            f"({rank}): replicate must be the other dimension of the shard mesh's 2-D mesh"
        )
    if len(shards) * len(replicas) != world:
        return ValueError, (
            f"the shard mesh ({len(shards)} ranks) times replicate ({len(replicas)}) is not the "
            f"world size {world}: {hsdp_form(name)}"
        )
    return None


def check_partitions(
    name: str, shard: DeviceMesh, replicate: DeviceMesh, device: torch.device | str
) -> None:
    """Raises ``ValueError`` on every rank unless every rank's shard ranks and replicate ranks
    each form a partition of the world (one all-gather over the world of every rank's two sets
    as 0/1 rows; every rank reaches the same verdict)."""
    world = dist.get_world_size()
    mine = torch.zeros(2, world, dtype=torch.uint8)
    mine[0, mesh_ranks(shard)] = 1
    mine[1, mesh_ranks(replicate)] = 1
    rows = ProcessGroup(None).all_gather(mine.to(device)).cpu().bool()  # [world, 2, world]
    for kind, sets in (("shard", rows[:, 0]), ("replicate", rows[:, 1])):
        for r in range(world):
            same = bool((sets[sets[r]] == sets[r]).all())
            if not bool(sets[r, r]) or not same:
                raise ValueError(
                    f"{name}: the ranks' {kind} meshes do not partition the world (rank {r}'s "
                    f"holds {sets[r].nonzero().view(-1).tolist()}): every rank must pass the "
                    f"dimensions of one 2-D mesh: {hsdp_form(name)}"
                )
