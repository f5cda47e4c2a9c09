"""What the constructor of a 1-bit optimizer on FSDP2 checks (:func:`agreed_setup`): on this
rank, the model and the options (:func:`model_problem`, :func:`settings_problem`), and on HSDP,
where FSDP2 shards every module inside the node (``fully_shard(..., mesh=mesh["shard"])``, ``L``
ranks) and the optimizer owns the replicate dimension (``replicate=mesh["replicate"]``, ``N``
nodes), the two meshes (:func:`replicate_problem`); then the ranks' agreement on all of it, and
on HSDP :func:`check_partitions` (one all-gather over the world, which also compares the meshes
with the ranks' nodes). Docs/algorithms.md, "1-bit Adam and 1-bit LAMB on FSDP2" and "... on
HSDP"."""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fn.collectives import Local, ProcessGroup, check_error_dtype
from fn.collectives.agreement import agree, digest
from fn.fsdp._fsdp2 import installed_reduce_scatter
from fn.fsdp.loco import ROOT
from fn.fsdp.onebit_layout import fsdp_modules, names_problem, one_dim
from fn.fsdp.onebit_masks import mask_checksum, mask_problem
from fn.fsdp.onebit_reduce_scatter import OnebitReduceScatter
from fn.transforms.clipping import check_max_norm

__all__ = [
    "Agreed", "Options", "agreed_setup", "check_partitions", "hsdp_form", "mesh_ranks",
    "model_problem", "node_keys", "replicate_problem", "settings_problem", "spanned_ranks",
]  # fmt: skip

Found = list[tuple[str, list[tuple[str, DTensor]]]]
Problem = tuple[type[Exception], str] | None


class Options(NamedTuple):
    """A 1-bit optimizer's options on FSDP2, beside its rule's hyperparameters (the Args of
    ``fn.fsdp.OnebitAdam``)."""

    exp_avg_mask: Any = None
    nonfinite: str = "raise"
    local_world_size: int | None = None
    error_dtype: torch.dtype = torch.float32
    replicate: DeviceMesh | None = None
    non_freeze: bool = False
    max_grad_norm: float | None = None
    accumulate_dtype: torch.dtype = torch.float32
    world: dist.ProcessGroup | None = None


class Agreed(NamedTuple):
    """What every rank agreed on at construction.

    Attributes:
        found: the model's FSDP2 modules with trainable params, ``(name, [(fqn, param)])``.
        masks: ``exp_avg_mask`` (``{param: mask}``, ``"auto"`` or ``None``).
        mask_setting: ``"auto"``, or the masks' checksum (``0``: none), which checkpoints hold.
        world_ranks: the global ranks of ``world``, in order.
    """

    found: Found
    masks: Any
    mask_setting: Any
    world_ranks: list[int]


def agreed_setup(
    name: str,
    model: Any,
    settings: dict[str, Any],
    options: Options,
    make_rule: Callable[[dict[str, Any], Any], Any],
    rule_name: str,
) -> Agreed:
    """The constructor's checks: this rank's of the model and the options, then every rank's
    agreement on them over ``options.world`` (the same error on every rank), and on HSDP the
    meshes' partition of the world.

    Args:
        name: the optimizer, which starts the messages.
        model: its ``model`` argument.
        settings: the rule's hyperparameters.
        options: the optimizer's options.
        make_rule: builds the rule from hyperparameters and a comm (it checks them).
        rule_name: the rule's name, which starts the messages of its checks.

    Returns:
        What the ranks agreed on.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` (on this rank).
        ValueError, NotImplementedError, TypeError: as ``fn.fsdp.OnebitAdam`` says.
    """
    world_ranks = spanned_ranks(name, options.world)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{name}: model must be the nn.Module that fully_shard sharded (the optimizer "
            "installs its reduce-scatter on the model's FSDP2 modules), got "
            f"{type(model).__name__}: pass the model itself, not model.parameters()"
        )
    o, found = options, fsdp_modules(model)
    problem = (
        model_problem(name, model, found, o.non_freeze, o.exp_avg_mask, o.nonfinite,
                      o.local_world_size)
        or replicate_problem(name, o.replicate, found, world_ranks, o.world is None)
        or settings_problem(name, o, lambda: make_rule(settings, Local()), rule_name)
    )  # fmt: skip
    masks = None if problem else o.exp_avg_mask
    order = [p for _, ps in found for _, p in ps]
    mask_setting = "auto" if isinstance(masks, str) else mask_checksum(masks, order)
    compared = {
        "hyperparameters": settings, "non_freeze": o.non_freeze, "exp_avg_mask": mask_setting,
        "nonfinite": o.nonfinite, "local_world_size": o.local_world_size,
        "error_dtype": str(o.error_dtype), "max_grad_norm": o.max_grad_norm,
        "accumulate_dtype": str(o.accumulate_dtype),
        "model": [(m, [(n, tuple(p.shape)) for n, p in ps]) for m, ps in found],
        "replicate": getattr(o.replicate, "shape", o.replicate),
    }  # fmt: skip
    device = found[0][1][0][1].device if found else "cpu"
    # over world (None: the default group), whatever the meshes: ranks that passed
    # different meshes or replicate= on some ranks only still meet in one collective
    agree(ProcessGroup(o.world), name, compared, problem, what="settings or models",
          ranks=world_ranks, device=device)  # fmt: skip
    if o.replicate is not None:
        shard = found[0][1][0][1].device_mesh
        check_partitions(name, shard, o.replicate, device, o.world, world_ranks)
    return Agreed(found, masks, mask_setting, world_ranks)


def settings_problem(
    name: str, options: Options, check_rule: Callable[[], Any], rule_name: str
) -> Problem:
    """What this rank finds wrong with the options and, by ``check_rule`` (which builds the
    rule ``rule_name``), the hyperparameters, as a problem (its message without the name of the
    check that raised it: ``agree`` starts it with the optimizer's)."""
    try:
        check_error_dtype(name, options.error_dtype)
        check_max_norm(name, options.max_grad_norm)
        if options.accumulate_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                "accumulate_dtype must be torch.float32 or torch.bfloat16, got "
                f"{options.accumulate_dtype!r}"
            )
        check_rule()
    except (ValueError, TypeError, NotImplementedError) as error:
        message = str(error)
        for who in (name, rule_name):
            message = message.removeprefix(f"{who}: ")
        return type(error), message
    return None


# What fn.fsdp's 1-bit optimizers call on every FSDP2 module they drive.
_FSDP2_METHODS = (
    "set_custom_reduce_scatter",
    "set_reduce_scatter_unused_params",
    "set_all_reduce_hook",
)


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
    missing = [m for m in _FSDP2_METHODS if not hasattr(FSDPModule, m)]
    if missing:
        return NotImplementedError, (
            f"torch {torch.__version__}'s FSDP2 lacks {', '.join(missing)}, which the 1-bit "
            "optimizers drive; install a torch whose FSDPModule has them (fn is tested with "
            "torch 2.13.0)"
        )
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
    if len({ps[0][1].device_mesh for _, ps in found}) > 1:
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
            "not built yet on FSDP2: step() raises fn.NonFiniteError with nothing changed; "
            "skip the batch with zero_grad()",
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
    return names_problem(found) or mask_problem(found, exp_avg_mask)


def spanned_ranks(name: str, world: Any) -> list[int]:
    """The global ranks of ``world``, the process group a 1-bit optimizer spans (``None``: the
    default group), in its order.

    Args:
        name: the optimizer, which starts the messages.
        world: its ``world`` argument.

    Returns:
        The ranks.

    Raises:
        TypeError: ``world`` is neither ``None`` nor a ``torch.distributed.ProcessGroup``.
        ValueError: this rank is not in ``world``.

        Both on this rank alone (the ranks cannot agree over a group this rank is not in).

    Example:
        >>> import torch.distributed as dist
        >>> from fn.fsdp.onebit_checks import spanned_ranks
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> spanned_ranks("fn.fsdp.OnebitAdam", None)
        [0]
        >>> dist.destroy_process_group()
    """
    if world is None:
        return list(range(dist.get_world_size()))
    if world is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{name}: rank {dist.get_rank()} is not in world= (dist.new_group hands a rank "
            "outside the group a placeholder): pass the group of the ranks this rank trains with"
        )
    if not isinstance(world, dist.ProcessGroup):
        raise TypeError(
            f"{name}: world must be a torch.distributed.ProcessGroup (such as "
            f'mesh["shard"].get_group()) or None, got {type(world).__name__}'
        )
    return dist.get_process_group_ranks(world)


def _spanned(default: bool, ranks: list[int]) -> str:
    """How the messages name the ranks an optimizer spans."""
    return "the world" if default else f"world= (ranks {ranks})"


def replicate_problem(
    name: str, replicate: Any, found: Found, world: list[int] | None = None, default: bool = True
) -> tuple[type[Exception], str] | None:
    """What this rank finds wrong with ``replicate`` and the model's 1-D shard mesh (``found``,
    the FSDP2 modules, all on that mesh), or ``None``. Without ``replicate``, the shard mesh
    must hold every rank of ``world`` (the global ranks the optimizer spans; ``None``: the
    default group's, and ``default`` says whether they are); with it, the shard and replicate
    meshes must lie inside ``world`` and their product be its size."""
    shard = found[0][1][0][1].device_mesh
    rank = dist.get_rank()
    world = list(range(dist.get_world_size())) if world is None else world
    size, where = len(world), _spanned(default, world)
    meshes = [shard]
    if isinstance(replicate, DeviceMesh) and replicate.ndim == 1:
        meshes.append(replicate)
    if any(set(mesh_ranks(mesh)) - set(world) for mesh in meshes):
        return ValueError, (
            f"the model's shard mesh or replicate holds ranks outside {where}: world must hold "
            "every rank of the shard mesh (with replicate=, of both meshes)"
        )
    if replicate is None:
        if shard.size() < size:
            return ValueError, (
                f"the model's 1-D shard mesh holds {shard.size()} of the {size} ranks"
                f"{'' if default else ' of world='}: the ranks outside it would drift apart "
                "unnoticed. Shard over every rank (under Lightning: ModelParallelStrategy("
                "data_parallel_size=<world size>, tensor_parallel_size=1), whose default "
                "data_parallel_size is the number of nodes), or for HSDP pass replicate= (the "
                f"mesh across the nodes): {hsdp_form(name)}"
                + ("" if default else "; or pass the shard mesh's group as world=")
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
    if len(shards) * len(replicas) != size:
        size_of = "world size" if default else "size of world="
        return ValueError, (
            f"the shard mesh ({len(shards)} ranks) times replicate ({len(replicas)}) is not the "
            f"{size_of} {size}: {hsdp_form(name)}"
        )
    return None


def node_keys(rank: int) -> tuple[int, int]:
    """What tells this rank's node from the others: the digest of its hostname, and its node
    by torchrun's environment (``GROUP_RANK``, the node's index, else ``rank //
    LOCAL_WORLD_SIZE``, torchrun numbering the ranks node by node), ``-1`` when neither is
    set."""
    host = digest(socket.gethostname())
    group_rank, local_world = os.environ.get("GROUP_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if group_rank is not None and group_rank.isdigit():
        return host, int(group_rank)
    if local_world is not None and local_world.isdigit() and int(local_world) > 0:
        return host, rank // int(local_world)
    return host, -1


def _nodes(keys: list[list[int]]) -> tuple[list[int], str] | None:
    """Every rank's node from the ranks' :func:`node_keys` (by rank), and where it comes from:
    the hostnames where they differ, else torchrun's environment where every rank has it, else
    ``None`` (one host, no environment: nothing is known)."""
    hosts, env = [k[0] for k in keys], [k[1] for k in keys]
    if len(set(hosts)) > 1:
        return hosts, "their hostnames"
    return (env, "torchrun's GROUP_RANK or LOCAL_WORLD_SIZE") if min(env) >= 0 else None


def _check_nodes(
    name: str,
    shards: list[list[int]],
    replicas: list[list[int]],
    keys: list[list[int]],
    ranks: list[int],
) -> None:
    """Raises ``ValueError`` when the mesh's dimensions are swapped (every shard group spans
    nodes while every replicate group lies inside one); warns when a shard group spans nodes
    otherwise while replicate groups have several ranks. The groups hold global ranks,
    ``keys`` are the :func:`node_keys` of ``ranks`` (the ranks the optimizer spans), in
    order. The same on every rank: every input is."""
    found = _nodes(keys)
    if found is None:
        return
    nodes, source = found
    node = dict(zip(ranks, nodes, strict=True))
    spanning = [g for g in shards if len({node[r] for r in g}) > 1]
    if not spanning or len(replicas[0]) == 1:  # no replicate dimension: 1-D FSDP2 across nodes
        return
    where = f"ranks {spanning[0]} are on {len({node[r] for r in spanning[0]})} nodes, by {source}"
    if all(len({node[r] for r in g}) == 1 for g in replicas):
        raise ValueError(
            f"{name}: the shard mesh spans nodes ({where}) while every replicate group lies "
            f"inside one node (ranks {replicas[0]}): the mesh's dimension names look swapped, so "
            "FSDP2 would shard across the nodes and the 1-bit allreduce would run inside them. "
            'The nodes\' dimension comes first and is "replicate" (N nodes of L ranks): '
            f"{hsdp_form(name)}"
        )
    warnings.warn(
        f"{name}: the shard mesh spans nodes ({where}): FSDP2's all-gathers and "
        "reduce-scatters cross nodes, where HSDP keeps them inside one and sends only the "
        f"1-bit allreduce across: {hsdp_form(name)}",
        UserWarning,
        stacklevel=5,  # the optimizer's caller
    )


def check_partitions(
    name: str,
    shard: DeviceMesh,
    replicate: DeviceMesh,
    device: torch.device | str,
    world: dist.ProcessGroup | None = None,
    ranks: list[int] | None = None,
) -> None:
    """Raises ``ValueError`` on every rank unless every rank's shard ranks and replicate ranks
    each form a partition of ``world`` (the group the optimizer spans, ``None``: the default
    group; ``ranks``: its global ranks, in order), or where the ranks' nodes show the mesh's
    dimensions swapped (the shard groups across the nodes, the replicate groups inside them);
    warns on every rank where a shard group spans nodes otherwise (:func:`_check_nodes`). One
    all-gather over ``world`` of every rank's two sets as 0/1 rows and its :func:`node_keys`;
    every rank reaches the same verdict. Every mesh rank lies in ``world``
    (:func:`replicate_problem` checked it)."""
    ranks = list(range(dist.get_world_size(world))) if ranks is None else ranks
    where = _spanned(world is None, ranks)
    size, index = len(ranks), {r: i for i, r in enumerate(ranks)}
    mine = torch.zeros(2 * size + 16, dtype=torch.uint8)
    mine[[index[r] for r in mesh_ranks(shard)]] = 1
    mine[[size + index[r] for r in mesh_ranks(replicate)]] = 1
    mine[2 * size :] = torch.tensor(node_keys(dist.get_rank())).view(torch.uint8)
    gathered = ProcessGroup(world).all_gather(mine.to(device)).cpu()  # [size, 2 size + 16]
    rows = gathered[:, : 2 * size].bool().view(size, 2, size)
    groups = []  # the shard groups, then the replicate groups: each once, sorted
    for kind, sets in (("shard", rows[:, 0]), ("replicate", rows[:, 1])):
        held = [[ranks[i] for i in sets[r].nonzero().view(-1).tolist()] for r in range(size)]
        for r in range(size):
            if not bool(sets[r, r]) or not bool((sets[sets[r]] == sets[r]).all()):
                raise ValueError(
                    f"{name}: the ranks' {kind} meshes do not partition {where} (rank "
                    f"{ranks[r]}'s holds {held[r]}): every rank must pass the dimensions of one "
                    f"2-D mesh: {hsdp_form(name)}"
                )
        groups.append([list(g) for g in sorted({tuple(h) for h in held})])
    keys = gathered[:, 2 * size :].contiguous().view(torch.int64).tolist()
    _check_nodes(name, *groups, keys, ranks)
