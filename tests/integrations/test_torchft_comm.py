"""fn.integrations.torchft in one process, over stand-ins for torchft's Manager and process
group: a failed collective is reported to the Manager and returns zeros, and the collectives
after it send nothing; what is not built is refused with its reason."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is in the 'torchft' extra")
from fn.integrations.torchft import ElasticDiLoCo, ManagerComm  # noqa: E402


class _Work:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        if self.error is None:
            future.set_result(None)
        else:
            future.set_exception(self.error)
        return future


class _ProcessGroup:
    """Two ranks whose peer sends twice what this one sends; ``fail`` makes the next call's
    work fail."""

    def __init__(self) -> None:
        self.calls, self.fail = 0, False

    def size(self) -> int:
        return 2

    def _work(self) -> _Work:
        self.calls += 1
        return _Work(RuntimeError("Connection closed by peer") if self.fail else None)

    def allreduce(self, tensors, options):
        tensors[0].mul_(3)  # this rank's x plus the peer's 2 x
        return self._work()

    def allgather_into_tensor_coalesced(self, outputs, inputs, options):
        outputs[0].copy_(torch.cat([inputs[0], 2 * inputs[0]]))
        return self._work()

    def alltoall_base(self, output, input, output_split, input_split, options):
        output.copy_(input)
        return self._work()


class _Manager:
    """What ManagerComm reads of torchft's Manager: its error, as the Manager keeps it."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def errored(self) -> Exception | None:
        return self.error

    def report_error(self, error: Exception) -> None:
        self.error = error

    def participating_rank(self) -> int:
        return 0

    def wrap_future(self, future: torch.futures.Future, default):
        def swallowed(done: torch.futures.Future):
            try:
                return done.value()
            except Exception as err:  # as torchft's Manager.wrap_future: reported, not raised
                self.report_error(err)
                return default

        return future.then(swallowed)


def test_a_failed_collective_is_reported_not_raised_and_silences_the_step():
    manager, group = _Manager(), _ProcessGroup()
    comm = ManagerComm(manager, group)
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(comm.all_reduce(x), torch.tensor([1.5, 3.0]))  # (x + 2 x) / 2
    assert torch.equal(comm.all_gather(x), torch.tensor([[1.0, 2.0], [2.0, 4.0]]))
    assert comm.world_size == 2 and comm.rank == 0 and comm.bytes_sent == 8 + 8
    group.fail = True
    assert torch.equal(comm.all_gather(x), torch.zeros(2, 2))
    assert "Connection closed" in str(manager.errored())
    calls, sent = group.calls, comm.bytes_sent
    group.fail = False
    assert torch.equal(comm.all_to_all(torch.ones(2, 3)), torch.zeros(2, 3))
    assert torch.equal(comm.reduce_scatter(torch.ones(2, 3), op="sum"), torch.zeros(3))
    assert group.calls == calls and comm.bytes_sent == sent  # nothing more was sent
    manager.error = None  # the next quorum
    assert torch.equal(comm.reduce_scatter(torch.ones(2, 3), op="sum"), torch.full((3,), 2.0))


def test_what_is_not_built_is_refused_with_its_reason():
    comm = ManagerComm(_Manager(), _ProcessGroup())
    with pytest.raises(NotImplementedError, match="not built under torchft"):
        comm.split(1)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for streaming in ({"fragments": 2}, {"delay": 1}):
        with pytest.raises(NotImplementedError, match="Streaming DiLoCo"):
            ElasticDiLoCo(
                model, inner, manager=_Manager(), process_group=None, sync_every=4, **streaming
            )
