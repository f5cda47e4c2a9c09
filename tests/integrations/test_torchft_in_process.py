"""fn.integrations.torchft in one process, over stand-ins for torchft's Manager and process
group (tests/integrations/_torchft_fakes.py): a failed collective is reported to the Manager and
returns zeros, and the collectives after it send nothing; what is not built is refused with its
reason; a change of the quorum restarts 1-bit's and LoCo's error feedback, not top-k's; a
recovering worker lays its state out as its peers do."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is in the 'torchft' extra")
from fn.collectives import topk_exchange_form  # noqa: E402
from fn.integrations.torchft import ElasticDiLoCo, ManagerComm  # noqa: E402
from tests.integrations._torchft_fakes import Manager, ProcessGroup  # noqa: E402


def test_a_failed_collective_is_reported_not_raised_and_silences_the_step():
    manager = Manager()
    group = ProcessGroup(manager)
    comm = ManagerComm(manager, group)
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(comm.all_reduce(x, op="sum"), torch.tensor([2.0, 4.0]))
    assert torch.equal(comm.all_gather(x), torch.tensor([[1.0, 2.0], [1.0, 2.0]]))
    assert comm.world_size == 2 and comm.rank == 0 and comm.bytes_sent == 8 + 8
    group.fail = True
    assert torch.equal(comm.all_gather(x), torch.zeros(2, 2))
    assert "Connection closed" in str(manager.errored())
    calls, sent = group.calls, comm.bytes_sent
    group.fail = False
    assert torch.equal(comm.all_to_all(torch.ones(2, 3)), torch.zeros(2, 3))
    assert torch.equal(comm.reduce_scatter(torch.ones(2, 3), op="sum"), torch.zeros(3))
    assert group.calls == calls and comm.bytes_sent == sent  # nothing more was sent
    manager.start_quorum()  # the next quorum
    assert torch.equal(comm.reduce_scatter(torch.ones(2, 3), op="sum"), torch.full((3,), 2.0))


def test_what_is_not_built_is_refused_with_its_reason():
    manager = Manager()
    comm = ManagerComm(manager, ProcessGroup(manager))
    with pytest.raises(NotImplementedError, match="not built under torchft"):
        comm.split(1)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for streaming in ({"fragments": 2}, {"delay": 1}):
        with pytest.raises(NotImplementedError, match="Streaming DiLoCo"):
            ElasticDiLoCo(
                model, inner, manager=manager, process_group=None, sync_every=4, **streaming
            )


def test_a_manager_a_group_or_a_name_it_cannot_use_is_refused():
    manager = Manager()
    group = ProcessGroup(manager)
    model = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="manager must be a torchft Manager, got None"):
        ElasticDiLoCo(model, inner, manager=None, process_group=group, sync_every=2)
    with pytest.raises(TypeError, match="process_group must be the process group the Manager"):
        ElasticDiLoCo(model, inner, manager=manager, process_group=None, sync_every=2)
    ElasticDiLoCo(model, inner, manager=manager, process_group=group, sync_every=2).remove()
    with pytest.raises(ValueError, match="already holds a state named 'fn.diloco'"):
        ElasticDiLoCo(model, inner, manager=manager, process_group=group, sync_every=2)
    ElasticDiLoCo(model, inner, manager=manager, process_group=group, sync_every=2, name="b")


class _OtherSettings(ProcessGroup):
    """The peers' first messages carry another value of the header's one integer (the
    settings' checksum, two fp32 digits after the header's 20 bytes): a peer started with other
    settings."""

    def alltoall_base(self, output, input, output_split, input_split, options):
        work = super().alltoall_base(output, input, output_split, input_split, options)
        rows = output.view(self.ranks, -1)
        for r in range(self.ranks):
            if r != self.manager.rank and rows.shape[1] >= 28:
                low = rows[r, 24:28].clone().view(torch.float32)
                rows[r, 24:28] = (low + 1 if low < 2**23 else low - 1).view(torch.uint8)
        return work


def test_a_peer_with_other_settings_makes_every_worker_raise():
    """Settings are not compared when a quorum's workers are built (``init_sync=False``), but
    every exchange's header carries their checksum: a peer started with another outer
    learning rate is refused at the first outer step, not averaged with."""
    manager = Manager(rank=0)
    model = torch.nn.Linear(2, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    group = _OtherSettings(manager, size=2)
    ElasticDiLoCo(model, inner, manager=manager, process_group=group, sync_every=1)
    model(torch.ones(2, 2)).sum().backward()
    with pytest.raises(
        ValueError, match="not at the same outer exchange .*worker 0: settings"
    ) as e:
        inner.step()
    assert "built with other settings" in str(e.value) and "count_inner_step" not in str(e.value)


def _feedback(diloco: ElasticDiLoCo) -> list[torch.Tensor]:
    return diloco.state_dict()["per_rank"]["rank0"]["error_feedback"]


def test_a_change_of_the_quorum_restarts_only_the_positional_error_feedback(caplog):
    """1-bit's error feedback (and LoCo's) is laid out by the worker's rank and the number of
    workers: it restarts from zero, with a log line, where the quorum changes; top-k's carries
    over."""
    for kind, restarts in (("onebit", True), ("loco4", True), ("topk", False)):
        manager = Manager(rank=0)
        group = ProcessGroup(manager, size=2)
        model = torch.nn.Linear(4, 3)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = ElasticDiLoCo(
            model, inner, manager=manager, process_group=group, sync_every=1, compression=kind
        )
        model(torch.ones(2, 4)).sum().backward()
        inner.step()  # an outer step among 2 workers: error feedback of its compression
        assert diloco.outer_steps == 1 and any(bool(e.ne(0).any()) for e in _feedback(diloco))
        model.zero_grad()  # no more inner progress: the next pseudo-gradient is zero
        group.ranks, manager.rank = 3, 1  # a worker joined, before this one
        with caplog.at_level("INFO", logger="fn.integrations.torchft.diloco"):
            caplog.clear()
            diloco.sync()  # sends the error feedback alone, where it was kept
        assert diloco.outer_steps == 2 and diloco.participants == [True] * 3
        message = "the quorum changed (2 workers, rank 0 -> 3 workers, rank 1)"
        assert (message in caplog.text) == restarts, kind
        kept = any(bool(e.ne(0).any()) for e in _feedback(diloco))
        assert kept != restarts, kind


@pytest.mark.parametrize(
    "options",
    [
        {"compression": "topk", "compression_options": {"k": 16, "chunk_size": 128}},
        {
            "compression": "topk",
            "compression_options": {"k": 16, "chunk_size": 128, "exchange": "gather"},
        },
        {"outer": "sparseloco", "compression_options": {"k": 16, "chunk_size": 128}},
    ],
    ids=["topk-auto", "topk-gather", "sparseloco"],
)
def test_a_full_restart_keeps_the_error_feedback_and_continues_bit_for_bit(options):
    """A checkpoint of a worker at rank 1 of 3, loaded into fresh objects (a full restart),
    then the same quorum: the error feedback (an owner's share too: ``"auto"`` picks the owners
    here) loads as saved, with no warning, and the run goes on as without the restart."""

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1)
        )
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = Manager(rank=1)
        group = ProcessGroup(manager, size=3)
        elastic = ElasticDiLoCo(
            model, inner, manager=manager, process_group=group, sync_every=2, **options
        )
        return model, inner, elastic

    def train(model, inner, steps):
        for t in steps:
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t))
            (model(x) - x.sum(1, keepdim=True)).square().mean().backward()
            inner.step()
            inner.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model, inner, diloco = build()
    train(model, inner, range(4))
    saved = copy.deepcopy((model.state_dict(), inner.state_dict(), diloco.state_dict()))
    assert all(bool(e.ne(0).any()) for e in _feedback(diloco))
    want = train(model, inner, range(4, 8))
    model, inner, diloco = build()
    model.load_state_dict(saved[0])
    inner.load_state_dict(saved[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diloco.load_state_dict(saved[2])
    saved_feedback = saved[2]["per_rank"]["rank0"]["error_feedback"]
    loaded = _feedback(diloco)
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved_feedback, strict=True))
    assert torch.equal(train(model, inner, range(4, 8)), want)


def test_a_worker_whose_batchnorm_statistics_hold_nan_sits_out():
    """A NaN sample in a forward pass whose step was skipped (a GradScaler's): the parameters
    stay finite, BatchNorm's running statistics NaN; the worker sits out (as fn.diloco.DiLoCo's
    workers do), so that they never reach the others' mean, and says that its buffers may be
    why."""
    manager = Manager()
    group = ProcessGroup(manager, size=2)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = ElasticDiLoCo(model, inner, manager=manager, process_group=group, sync_every=1)
    model(torch.tensor([[float("nan"), 1.0], [0.0, 1.0]]))  # no backward: the step skipped
    with pytest.warns(RuntimeWarning, match="its buffers held NaN or Inf"):
        inner.step()
    assert diloco.sat_out_steps == 1 and diloco.participants == [False, False]


def test_an_overflowing_outer_step_is_skipped_and_says_so():
    """Finite pseudo-gradients near fp32's largest value whose outer update overflows: no
    worker took part, the parameters are back at the anchor, and the warning names the
    overflow, not a NaN of this worker's."""
    manager = Manager()
    model = torch.nn.Linear(2, 3)
    torch.nn.init.zeros_(model.weight), torch.nn.init.zeros_(model.bias)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    group = ProcessGroup(manager, size=2)
    diloco = ElasticDiLoCo(model, inner, manager=manager, process_group=group, sync_every=1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0e38)
    with pytest.warns(RuntimeWarning, match="finite, but their mean or its outer update overflow"):
        inner.step()
    assert diloco.participants == [False, False] and diloco.skipped_steps == 1
    assert all(bool((p == 0).all()) for p in model.parameters())


def test_a_recovering_worker_lays_top_k_out_as_its_peers_do():
    """At 3 workers top-k's ``"auto"`` exchange is the owner-partitioned one here: the first
    quorum lays a worker's state out for it (as ``fn.diloco.DiLoCo`` on 3 workers does), and a
    worker that recovers from that peer holds the same layout (it held the owner's error
    feedback while its peers did not: their exchange's layouts differed, and every worker
    failed)."""
    # the model's leaves in chunks of 128: 1,024 weights -> 8, then 128, 128 and 1 -> 1 each
    assert topk_exchange_form(chunks=11, k=16, chunk_size=128, world_size=3) == "owner"
    workers = []
    for rank in (0, 1):
        manager = Manager(rank=rank)
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1)
        )
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        diloco = ElasticDiLoCo(
            model,
            inner,
            manager=manager,
            process_group=ProcessGroup(manager, size=3),
            sync_every=1,
            compression="topk",
            compression_options={"k": 16, "chunk_size": 128},
        )
        workers.append((model, inner, manager, diloco))
    model, inner, manager, peer = workers[0]
    model(torch.ones(2, 8)).sum().backward()
    inner.step()  # the peer's first outer step, among 3 workers
    _, _, joining_manager, joining = workers[1]
    load, _ = joining_manager.state_fns["fn.diloco"]
    _, save = manager.state_fns["fn.diloco"]
    load(save())  # torchft's recovery, inside the joining worker's start_quorum
    assert joining.outer_steps == peer.outer_steps == 1
    shapes = [[e.shape for e in _feedback(d)] for d in (peer, joining)]
    assert shapes[0] == shapes[1]
    assert len(shapes[0]) == len(list(model.parameters())) + 1  # with the owner's error


def test_the_positional_compressions_are_those_whose_error_feedback_is_all_by_position():
    from fn.collectives import Simulated, error_feedback_leaves, positional_leaves
    from fn.diloco import COMPRESSIONS, compression
    from fn.integrations.torchft import POSITIONAL_COMPRESSIONS

    params = {"w": torch.zeros(5000), "b": torch.zeros(3)}
    for kind in COMPRESSIONS:
        for exchange in ("gather", "owner") if kind == "topk" else (None,):
            options = {"exchange": exchange} if exchange else {}
            state = compression(kind, comm=Simulated(4), **options).init(params)
            feedback, positional = error_feedback_leaves(state), positional_leaves(state)
            all_by_position = any(feedback) and positional == feedback
            assert all_by_position == (kind in POSITIONAL_COMPRESSIONS), (kind, exchange)


def test_a_peer_with_another_buffers_policy_is_refused():
    """``buffers=`` decides whether an outer step exchanges the buffers: a worker started with
    another policy (or other buffers) is another setting, in the exchange's header (its peers'
    exchanges went out of step) and in a recovery from a peer, nothing loaded."""
    workers = {}
    for policy in ("mean", "local"):
        manager = Manager(rank=0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        group = ProcessGroup(manager, size=2)
        diloco = ElasticDiLoCo(
            model, inner, manager=manager, process_group=group, sync_every=1, buffers=policy
        )
        workers[policy] = (manager, diloco)
    load, _ = workers["local"][0].state_fns["fn.diloco"]
    _, save = workers["mean"][0].state_fns["fn.diloco"]
    before = workers["local"][1].state_dict()
    with pytest.raises(ValueError, match=r"every worker must pass the same settings"):
        load(save())
    after = workers["local"][1].state_dict()
    assert all(torch.equal(a, b) for a, b in zip(before["anchor"], after["anchor"], strict=True))
    assert after["counts"] == before["counts"]
