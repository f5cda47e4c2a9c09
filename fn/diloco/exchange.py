"""Where DiLoCo's outer exchanges run: inline on the caller's thread, or (``delay > 0``) each
fragment's on a background thread, over process groups of its own, so that it overlaps the
inner steps that follow it (:class:`Exchanger`)."""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from fn.collectives import Comm, ProcessGroup

__all__ = ["BackgroundExchange", "ExchangeThread", "Exchanger", "exchange_comms"]

T = TypeVar("T")


def exchange_comms(comms: Sequence[Comm]) -> list[Comm]:
    """The comms a background exchange runs on: for each of ``comms`` over a
    ``torch.distributed`` group, a new process group over the same ranks (collectives of two
    threads on one group could interleave differently on different ranks); the others
    themselves.

    A collective call over the whole world: every rank calls it, in the same order, with its own
    comms of the same roles (e.g. the workers' group, then each dimension of a sharded worker's
    mesh). ``dist.new_group`` needs every rank of the world, so where some group is a subgroup
    (one group per shard position, or the ranks inside one worker), each rank learns every
    rank's members (one ``all_gather_object``) and every rank creates every distinct group of
    each role, role by role, keeping its own.

    Args:
        comms: this rank's comms.

    Returns:
        One comm per entry of ``comms``, over the same ranks, with its timeout, counting its
        bytes into it.

    Example:
        >>> from fn.diloco.exchange import exchange_comms
        >>> exchange_comms([fn.collectives.Local()])
        [Local()]
    """
    groups = [c for c in comms if isinstance(c, ProcessGroup)]
    if not groups:
        return list(comms)
    own = [dist.get_process_group_ranks(c.group or dist.group.WORLD) for c in groups]
    every: list[list[list[int]] | None] = [own]
    if any(len(members) != dist.get_world_size() for members in own):
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, own)
    created = {}
    for role, comm in enumerate(groups):
        distinct = sorted({tuple(ranks[role]) for ranks in every if ranks is not None})
        for members in distinct:
            created[role, members] = dist.new_group(list(members), timeout=comm.timeout)
    copies = iter(
        ProcessGroup(created[role, tuple(members)], timeout=comm.timeout, counts_into=comm)
        for role, (comm, members) in enumerate(zip(groups, own, strict=True))
    )
    return [next(copies) if isinstance(c, ProcessGroup) else c for c in comms]


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device for the exchanges (their tensors return to one allocator pool)."""
    return torch.cuda.Stream(device)


class ExchangeThread:
    """One daemon thread that runs the background exchanges handed to it, in order.

    Starting a thread makes the caller wait until the new thread has been scheduled, which, on
    cores that the training loop keeps busy, is most of what a delayed exchange cost the loop
    (``benchmarks/diloco_blocking.py``); this thread is started once, and each exchange is only
    put in its queue. It ends at :meth:`stop`, once this object is garbage collected, or at the
    interpreter's exit, each time after the exchange it runs, if any: a thread still waiting at
    the exit, when the process groups are torn down, made processes abort ("terminate called
    without an active exception") after the program's last line.

    Example:
        >>> from fn.diloco.exchange import BackgroundExchange, ExchangeThread
        >>> worker = ExchangeThread()
        >>> [BackgroundExchange(lambda: n * n, background=True, worker=worker).result()
        ...  for n in (2, 3)]
        [4, 9]
        >>> worker.stop()
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=_serve, args=(self._jobs,), name="fn.diloco exchange", daemon=True
        )
        self._thread.start()
        weakref.finalize(self, self._jobs.put, None)  # the thread's stop, once this is gone
        _RUNNING.add(self)

    def submit(self, job: Callable[[], None]) -> None:
        """Queues ``job`` (a function of no arguments that raises nothing) to run after the
        jobs queued before it."""
        self._jobs.put(job)

    def stop(self, timeout: float | None = None) -> None:
        """Ends the thread after the jobs queued before, and waits for it (each job is an
        exchange over fn's collectives, which end by their timeout), or ``timeout`` seconds."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


_RUNNING: weakref.WeakSet[ExchangeThread] = weakref.WeakSet()
# At exit an exchange still in flight ends once the other workers reach it too; one whose peers
# are gone would hold the exit until fn's collective timeout, so the exit waits this long only.
_EXIT_WAIT_S = 30.0


@atexit.register
def _stop_at_exit() -> None:
    for worker in list(_RUNNING):
        worker.stop(_EXIT_WAIT_S)


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        job()


class BackgroundExchange(Generic[T]):
    """Runs ``run()`` now, on this thread or on a background thread; :meth:`result` returns its
    value.

    On CUDA tensors the thread works on a side stream, which first waits for the work the
    caller's stream had queued (the inputs); :meth:`result` makes the caller's stream wait for
    the thread's, so that the collectives' waits never hold up the caller's kernels. A thread's
    collectives end at their comm's timeout (on host tensors), so the thread does too.

    Args:
        run: the exchange, a function of no arguments.
        background: run it on a background thread (else now, in this call).
        device: the device of its tensors.
        what: the exchange's name, for the error message.
        worker: the :class:`ExchangeThread` to run it on (``None``: a daemon thread of its own,
            whose start the caller waits for).

    Example:
        >>> from fn.diloco.exchange import BackgroundExchange
        >>> BackgroundExchange(lambda: 6 * 7, background=True).result()
        42
    """

    def __init__(
        self,
        run: Callable[[], T],
        *,
        background: bool,
        device: torch.device | None = None,
        what: str = "the exchange",
        worker: ExchangeThread | None = None,
    ) -> None:
        self._what = what
        self._device = device
        self._error: BaseException | None = None
        self._finished: threading.Event | None = None
        self._done: torch.cuda.Event | None = None
        if not background:
            self._value = run()
            return
        stream = None
        if device is not None and device.type == "cuda":
            stream = _side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
        self._finished = finished = threading.Event()

        def target() -> None:
            try:
                if stream is None:
                    self._value = run()
                    return
                with torch.cuda.stream(stream):
                    self._value = run()
                    self._done = torch.cuda.Event()
                    self._done.record(stream)
            except BaseException as err:  # handed to result(), on the caller's thread
                self._error = err
            finally:
                finished.set()

        if worker is None:
            threading.Thread(target=target, name="fn.diloco exchange", daemon=True).start()
        else:
            worker.submit(target)

    def result(self) -> T:
        """Waits for the exchange and returns its value.

        Raises:
            RuntimeError: the exchange raised on its thread (the original exception chained,
                as ``__cause__``).
        """
        if self._finished is not None:
            self._finished.wait()
            self._finished = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                f"{self._what} failed on its background thread: {type(error).__name__}: {error}"
            ) from error
        if self._done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._done)
        return self._value


class Exchanger:
    """Starts the outer exchanges, where ``background`` says: inline over ``comms``, or each on
    a background thread over copies of them (:func:`exchange_comms`, a collective call over the
    world at construction: every rank builds it, in the same order). The one place where
    ``DiLoCo``'s ``delay > 0`` chooses the thread and the groups.

    Args:
        comms: the workers' comm, then the groups inside a sharded worker.
        background: run the exchanges on a background thread.

    Attributes:
        comms: the comms the exchanges run over (copies where ``background``).
        background: whether they run on a background thread (one :class:`ExchangeThread`,
            started here).

    Example:
        >>> from fn.diloco.exchange import Exchanger
        >>> exchanger = Exchanger([fn.collectives.Local()], background=True)
        >>> exchanger.start(lambda comm, within: comm.world_size).result()
        1
    """

    def __init__(self, comms: Sequence[Comm], *, background: bool) -> None:
        self.background = background
        self.comms = exchange_comms(comms) if background else list(comms)
        # started now: starting a thread per exchange made the loop wait for the scheduler
        self._worker = ExchangeThread() if background else None

    def close(self) -> None:
        """Stops the background thread (after the exchange it runs, if any); later exchanges
        run on the caller's thread."""
        if self._worker is not None:
            self._worker.stop()
        self._worker, self.background = None, False

    def start(
        self,
        run: Callable[[Comm, Sequence[Comm]], T],
        *,
        background: bool | None = None,
        device: torch.device | None = None,
        what: str = "the exchange",
    ) -> BackgroundExchange[T]:
        """Starts ``run(comm, within)`` over the exchange's comms.

        Args:
            run: the exchange, of the workers' comm and the groups inside a worker.
            background: run it on a background thread (``None``: as built; ``False``: now,
                on this thread, over the same comms).
            device: the device of its tensors.
            what: its name, for the error message.

        Returns:
            The exchange, whose ``result()`` waits for it.
        """
        comm, *within = self.comms
        background = self.background if background is None else background
        return BackgroundExchange(
            lambda: run(comm, within),
            background=background,
            device=device,
            what=what,
            worker=self._worker,
        )
