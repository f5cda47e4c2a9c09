"""Stand-ins for torchft's Manager and process group, for the tests of fn.integrations.torchft
that run in one process: what ManagerComm and ElasticDiLoCo read of them."""

from __future__ import annotations

import torch


class Work:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        if self.error is None:
            future.set_result(None)
        else:
            future.set_exception(self.error)
        return future


class ProcessGroup:
    """A quorum of ``size`` ranks that all send what this one sends (``Manager.rank`` is this
    one's): every size record agrees and every collective completes, though a mean gathered
    chunk by chunk is this rank's chunk repeated; ``fail`` makes the next call's work fail."""

    def __init__(self, manager: Manager, size: int = 2) -> None:
        self.manager, self.ranks = manager, size
        self.calls, self.fail = 0, False

    def size(self) -> int:
        return self.ranks

    def _work(self) -> Work:
        self.calls += 1
        return Work(RuntimeError("Connection closed by peer") if self.fail else None)

    def allreduce(self, tensors, options):
        tensors[0].mul_(self.ranks)  # the sum of every rank's copy
        return self._work()

    def allgather_into_tensor_coalesced(self, outputs, inputs, options):
        outputs[0].copy_(inputs[0].repeat(self.ranks))
        return self._work()

    def alltoall_base(self, output, input, output_split, input_split, options):
        mine = input.view(self.ranks, -1)[self.manager.rank]  # every rank's chunk for this one
        output.view(self.ranks, -1).copy_(mine.expand(self.ranks, -1))
        return self._work()


class Manager:
    """What ManagerComm and ElasticDiLoCo read of torchft's Manager: its error, as the Manager
    keeps it, this rank (``rank``), a quorum that changes nothing and a vote that passes unless
    a collective failed."""

    def __init__(self, rank: int = 0) -> None:
        self.error: Exception | None = None
        self.rank, self.step, self.registered = rank, 0, []
        self.state_fns: dict[str, tuple] = {}

    def errored(self) -> Exception | None:
        return self.error

    def report_error(self, error: Exception) -> None:
        self.error = error

    def participating_rank(self) -> int:
        return self.rank

    def register_state_dict_fn(self, key, load_state_dict, state_dict) -> None:
        assert key not in self.state_fns  # as torchft's Manager checks
        self.registered.append(key)
        self.state_fns[key] = (load_state_dict, state_dict)

    def start_quorum(self) -> None:
        self.error = None

    def current_step(self) -> int:
        return self.step

    def should_commit(self) -> bool:
        self.step += self.error is None
        return self.error is None

    def wrap_future(self, future: torch.futures.Future, default):
        def swallowed(done: torch.futures.Future):
            try:
                return done.value()
            except Exception as err:  # as torchft's Manager.wrap_future: reported, not raised
                self.report_error(err)
                return default

        return future.then(swallowed)
