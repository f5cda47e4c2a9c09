"""fn.integrations.torchft in one process, over stand-ins for torchft's Manager and process
group: a failed collective is reported to the Manager and returns zeros, and the collectives
after it send nothing; what is not built is refused with its reason."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is in the 'torchft' extra")
from fn.integrations.torchft import ElasticDiLoCo, ManagerComm  # noqa: E402
from tests.integrations._torchft_fakes import Manager, ProcessGroup  # noqa: E402


def test_a_failed_collective_is_reported_not_raised_and_silences_the_step():
    manager, group = Manager(), ProcessGroup()
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
    comm = ManagerComm(Manager(), ProcessGroup())
    with pytest.raises(NotImplementedError, match="not built under torchft"):
        comm.split(1)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for streaming in ({"fragments": 2}, {"delay": 1}):
        with pytest.raises(NotImplementedError, match="Streaming DiLoCo"):
            ElasticDiLoCo(
                model, inner, manager=Manager(), process_group=None, sync_every=4, **streaming
            )
