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
    """Two ranks whose peer sends twice what this one sends; ``fail`` makes the next call's
    work fail."""

    def __init__(self) -> None:
        self.calls, self.fail = 0, False

    def size(self) -> int:
        return 2

    def _work(self) -> Work:
        self.calls += 1
        return Work(RuntimeError("Connection closed by peer") if self.fail else None)

    def allreduce(self, tensors, options):
        tensors[0].mul_(3)  # this rank's x plus the peer's 2 x
        return self._work()

    def allgather_into_tensor_coalesced(self, outputs, inputs, options):
        outputs[0].copy_(torch.cat([inputs[0], 2 * inputs[0]]))
        return self._work()

    def alltoall_base(self, output, input, output_split, input_split, options):
        output.copy_(input)
        return self._work()


class Manager:
    """What ManagerComm reads of torchft's Manager: its error, as the Manager keeps it."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def errored(self) -> Exception | None:
        return self.error

    def report_error(self, error: Exception) -> None:
        self.error = error

    def participating_rank(self) -> int:
        return 0

    def register_state_dict_fn(self, key, load_state_dict, state_dict) -> None:
        self.registered = key

    def wrap_future(self, future: torch.futures.Future, default):
        def swallowed(done: torch.futures.Future):
            try:
                return done.value()
            except Exception as err:  # as torchft's Manager.wrap_future: reported, not raised
                self.report_error(err)
                return default

        return future.then(swallowed)
