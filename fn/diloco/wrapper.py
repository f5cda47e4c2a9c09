"""``DiLoCo``: the outer step hooked onto any inner optimizer's ``step()``, so that a training loop
does not change; the anchor, the outer state and the counters in a ``state_dict``."""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fn.base import GradientTransformation
from fn.collectives import Comm, Local, ProcessGroup, Simulated
from fn.diloco.agreement import agree_on_settings
from fn.diloco.checkpoint import diloco_state_dict, initializing_optimizer_state, restored
from fn.diloco.compressors import compression as build_compression
from fn.diloco.nesterov_rule import nesterov
from fn.diloco.sharding import local_shard, worker_mesh_comms
from fn.diloco.sparseloco_rule import sparseloco
from fn.diloco.step import outer_step
from fn.errors import check_int, user_stacklevel

__all__ = ["OUTER_RULES", "DiLoCo"]

OUTER_RULES = ("nesterov", "sparseloco")
"""The outer rules :class:`DiLoCo` takes by name, ``"nesterov"`` (:func:`fn.diloco.nesterov`,
after any compressor) and ``"sparseloco"`` (:func:`fn.diloco.sparseloco`, its top-k built in).

Example:
    >>> fn.diloco.OUTER_RULES
    ('nesterov', 'sparseloco')
"""


def _comm(group: Any, timeout: Any) -> Comm:
    if isinstance(group, Simulated):
        raise TypeError("DiLoCo runs on real ranks: pass a torch.distributed group, not Simulated")
    if isinstance(group, (Local, ProcessGroup)):
        return group
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return Local()
    return ProcessGroup(group, timeout=timeout)


def _rule(
    outer: str, outer_options: Mapping, kind: str | None, options: Mapping, comm: Comm
) -> GradientTransformation:
    if outer == "nesterov":
        return nesterov(build_compression(kind or "fp32", comm=comm, **options), **outer_options)
    if outer == "sparseloco":
        if kind not in (None, "topk"):
            raise ValueError(
                f"DiLoCo: outer='sparseloco' sends its own top-k; compression must be None or "
                f"'topk' (its k and chunk_size go in compression_options), got {kind!r}"
            )
        return sparseloco(comm=comm, **outer_options, **options)
    raise ValueError(f"DiLoCo: outer must be one of {', '.join(OUTER_RULES)}, got {outer!r}")


def _params_digest(params: list[torch.Tensor]) -> int:
    """A CRC-32 of the parameters' bytes, to check that every rank starts from the same ones."""
    digest = 0
    for p in params:
        data = p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest = zlib.crc32(data, digest)
    return digest


class DiLoCo:
    """DiLoCo around any inner optimizer: every ``sync_every`` inner steps, one outer step.

    Registers a post-step hook on ``inner_optimizer`` (any ``torch.optim.Optimizer``:
    ``torch.optim``'s, ``fn.optim``'s): after every ``sync_every``-th ``step()``, the model's
    parameters (those that require grad, in ``model.parameters()`` order) go through
    :func:`fn.diloco.outer_step` with the outer rule, and every rank continues from the new
    anchor. The training loop does not change. docs/algorithms.md, "DiLoCo: local steps and a
    compressed outer step" specifies the step, the bytes and the memory.

    At construction every rank checks with the others (one small all-gather) that they passed
    the same settings and hold the same parameters; a difference is the same ``ValueError`` on
    every rank. A non-finite pseudo-gradient on any rank skips the outer step on every rank with
    the anchor and the outer state unchanged, resets every rank's parameters to the anchor, and
    warns. A rank that stops answering makes the others raise
    ``fn.collectives.CollectiveTimeoutError`` after ``timeout`` (``$FN_TIMEOUT``).

    A worker may span several ranks, its model sharded by FSDP2 (``fully_shard``, on a 1-D mesh
    or HSDP; the parameters ``DTensor`` s, on one device mesh): ``group`` is then the workers'
    ranks at one shard position (``mesh["worker"].get_group()`` for a mesh ``("worker",
    "shard")``), each rank syncs its own local shard, the anchor is per local shard, and the
    agreement that the pseudo-gradients are finite is also summed over the parameters' mesh, so
    that every rank of every worker applies or skips a step together. ``"fp32"`` and ``"bf16"``
    then give the unsharded model's outer step bit for bit; the compressors with groups or
    chunks cut them from the shards. ``fn.fsdp.OnebitAdam`` and ``OnebitLamb`` serve as a
    sharded worker's inner optimizer given the worker's ranks as ``world=``
    (``mesh["shard"].get_group()``), so that their checks span that worker only.

    Args:
        model: the worker's model, unsharded or sharded by FSDP2 (buffers are not
            synchronized).
        inner_optimizer: the optimizer of ``model``'s parameters, stepped by the training loop.
        group: the workers: a ``torch.distributed`` group (``None``: the world, or one rank
            where ``torch.distributed`` is not initialized), or a ``fn.collectives.Local`` or
            ``ProcessGroup``; with sharded workers, the workers' ranks at this shard position.
        sync_every: ``H``, inner steps per outer step.
        outer: the outer rule, one of :data:`OUTER_RULES`.
        outer_options: its options (``lr``, ``momentum`` for ``"nesterov"``; ``lr``, ``beta``
            for ``"sparseloco"``).
        compression: the compressor, one of ``fn.diloco.COMPRESSIONS`` (``None``: ``"fp32"``;
            ``"sparseloco"`` takes only ``"topk"``).
        compression_options: its options (e.g. ``k``, ``chunk_size`` for ``"topk"``).
        fragments: ``P``; only 1 is built.
        delay: ``tau``; only 0 is built.
        anchor_device: where the anchor lives: ``None`` (each parameter's device) or a device
            such as ``"cpu"``.
        timeout: the collectives' timeout (a ``timedelta`` or seconds; ``None``:
            ``$FN_TIMEOUT``, else 5 minutes), where ``group`` is a ``torch.distributed`` group.

    Raises:
        ValueError: a setting out of range, or (on every rank) settings or parameters that
            differ across ranks.
        NotImplementedError: ``fragments > 1`` or ``delay > 0``, which are specified in
            docs/algorithms.md and not built; ``DTensor`` parameters mixed with plain ones or on
            several device meshes.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=2)  # one rank: Local
        >>> for _ in range(4):
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     inner.step()
        ...     inner.zero_grad()
        >>> diloco.inner_steps, diloco.outer_steps
        (4, 2)
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        group: Any = None,
        sync_every: int,
        outer: str = "nesterov",
        outer_options: Mapping[str, Any] | None = None,
        compression: str | None = None,
        compression_options: Mapping[str, Any] | None = None,
        fragments: int = 1,
        delay: int = 0,
        anchor_device: torch.device | str | None = None,
        timeout: Any = None,
    ) -> None:
        check_int("DiLoCo: sync_every", sync_every, minimum=1)
        check_int("DiLoCo: fragments", fragments, minimum=1)
        check_int("DiLoCo: delay", delay, minimum=0)
        if fragments > 1 or delay > 0:
            raise NotImplementedError(
                "DiLoCo: streaming fragments and a delayed outer step (fragments > 1, delay > 0) "
                "are specified in docs/algorithms.md and not built; use fragments=1, delay=0"
            )
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._within = worker_mesh_comms(self._params, timeout)  # sharded: the worker's ranks
        self.comm = _comm(group, timeout)
        outer_options, options = dict(outer_options or {}), dict(compression_options or {})
        self._rule = _rule(outer, outer_options, compression, options, self.comm)
        self.sync_every = sync_every
        self._settings = {
            "sync_every": sync_every,
            "fragments": fragments,
            "delay": delay,
            "outer": (outer, sorted(outer_options.items())),
            "compression": (compression, sorted(options.items())),
            "parameters": [(tuple(p.shape), str(p.dtype)) for p in self._params],
        }
        shards = [local_shard(p.detach()) for p in self._params]
        values = {
            "local shapes": [tuple(x.shape) for x in shards],
            "parameter values": _params_digest(shards),
        }
        agree_on_settings(self.comm, {**self._settings, **values}, "DiLoCo")
        self._anchor = [x.to(anchor_device or x.device, copy=True) for x in shards]
        self._state = self._rule.init(self._anchor)
        self.inner_steps = 0
        self.outer_steps = 0
        self.skipped_steps = 0
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)

    def remove(self) -> None:
        """Detaches the hook from the inner optimizer: its ``step()`` no longer counts.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=1)
            >>> diloco.remove()
            >>> inner.step()
            >>> diloco.inner_steps
            0
        """
        self._hook.remove()

    def _after_inner_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        del optimizer, args, kwargs
        if initializing_optimizer_state():  # DCP's state_dict API creating a fresh state
            return
        self.inner_steps += 1
        if self.inner_steps % self.sync_every == 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> bool:
        """Runs one outer step now (the hook calls it after every ``sync_every``-th inner step).

        Every rank must call it at the same point. The parameters of every rank are set to the
        new anchor.

        Returns:
            Whether the step was applied; ``False`` where some rank's pseudo-gradient was not
            finite, the step then skipped on every rank and the parameters reset to the anchor.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=100)
            >>> diloco.sync(), diloco.outer_steps
            (True, 1)
        """
        params = [local_shard(p.detach()) for p in self._params]
        anchor = [a.to(p.device) for a, p in zip(self._anchor, params, strict=True)]
        result = outer_step(
            self._rule, anchor, params, self._state, comm=self.comm, within=self._within
        )
        for p, a, new in zip(params, self._anchor, result.anchor, strict=True):
            p.copy_(new)
            a.copy_(new)
        self._state = result.state
        self.outer_steps += 1
        applied = bool(result.applied)
        if not applied:
            self.skipped_steps += 1
            warnings.warn(
                f"DiLoCo: a pseudo-gradient held NaN or Inf at inner step {self.inner_steps}; "
                "the outer step was skipped on every rank and every rank's parameters were reset "
                "to the anchor (check the inner learning rate and the data)",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        return applied

    def state_dict(self) -> dict[str, Any]:
        """This rank's DiLoCo state: the anchor, the outer rule's state, the counters and the
        settings under keys shared by the ranks, and this rank's error feedback under
        ``state["per_rank"]["rank<r>"]`` (``r`` its rank in the world).

        Save it per rank (``torch.save`` to one file per rank), or through
        ``torch.distributed.checkpoint`` (``fn.fsdp.TrainingCheckpoint(..., extra={"diloco":
        diloco})``), which keeps one copy of each shared key, of each shard where the workers
        are sharded (the anchor and the momentum are then ``DTensor`` s laid out as the
        parameters). With the model's and the inner optimizer's state, it resumes bit for bit.

        Returns:
            A dict of tensors, lists of tensors and Python values (fresh copies).

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> sorted(fn.diloco.DiLoCo(model, inner, sync_every=2).state_dict())
            ['anchor', 'counts', 'outer_state', 'per_rank', 'settings', 'world_size']
        """
        counts = {
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "skipped_steps": self.skipped_steps,
        }
        return diloco_state_dict(
            self._anchor,
            self._state,
            self._params,
            counts=counts,
            settings=repr(self._settings),
            world_size=self.comm.world_size,
        )

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict`. Under another number of workers (or from another
        rank's file) the error feedback restarts from zero, with one warning; the rest (the
        anchor, the momentum, the counters) loads.

        Args:
            state: what :meth:`state_dict` returned on this rank (or, under another number of
                workers, on some rank), or what ``torch.distributed.checkpoint`` loaded into it.

        Raises:
            ValueError: settings other than this object's, or tensors of other shapes; nothing
                was changed.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> diloco = fn.diloco.DiLoCo(model, inner, sync_every=2)
            >>> saved = diloco.state_dict()
            >>> diloco.sync()
            True
            >>> diloco.load_state_dict(saved)
            >>> diloco.outer_steps
            0
        """
        loaded = restored(
            state,
            anchor=self._anchor,
            fresh_state=self._rule.init(self._anchor),
            settings=repr(self._settings),
            world_size=self.comm.world_size,
        )
        for a, saved in zip(self._anchor, loaded.anchor, strict=True):
            a.copy_(saved)
        self._state = loaded.outer_state
        self.inner_steps = loaded.counts["inner_steps"]
        self.outer_steps = loaded.counts["outer_steps"]
        self.skipped_steps = loaded.counts["skipped_steps"]
