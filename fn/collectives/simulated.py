"""``Simulated(world_size)``: W workers in one process, every per-rank value on a leading axis.

JAX ``vmap(axis_name=...)`` style: ``simulate(f, comm)`` runs ``f`` once per rank under
``torch.func.vmap`` over the leading rank axis of every tensor argument, and the collectives of
``comm`` act across that axis (custom ops with vmap rules, see ``_sim_ops``).

Nested vmaps:

- a ``vmap`` *inside* ``simulate`` (e.g. per-example work on each rank) is supported: a collective
  called inside it communicates every element of the inner batch, as one larger message would
  on a real backend. Bytes are counted in Python from the shape the call sees, i.e. for ONE
  element of the inner batch (``ProcessGroup`` cannot run under vmap, so there is nothing to
  match; multiply by the inner batch size for the wire volume);
- ``vmap(simulate(f, comm))`` (an outer batch of whole simulations) also runs; bytes are
  counted per element of the outer batch likewise;
- ``simulate`` of the same comm cannot be nested (``RuntimeError``); two different ``Simulated``
  comms can be (each treats the other's rank axis as an inner batch).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fn.collectives import _sim_ops
from fn.collectives.comm import ByteCounter, ReduceOp, check_chunked, check_op, check_split
from fn.tree import PyTree, tree_flatten, tree_map, tree_unflatten

__all__ = ["Simulated", "SimulatedGroup", "simulate", "replicate"]


class _SimulatedCollectives(ByteCounter):
    """The collectives of a group of simulated ranks (the world, or one hop of a split).

    Args:
        root: the ``Simulated`` comm whose ``simulate`` the group runs in (``None``: itself).
        size: the group's ranks.
        local_size: ranks per node ``L`` (the world's size for the world).
        hop: an index into ``fn.collectives.comm.HOPS``, the level its bytes count under.
    """

    def __init__(self, root: Simulated | None, size: int, local_size: int, hop: int) -> None:
        super().__init__(root, hop)
        self._root = self if root is None else root
        self._size = size
        self._local_size = local_size

    @property
    def world_size(self) -> int:
        return self._size

    def _call(self, kind: str, x: torch.Tensor, *options: str) -> torch.Tensor:
        """The op ``fn::sim_<kind>`` on ``x`` over this group, one rank's bytes counted."""
        rank = self._root.simulated_rank
        if rank is None:
            raise _sim_ops.outside_error(kind)
        if kind in ("all_to_all", "reduce_scatter"):
            check_chunked(x, self._size, kind)
        self._count(kind, x)
        op = getattr(_sim_ops, f"sim_{kind}")
        return op(x, rank, *options, self._local_size, self._hop, self._size)

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        check_op(op)
        return self._call("all_reduce", x, op)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self._call("all_gather", x)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return self._call("all_to_all", x)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        check_op(op)
        return self._call("reduce_scatter", x, op)


class Simulated(_SimulatedCollectives):
    """``world_size`` ranks simulated in one process; use through :func:`simulate`.

    ``bytes_sent`` counts one rank's share (the same number a ``ProcessGroup`` rank counts).

    Args:
        world_size: the number of simulated ranks, ``>= 1``.

    Example:
        >>> from fn.collectives import Simulated, simulate
        >>> comm = Simulated(4)
        >>> values = torch.arange(4.0)  # rank r holds r
        >>> simulate(lambda x: comm.all_reduce(x, op="sum"), comm)(values)
        tensor([6., 6., 6., 6.])
        >>> comm.bytes_sent  # one rank's share of a ring allreduce of 4 bytes
        6
    """

    def __init__(self, world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        super().__init__(None, world_size, world_size, 0)
        self._rank: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"Simulated({self._size})"

    @property
    def simulated_rank(self) -> torch.Tensor | None:
        """The rank index, batched over the rank axis (``arange(W)`` under ``vmap``), while
        :func:`simulate` runs; else ``None``."""
        return self._rank

    def split(self, local_world_size: int) -> tuple[SimulatedGroup, SimulatedGroup]:
        """The intra-node and inter-node groups of this rank, ranks ``node * L + local``.

        Args:
            local_world_size: ranks per node ``L``; must divide ``world_size``.

        Returns:
            ``(intra, inter)``, where ``intra`` spans the ``L`` ranks of this rank's node, ``inter``
            the ``W / L`` ranks with this rank's local index. Their bytes count into this comm.

        Example:
            >>> comm = fn.collectives.Simulated(4)  # 2 nodes of 2 ranks: ranks 0, 1 | 2, 3
            >>> intra, inter = comm.split(2)
            >>> node_sum = fn.collectives.simulate(lambda x: intra.all_reduce(x, "sum"), comm)
            >>> node_sum(torch.arange(4.0))
            tensor([1., 1., 5., 5.])
            >>> inter.world_size
            2
        """
        check_split(self._size, local_world_size)
        hops = (_sim_ops.INTRA, _sim_ops.INTER)
        return tuple(SimulatedGroup(self, local_world_size, hop) for hop in hops)

    @contextlib.contextmanager
    def _activate(self, rank: torch.Tensor) -> Iterator[None]:
        if self._rank is not None:
            raise RuntimeError(f"simulate() of the same {self!r} cannot be nested")
        self._rank = rank
        try:
            yield
        finally:
            self._rank = None


class SimulatedGroup(_SimulatedCollectives):
    """One hop of :meth:`Simulated.split`; runs inside its root's ``simulate``, counts its bytes
    into the root's counter. ``split`` builds it.

    Args:
        root: the ``Simulated`` comm it is a part of.
        local_size: ranks per node ``L``.
        hop: ``1`` for the group inside a node (``L`` ranks), ``2`` for the group across nodes
            (``W / L`` ranks).

    Example:
        >>> comm = fn.collectives.Simulated(4)
        >>> intra, inter = comm.split(2)
        >>> intra
        SimulatedGroup(Simulated(4), intra, size=2)
        >>> _ = fn.collectives.simulate(lambda x: intra.all_reduce(x), comm)(torch.ones(4))
        >>> comm.bytes_sent_by_hop  # counted into the root, under the group's level
        {'world': 0, 'intra': 4, 'inter': 0}
    """

    def __init__(self, root: Simulated, local_size: int, hop: int) -> None:
        size = local_size if hop == _sim_ops.INTRA else root.world_size // local_size
        super().__init__(root, size, local_size, hop)

    def __repr__(self) -> str:
        kind = "intra" if self._hop == _sim_ops.INTRA else "inter"
        return f"SimulatedGroup({self._root!r}, {kind}, size={self._size})"


def simulate(f: Callable[..., Any], comm: Simulated) -> Callable[..., Any]:
    """Runs ``f`` on every rank of ``comm`` at once.

    Every tensor leaf of the arguments must have a leading rank axis of size ``W``; ``f`` sees one
    rank's slice. Non-tensor leaves (ints, floats, ``None``, strings) are passed to every rank as
    they are. Tensor outputs get the rank axis (one row per rank, never shared memory between
    rows); non-tensor outputs are returned as ``f`` gave them.
    Random ops draw different values on each rank.

    Args:
        f: a function of pytrees, written for one rank, calling ``comm``'s collectives.
        comm: the ``Simulated`` comm ``f`` communicates through.

    Returns:
        The function over rank-stacked arguments.

    Example:
        >>> from fn.collectives import Simulated, simulate
        >>> comm = Simulated(3)
        >>> def gather_rank_norms(x):  # written for one rank
        ...     return comm.all_gather(x.norm())
        >>> simulate(gather_rank_norms, comm)(torch.tensor([[3.0, 4.0], [0.0, 1.0], [1.0, 0.0]]))
        tensor([[5., 1., 1.],
                [5., 1., 1.],
                [5., 1., 1.]])
    """
    if not isinstance(comm, Simulated):
        raise TypeError(f"simulate() needs a Simulated comm, got {comm!r}")
    world_size = comm.world_size

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        for i in positions:
            if leaves[i].dim() == 0 or leaves[i].shape[0] != world_size:
                raise ValueError(
                    f"simulate({comm!r}): every tensor argument needs a leading rank axis of "
                    f"size {world_size}, got shape {tuple(leaves[i].shape)} "
                    "(use fn.collectives.replicate for values shared by all ranks)"
                )
        structure: list[tuple[list[Any], Any, list[bool]]] = []

        def per_rank(rank: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
            full = list(leaves)
            for i, t in zip(positions, tensors, strict=True):
                full[i] = t
            rank_args, rank_kwargs = tree_unflatten(full, spec)
            with comm._activate(rank):
                out = f(*rank_args, **rank_kwargs)
            out_leaves, out_spec = tree_flatten(out)
            is_tensor = [isinstance(o, torch.Tensor) for o in out_leaves]
            # Only the non-tensor leaves are kept: a batched tensor must not outlive the vmap.
            kept = [None if t else o for o, t in zip(out_leaves, is_tensor, strict=True)]
            structure.append((kept, out_spec, is_tensor))
            return tuple(o for o, t in zip(out_leaves, is_tensor, strict=True) if t)

        ranks = torch.arange(world_size)
        batched = torch.func.vmap(per_rank, randomness="different")(
            ranks, *(leaves[i] for i in positions)
        )
        out_leaves, out_spec, is_tensor = structure[0]
        # A value that is the same on every rank comes back broadcast (stride 0): copy it, so
        # that every rank owns its row as a real backend's rank would.
        batched_iter = (t.contiguous() if t.stride(0) == 0 else t for t in batched)
        final = [next(batched_iter) if t else o for o, t in zip(out_leaves, is_tensor, strict=True)]
        return tree_unflatten(final, out_spec)

    return run


def replicate(tree: PyTree, comm: Simulated) -> PyTree:
    """Stacks ``comm.world_size`` copies of every tensor leaf on a new leading rank axis.

    Args:
        tree: a pytree (params, an optimizer state); non-tensor leaves are kept as they are.
        comm: the ``Simulated`` comm that fixes the number of copies.

    Returns:
        The pytree with ``[W, *shape]`` tensor leaves.

    Example:
        >>> from fn.collectives import Simulated, replicate
        >>> replicate({"w": torch.tensor([1.0, 2.0]), "steps": 3}, Simulated(2))
        {'w': tensor([[1., 2.],
                [1., 2.]]), 'steps': 3}
    """
    world_size = comm.world_size

    def stack(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return x.unsqueeze(0).expand(world_size, *x.shape).clone()

    return tree_map(stack, tree)
