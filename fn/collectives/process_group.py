"""``ProcessGroup``: the collectives of a ``torch.distributed`` process group.

Works with any backend that implements all_reduce, the flat all_gather / reduce_scatter and
all_to_all_single (gloo, nccl, xccl, hccl, mpi), for instance under ``torchrun``. Results are
new tensors: inputs are never changed. :meth:`ProcessGroup.transfers` adds point-to-point
sends and receives into given buffers (:class:`Transfers`), which fused callers overlap with
their compute. The collectives are not vmappable (use ``Simulated`` to batch ranks in one
process).

Timeout: every collective gives up after ``timeout`` (:func:`resolve_timeout`) on host (CPU,
gloo) tensors, counted from its (asynchronous) start. A collective still waiting when the last
part of that limit begins (its last half, at most 10 s) makes the rank record its arrival in
the group's store (the one ``init_process_group`` made) and look for the others there while it
goes on: if it completes in time, nothing happened; otherwise every waiting rank raises, at the
limit, the same :class:`CollectiveTimeoutError` naming the ranks that never arrived, or, when
every rank arrived, what each rank called. Point-to-point transfers are waited for the whole
limit (gloo closes the connection when such a wait times out), then their ranks look for each
other for that last part. A collective that fails before the limit (a peer's process ended) is
reported as a failure, with the time it failed, once the other ranks had that last part to
arrive. The group cannot be used after such an error, and ``destroy_process_group`` or the
exit may wait for the abandoned collective until the process group's own timeout
(``init_process_group(..., timeout=...)``): set that one too. On accelerator tensors (NCCL
and the like) only that own timeout applies: a host-side limit would synchronize the host with
the device at every collective.
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from fn.collectives.comm import HOPS, ByteCounter, ReduceOp, check_chunked, check_op, check_split

__all__ = [
    "CollectiveTimeoutError",
    "ProcessGroup",
    "Transfers",
    "TIMEOUT_ENV",
    "DEFAULT_TIMEOUT",
    "resolve_timeout",
    "all_gather_flat",
]

TIMEOUT_ENV = "FN_TIMEOUT"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
_MAX_GRACE_S = 10.0
_POLL_S = 0.05
# Collectives issued through fn per torch process group (all ProcessGroup objects over one group
# share it): the same sequence number on every rank names one collective in the store.
_issued: dict[str, itertools.count] = {}


# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Any:
    """``torch.distributed``'s flat all-gather into ``output_tensor`` (``[W * n]``, row ``i``
    rank ``i``'s ``input_tensor``), under its name in the installed torch:
    ``all_gather_single`` from torch 2.13 on, ``all_gather_into_tensor`` before. Sends the
    tensors as they are (any dtype) and counts no bytes.

    Args:
        output_tensor: ``[W * n]``, the dtype of ``input_tensor``.
        input_tensor: this rank's ``n`` values.
        group: the process group (``None``: the world).
        async_op: return a work handle instead of waiting.

    Returns:
        The work handle with ``async_op``, else ``None``.

    Example:
        >>> import torch.distributed as dist
        >>> from fn.collectives.process_group import all_gather_flat
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> out = torch.empty(2, dtype=torch.uint8)
        >>> all_gather_flat(out, torch.tensor([7, 9], dtype=torch.uint8))
        >>> out
        tensor([7, 9], dtype=torch.uint8)
        >>> dist.destroy_process_group()
    """
    return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class CollectiveTimeoutError(RuntimeError):
    """A collective of a :class:`ProcessGroup` did not complete in time, or failed.

    Args:
        message: what happened: the collective, its ranks and the likely cause.
        missing_ranks: the global ranks that did not reach the collective.
        group: the ``torch.distributed`` process group of the collective (``None``: the
            default group, or none of this rank's when the error reports another rank's).

    Attributes:
        missing_ranks: the global ranks that did not reach the collective (empty when every rank
            did; then the ranks called different collectives, or the backend failed).
        group: the process group it ran on, which is unusable after a failure (a caller that
            drives several groups tells by it which one failed).

    Example:
        A training loop under ``torchrun`` may catch it to log which ranks were lost:

        >>> try:
        ...     raise fn.collectives.CollectiveTimeoutError("all_reduce timed out", [3])
        ... except fn.collectives.CollectiveTimeoutError as err:
        ...     print(f"lost ranks {err.missing_ranks}: {err}")
        lost ranks [3]: all_reduce timed out
    """

    def __init__(
        self, message: str, missing_ranks: list[int], group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks
        self.group = group


def resolve_timeout(timeout: datetime.timedelta | float | None) -> datetime.timedelta:
    """``timeout`` (a ``timedelta`` or seconds), else ``$FN_TIMEOUT`` (seconds), else
    :data:`DEFAULT_TIMEOUT`.

    Raises:
        ValueError: unless it is positive and finite (or ``$FN_TIMEOUT`` is not a number).
        TypeError: ``timeout`` is neither a ``timedelta`` nor a number.

    Example:
        >>> from fn.collectives.process_group import resolve_timeout
        >>> resolve_timeout(90), resolve_timeout(datetime.timedelta(minutes=2))
        (datetime.timedelta(seconds=90), datetime.timedelta(seconds=120))
    """
    source = "timeout"
    if timeout is None:
        if TIMEOUT_ENV not in os.environ:
            return DEFAULT_TIMEOUT
        source, timeout = TIMEOUT_ENV, os.environ[TIMEOUT_ENV]
        try:
            timeout = float(timeout)
        except ValueError:
            raise ValueError(
                f"{TIMEOUT_ENV} must be a number of seconds, got {timeout!r}"
            ) from None
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    elif isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        raise TypeError(f"timeout must be a timedelta or a number of seconds, got {timeout!r}")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{source} must be a positive, finite number of seconds, got {seconds}")
    return datetime.timedelta(seconds=seconds)


class ProcessGroup(ByteCounter):
    """Collectives over ``group`` (``None``: the default group, which must be initialized).

    Args:
        group: a ``torch.distributed`` process group, or ``None`` for the world.
        timeout: how long a collective on host tensors may take before every waiting rank raises
            :class:`CollectiveTimeoutError` naming the ranks that did not arrive: a ``timedelta``
            or seconds; ``None`` reads ``$FN_TIMEOUT`` (seconds), else 5 minutes. Set it above
            the longest time one rank may spend between two collectives (e.g. evaluation or
            checkpointing on one rank only).
        counts_into: count the bytes sent into this comm's counter (used by :meth:`split`).
        hop: the level this comm's bytes count under in ``bytes_sent_by_hop``: 0 ``"world"``,
            1 ``"intra"``, 2 ``"inter"`` (used by :meth:`split`).

    Example:
        Under ``torchrun`` the launcher sets up the group; here a one-rank gloo group in this
        process stands in for it:

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> comm = fn.collectives.ProcessGroup()
        >>> comm.world_size, comm.all_reduce(torch.tensor([1.0, 2.0]))
        (1, tensor([1., 2.]))
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: datetime.timedelta | float | None = None,
        counts_into: ProcessGroup | None = None,
        hop: int = 0,
    ) -> None:
        super().__init__(counts_into, hop)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroup needs torch.distributed.init_process_group() to have been called "
                "(e.g. by torchrun)"
            )
        self.group = group
        self.timeout = resolve_timeout(timeout)
        self._name = (dist.group.WORLD if group is None else group).group_name
        self._world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._splits: dict[int, tuple[ProcessGroup, ProcessGroup]] = {}

    def split(self, local_world_size: int) -> tuple[ProcessGroup, ProcessGroup]:
        """The intra-node and inter-node groups of this rank (group ranks ``node * L + local``).

        A collective call: every rank of the group must call it, in the same order (the groups
        are created once per ``local_world_size`` and cached). Before creating them, the ranks
        all-gather their ``local_world_size`` (8 bytes a rank, not counted in ``bytes_sent``, as the
        groups' creation is not): ranks that disagree raise ``ValueError`` together instead of
        creating mismatched groups.

        Args:
            local_world_size: ranks per node ``L``; must divide ``world_size``.

        Returns:
            ``(intra, inter)``, two ``ProcessGroup`` comms that count their bytes into this one.

        Raises:
            ValueError: ``local_world_size`` does not divide the world size, or the ranks
                passed different values (on every rank).
        """
        check_split(self._world_size, local_world_size)
        if local_world_size not in self._splits:
            # uncounted, as the group creation itself: bytes_sent counts the collectives
            mine = torch.tensor([local_world_size], device=self._control_device())
            levels = mine.new_empty(self._world_size)
            self._run("all_gather", mine, partial(all_gather_flat, levels, mine, group=self.group))
            levels = levels.tolist()
            if len(set(levels)) > 1:
                shown = ", ".join(f"rank {i}: {level}" for i, level in enumerate(levels))
                raise ValueError(
                    f"ProcessGroup.split: the ranks passed different local_world_size ({shown})"
                )
            members = self._members()
            nodes = self._world_size // local_world_size
            node, local = divmod(self.rank, local_world_size)
            intra = [
                dist.new_group(members[n * local_world_size : (n + 1) * local_world_size])
                for n in range(nodes)
            ]
            inter = [dist.new_group(members[i::local_world_size]) for i in range(local_world_size)]
            shared = dict(timeout=self.timeout, counts_into=self)
            self._splits[local_world_size] = (
                ProcessGroup(intra[node], **shared, hop=HOPS.index("intra")),
                ProcessGroup(inter[local], **shared, hop=HOPS.index("inter")),
            )
        return self._splits[local_world_size]

    @property
    def world_size(self) -> int:
        return self._world_size

    def _control_device(self) -> torch.device:
        """Where this comm's own small messages travel: the host when the group has a host
        backend (gloo, or ``"cpu:gloo,cuda:nccl"``), else the backend's device (NCCL, XCCL and
        HCCL take only their device's tensors)."""
        backend = dist.get_backend(self.group)
        if "gloo" in backend or "mpi" in backend:
            return torch.device("cpu")
        return torch.device({"nccl": "cuda", "xccl": "xpu", "hccl": "npu"}.get(backend, "cpu"))

    def _members(self) -> list[int]:
        """The global ranks of the group, in group rank order."""
        if self.group is None:
            return list(range(self._world_size))
        return dist.get_process_group_ranks(self.group)

    def __repr__(self) -> str:
        return (
            f"ProcessGroup(rank={self.rank}, world_size={self._world_size}, "
            f"timeout={self.timeout.total_seconds():g} s)"
        )

    def _run(self, kind: str, x: torch.Tensor, start: Callable[..., Any]) -> None:
        """Runs ``start(async_op=...)`` (one collective on ``x``) and waits for it, at most
        ``timeout`` on host tensors; a failure becomes a :class:`CollectiveTimeoutError`."""
        seq = next(_issued.setdefault(self._name, itertools.count()))
        if torch.compiler.is_compiling():
            start(async_op=False)
            return
        started = time.monotonic()
        try:
            work = start(async_op=True)
        except RuntimeError as err:
            raise self._diagnose(kind, seq, x, err, started) from err
        self._wait(work, kind, seq, x, started)

    def _grace_s(self) -> float:
        """The last part of the limit, in which the waiting ranks look for each other."""
        return min(self.timeout.total_seconds() / 2, _MAX_GRACE_S)

    def _wait(
        self,
        work: Any,
        kind: str,
        seq: int,
        x: torch.Tensor,
        started: float,
        point_to_point: bool = False,
    ) -> None:
        """Waits for ``work`` (collective ``seq`` on ``x``, started at ``started`` on the
        ``time.monotonic`` clock), at most until ``timeout`` after ``started`` on host
        tensors; a failure becomes a :class:`CollectiveTimeoutError`.

        A collective is waited for until the last part of the limit, which :meth:`_diagnose`
        spends looking for the other ranks while it goes on; a point-to-point transfer is
        waited for until the limit (gloo closes the connection when such a wait times out).
        """
        try:
            if x.device.type == "cpu":
                limit_s = self.timeout.total_seconds()
                until_s = limit_s if point_to_point else limit_s - self._grace_s()
                # a zero timeout would mean torch's default: wait a millisecond at least
                remaining_s = max(until_s - (time.monotonic() - started), 1e-3)
                work.wait(datetime.timedelta(seconds=remaining_s))
            else:
                work.wait()
        except RuntimeError as err:
            error = self._diagnose(kind, seq, x, err, started, work)
            if error is not None:
                raise error from err

    def transfers(self, kind: str) -> Transfers:
        """Point-to-point transfers between the ranks of this group, started as they are
        posted and waited for with this group's timeout (see ``Transfers``). Every rank
        must open the same sequence of transfers (they count as one collective each).

        :meta private: (plumbing of fn's quantized collectives)
        """
        return Transfers(self, kind)

    def _diagnose(
        self,
        kind: str,
        seq: int,
        x: torch.Tensor,
        err: RuntimeError,
        started: float,
        work: Any = None,
    ) -> CollectiveTimeoutError | None:
        """The error for collective ``seq`` on ``x``, started at ``started``, that failed with
        ``err`` on this rank or is still running (``work``, past the first part of the limit);
        ``None`` if that work completes in the rest of the limit.

        The ranks that got here meet in the store to find the ranks that never arrived: until
        the limit for a running collective, for the last part of the limit after a failure.
        """
        members = self._members()
        me = dist.get_rank()
        call = f"{kind} of {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
        running, expired, failed_s, deadline = self._status(work, x, started)
        arrived: dict[int, str] = {}
        store_lost = ""
        try:
            store = distributed_c10d._get_process_group_store(self.group or dist.group.WORLD)
            prefix = f"fn/{seq}/"
            store.set(f"{prefix}{me}", call)
            while True:
                if running and work.is_completed():
                    try:
                        work.wait(datetime.timedelta(seconds=1e-3))  # completed: returns at once
                        return None
                    except RuntimeError as late:  # failed in the last part: before the limit
                        err, running, failed_s = late, False, time.monotonic() - started
                for rank in members:
                    if rank not in arrived and store.check([f"{prefix}{rank}"]):
                        arrived[rank] = store.get(f"{prefix}{rank}").decode()
                if len(arrived) == len(members) or time.monotonic() > deadline:
                    break
                time.sleep(_POLL_S)
            if len(arrived) == len(members):
                _stay_until_read(store, prefix, me, members, deadline)
        except (RuntimeError, ValueError) as store_err:  # the store's host (rank 0) is gone
            if not arrived:  # never reached it: nothing is known of the others
                outcome = self._outcome(me, running or expired, failed_s, started, x)
                where = f"{call} (collective #{seq} on ranks {members}) {outcome}: {err}"
                return self._store_unreachable(where, store_err)
            # Rank 0 ended while this rank was looking (its own failure raised there too):
            # the ranks seen so far stand.
            store_lost = f" (the store went away while the ranks were looked for: {store_err})"
        same_call = len(arrived) == len(members) and len(set(arrived.values())) == 1
        if running and same_call:  # every rank is in it: it may still complete in the limit
            try:
                work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
                return None
            except RuntimeError as late:
                if work.is_completed():
                    err, running, failed_s = late, False, time.monotonic() - started
        missing = [rank for rank in members if rank not in arrived]
        outcome = self._outcome(me, running or expired, failed_s, started, x)
        # torch's own words, unless they are the "timed out" of the wait for the first part
        detail = "" if running else f" ({err})"
        return CollectiveTimeoutError(
            f"fn.collectives: {call} (collective #{seq} on ranks {members}) {outcome}"
            + _cause(missing, running or expired, arrived, members, started)
            + (store_lost if missing else "")
            + detail,
            missing,
            self.group,
        )

    def _store_unreachable(self, where: str, store_err: Exception) -> CollectiveTimeoutError:
        """For :meth:`_diagnose`: the error of a collective (``where``: the call and what
        happened to it) whose ranks could not meet, the store's host (rank 0) being gone."""
        return CollectiveTimeoutError(
            f"fn.collectives: {where}; the store is unreachable ({store_err}), so rank 0 "
            "likely died",
            [0],
            self.group,
        )

    def _status(
        self, work: Any, x: torch.Tensor, started: float
    ) -> tuple[bool, bool, float, float]:
        """For :meth:`_diagnose`: whether ``work`` still runs, whether it expired at the limit,
        the seconds it took to fail and how long the ranks look for each other."""
        on_host = x.device.type == "cpu"
        # gloo's wait gives up but leaves a collective running; a failed one has completed, and
        # so has a point-to-point transfer at the limit (an expired one)
        running = work is not None and on_host and not work.is_completed()
        failed_s, limit_s = time.monotonic() - started, self.timeout.total_seconds()
        expired = on_host and not running and failed_s >= limit_s
        deadline = started + limit_s if running else time.monotonic() + self._grace_s()
        return running, expired, failed_s, deadline

    def _outcome(
        self, me: int, timed_out: bool, failed_s: float, started: float, x: torch.Tensor
    ) -> str:
        """What happened to a collective of this rank, with the limit and the seconds waited:
        ``timed_out`` (at the limit, or given up before it) or failed after ``failed_s``."""
        limit_s = self.timeout.total_seconds()
        waited_s = time.monotonic() - started
        if timed_out and waited_s >= limit_s:
            return f"did not complete within {limit_s:g} s on rank {me} (waited {waited_s:.1f} s)"
        if timed_out:
            return f"had not completed on rank {me} after {waited_s:.1f} s (limit {limit_s:g} s)"
        if x.device.type != "cpu":
            return (
                f"failed on rank {me} after {failed_s:.1f} s (on {x.device.type} tensors the "
                "process group's own timeout applies: init_process_group(timeout=...))"
            )
        return f"failed on rank {me} after {failed_s:.1f} s, before its limit of {limit_s:g} s"

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        check_op(op)
        self._count("all_reduce", x)
        out = x.clone(memory_format=torch.contiguous_format)
        start = partial(dist.all_reduce, out, dist.ReduceOp.SUM, group=self.group)
        self._run("all_reduce", x, start)
        return out / self._world_size if op == "mean" else out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._count("all_gather", x)
        out = x.new_empty(self._world_size * x.numel())
        flat = x.contiguous().view(-1)
        self._run("all_gather", x, partial(all_gather_flat, out, flat, group=self.group))
        return out.view(self._world_size, *x.shape)

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (one shape and dtype on all) on group rank 0, in rank order;
        ``None`` on the other ranks. One collective, with this group's timeout; its bytes are
        not counted in ``bytes_sent`` (fn's checkpoints move state with it, not training).

        Args:
            x: this rank's tensor.

        Returns:
            On rank 0 the ``W`` tensors (rank 0's a copy of ``x``), elsewhere ``None``.

        Raises:
            CollectiveTimeoutError: a rank did not join within the timeout, as for the other
                collectives.
        """
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(self._world_size)] if self.rank == 0 else None
        gather = partial(dist.gather, x, pieces, group=self.group, group_dst=0)
        self._run("gather", x, gather)
        return pieces

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        check_chunked(x, self._world_size, "all_to_all")
        self._count("all_to_all", x)
        x = x.contiguous()
        out = torch.empty_like(x)
        self._run("all_to_all", x, partial(dist.all_to_all_single, out, x, group=self.group))
        return out

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        check_op(op)
        check_chunked(x, self._world_size, "reduce_scatter")
        self._count("reduce_scatter", x)
        out = x.new_empty(x[0].numel())
        flat = x.contiguous().view(-1)
        start = partial(_reduce_scatter_flat, out, flat, dist.ReduceOp.SUM, group=self.group)
        self._run("reduce_scatter", x, start)
        out = out.view(x.shape[1:])
        return out / self._world_size if op == "mean" else out


def _stay_until_read(store: Any, prefix: str, me: int, members: list[int], deadline: float) -> None:
    """The store lives in rank 0's process, which ends once its error is raised: every rank
    stays until all have read every call (or the deadline), so none loses a call to that exit."""
    store.set(f"{prefix}read/{me}", "")
    read = [f"{prefix}read/{rank}" for rank in members]
    while not store.check(read) and time.monotonic() <= deadline:
        time.sleep(_POLL_S)


def _cause(
    missing: list[int], timed_out: bool, arrived: dict[int, str], members: list[int], started: float
) -> str:
    """What ``ProcessGroup._diagnose`` found: the ranks ``missing``, or what the ranks called."""
    raise_limit = f"raise the limit with ProcessGroup(timeout=...) or {TIMEOUT_ENV}=<seconds>"
    if missing and timed_out:
        return (
            f": rank(s) {missing} never reached it (stalled, dead, or in a different code "
            f"path; see their output). If they are only slow, {raise_limit}."
        )
    if missing:
        return (
            f": rank(s) {missing} never reached it in {time.monotonic() - started:.1f} s; a "
            "collective that fails before the limit usually means that their process exited "
            "or crashed (see their output)."
        )
    if len(set(arrived.values())) == 1:
        cause = f"{raise_limit} if it is only slow" if timed_out else "the backend failed"
        return f", though every rank reached it ({cause})."
    calls = "; ".join(f"rank {rank}: {arrived[rank]}" for rank in members)
    return (
        f": every rank reached it, but they called {calls} (every rank must make the same "
        "collectives in the same order with the same sizes)."
    )


class Transfers:
    """Sends and receives on a :class:`ProcessGroup`, each started when posted (gloo moves
    the bytes on its own threads while this thread computes), waited for with the group's
    timeout. Between two ranks, messages are received in the order they were sent.

    Used as a context manager: leaving the block waits for every transfer not yet waited for,
    so that none is left running (unless a transfer failed: the group is then unusable).

    Args:
        comm: the group.
        kind: the name in error messages.
    """

    def __init__(self, comm: ProcessGroup, kind: str) -> None:
        self._comm = comm
        self._kind = kind
        self._seq = next(_issued.setdefault(comm._name, itertools.count()))
        # (work, tensor, when it was started on the time.monotonic clock)
        self._sends: list[tuple[Any, torch.Tensor, float]] = []
        self._recvs: dict[int, list[tuple[Any, torch.Tensor, float]]] = {}
        self._failed = False

    def send(self, x: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Starts sending the contiguous ``x`` to group rank ``peer`` (``x`` must stay
        unchanged until the transfers are waited for)."""
        self._comm._count("send", x)
        self._sends.append(
            self._start(x, lambda: dist.isend(x, group=self._comm.group, tag=tag, group_dst=peer))
        )

    def recv(self, x: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Starts receiving the next message with ``tag`` from group rank ``peer`` into the
        contiguous ``x``; :meth:`wait_from` waits for it."""
        self._comm._count("recv", x)
        self._recvs.setdefault(peer, []).append(
            self._start(x, lambda: dist.irecv(x, group=self._comm.group, tag=tag, group_src=peer))
        )

    def wait_from(self, peer: int) -> None:
        """Waits for every receive posted from ``peer``."""
        for work, x, started in self._recvs.pop(peer, []):
            self._wait(work, x, started)

    def wait(self) -> None:
        """Waits for every transfer."""
        for peer in list(self._recvs):
            self.wait_from(peer)
        while self._sends:
            self._wait(*self._sends.pop(0))

    def _start(self, x: torch.Tensor, start: Callable[[], Any]) -> tuple[Any, torch.Tensor, float]:
        started = time.monotonic()
        try:
            return start(), x, started
        except RuntimeError as err:
            self._failed = True
            raise self._comm._diagnose(self._kind, self._seq, x, err, started) from err

    def _wait(self, work: Any, x: torch.Tensor, started: float) -> None:
        try:
            self._comm._wait(work, self._kind, self._seq, x, started, point_to_point=True)
        except CollectiveTimeoutError:
            self._failed = True
            raise

    def __enter__(self) -> Transfers:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._failed:
            self.wait()
