"""fn.integrations.torchft: fn.diloco under torchft's Manager, on CPU gloo, each test with its
own lighthouse (torchft's ``LighthouseServer`` on a free port, shut down after) and worker
processes of tests/integrations/_torchft_worker.py (one replica group each):

- without faults, 3 workers train every outer rule and compressor (fp32, bf16, int8, loco4,
  1-bit, top-k with error feedback, sparseloco; with bf16 a BatchNorm, whose buffers are
  averaged) and end where ``fn.diloco.DiLoCo`` on 3 gloo ranks ends (parameters and buffers),
  bit for bit, sending the same bytes but for fn.diloco's header, and with its
  checkpoint: the same state dict, which ``DiLoCo`` on one worker and ``ElasticDiLoCo`` load;
- with faults, 4 workers with top-k and error feedback: one's pseudo-gradient turns NaN (it
  sits that step out, the others commit), one is SIGKILLed inside an outer exchange (that step
  fails on the others, who go on with 3 at the next quorum), one is SIGKILLed between outer
  steps and restarted (the others go on with 2; it rejoins, recovers the anchor from a live
  peer and sits one step out). Every committed anchor is the same on every worker and equals a
  loop over the participants (tests/diloco/_reference.py), and every worker ends with the same
  parameters;
- FSDP2 inside the workers: 2 workers of 2 ranks (``torchrun``), each rank recovering its
  shard at the first quorum (``init_sync``), then matching the loop; their checkpoint through
  ``fn.fsdp.TrainingCheckpoint`` loads into a fresh run.

No test hangs: every process runs in a session of its own and is stopped with the lighthouse
when a test ends or times out.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse in this process: its warnings
pytest.importorskip("torchft", reason="torchft is in the 'torchft' extra")
from torchft.coordination import LighthouseServer  # noqa: E402

import fn.diloco  # noqa: E402
from fn.integrations.torchft import ElasticDiLoCo  # noqa: E402
from tests._distributed import ROOT, run_distributed  # noqa: E402
from tests.diloco import _reference  # noqa: E402
from tests.integrations import _torchft_fakes as fakes  # noqa: E402
from tests.integrations import _torchft_worker as worker  # noqa: E402

SCRIPT = ROOT / "tests" / "integrations" / "_torchft_worker.py"
TOPK = {"compression": "topk", "compression_options": {"k": 2, "chunk_size": 4}}
CASES = [
    {},
    {"compression": "bf16", "batchnorm": True},  # its buffers averaged, as fn.diloco's
    {"compression": "int8"},
    {"compression": "loco4"},
    {"compression": "onebit"},
    TOPK,
    {
        "outer": "sparseloco",
        "outer_options": {"lr": 0.9, "beta": 0.9},
        "compression_options": {"k": 2, "chunk_size": 4},
    },
]
OUTER_STEPS = 3


class Cluster:
    """Worker processes under one lighthouse; every one still running is killed on exit."""

    def __init__(self, out: Path, min_replicas: int) -> None:
        self.out = out
        self.lighthouse = LighthouseServer(
            bind="[::]:0",
            min_replicas=min_replicas,
            join_timeout_ms=10_000,  # the first quorum waits for every worker's (a barrier)
            heartbeat_timeout_ms=2_000,  # a dead worker is left out after 2 s
        )
        self.processes: list[subprocess.Popen] = []

    def launch(self, replica: int, config: dict, tag: str = "") -> subprocess.Popen:
        """Starts a worker: one process, or with ``config["sharded"]`` a ``torchrun`` of 2."""
        env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        env.pop("WORLD_SIZE", None)
        log = open(self.out / f"log-{replica}{tag}.txt", "w")  # noqa: SIM115
        command = [sys.executable, str(SCRIPT), str(replica), self.lighthouse.address()]
        if config.get("sharded"):
            run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            command = [*run, "--nproc-per-node", "2", *command[1:]]
        process = subprocess.Popen(
            [*command, str(self.out), json.dumps(config)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def wait(self, process: subprocess.Popen, deadline: float) -> int:
        try:
            return process.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pytest.fail(f"a worker did not end in time:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text()[-3000:]}"
            for path in sorted(self.out.glob("log-*.txt"))
        )

    def close(self) -> None:
        # SIGTERM first: torchrun then ends its ranks, each in a session of its own
        running = [p for p in self.processes if p.poll() is None]
        for process in running:
            os.killpg(process.pid, signal.SIGTERM)
        for process in running:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.lighthouse.shutdown()


@contextlib.contextmanager
def cluster(out: Path, min_replicas: int) -> Iterator[Cluster]:
    running = Cluster(out, min_replicas)
    try:
        yield running
    finally:
        running.close()


def _records(out: Path) -> dict[int, list[dict]]:
    return {
        int(path.stem.split("-")[1]): [json.loads(line) for line in path.read_text().splitlines()]
        for path in out.glob("records-*.jsonl")
    }


@pytest.fixture(scope="module")
def without_faults(tmp_path_factory):
    """Every case on 3 torchft workers, and on fn.diloco's 3 gloo ranks meanwhile."""
    out = tmp_path_factory.mktemp("torchft")
    config = {"cases": CASES, "outer_steps": OUTER_STEPS, "replicas": 3}
    deadline = time.monotonic() + 400
    with cluster(out, min_replicas=3) as running:
        processes = [running.launch(r, config) for r in range(3)]
        plain = run_distributed(worker.plain, 3, CASES, OUTER_STEPS, timeout=400)
        codes = [running.wait(p, deadline) for p in processes]
        assert codes == [0, 0, 0], running.logs()
    elastic = [torch.load(out / f"params-{r}.pt") for r in range(3)]
    states = [torch.load(out / f"states-{r}.pt") for r in range(3)]
    return elastic, plain, _records(out), states


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_without_faults_the_run_is_fn_diloco_bit_for_bit(without_faults):
    elastic, plain, records, _ = without_faults
    for case, kwargs in enumerate(CASES):
        for r in range(3):
            got, expected = elastic[r][case], plain[r][case][0]
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), (kwargs, r)
    for r, lines in records.items():
        assert len(lines) == len(CASES) * OUTER_STEPS
        assert all(line["committed"] and line["world"] == 3 for line in lines)
        assert all(line["participants"] == [True] * 3 and line["rank"] == r for line in lines)
        cases = range(len(CASES))
        sent = [[line["bytes"] for line in lines if line["case"] == c][-1] for c in cases]
        # fn.diloco's bytes but for its participation record's header (where each worker is in
        # its schedule: int64 values to each of the other 2 workers at every step); the quorum
        # aligns the elastic workers' exchanges, whose header holds the settings' checksum alone
        headers = {plain[r][case][1] - sent[case] for case in range(len(CASES))}
        (header,) = headers  # the same for every compressor
        assert header > 0 and header % (8 * 2 * OUTER_STEPS) == 0, header


def _equal(a, b) -> bool:
    """Two state dicts' tensors, lists and values all equal."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_its_checkpoint_is_fn_diloco_s_and_restarts_on_any_number_of_workers(without_faults):
    """``ElasticDiLoCo.state_dict()`` is ``fn.diloco.DiLoCo``'s of the same run (its own error
    feedback under its own key; no count of each worker's sit-outs, as its workers come and
    go); a ``DiLoCo`` on one worker loads it (the error feedback restarts, with a warning), and
    an ``ElasticDiLoCo`` loads a ``DiLoCo``'s: top-k's error feedback with it, 1-bit's
    restarting from zero."""
    _, plain, _, states = without_faults
    for case, kwargs in enumerate(CASES):
        for r in range(3):
            mine, theirs = dict(states[r][case]), dict(plain[r][case][2])
            assert _equal(mine.pop("per_rank")["rank0"], theirs.pop("per_rank")[f"rank{r}"])
            counts = theirs.pop("counts")
            assert counts.pop("sat_out") == [0] * 3 and counts.pop("sit_outs_in_a_row") == [0] * 3
            assert mine.pop("counts") == counts
            assert _equal(mine, theirs), (kwargs, r)
    topk, onebit = CASES.index(TOPK), CASES.index({"compression": "onebit"})
    model = worker.model()
    inner = torch.optim.SGD(model.parameters(), lr=worker.LR)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=worker.H, **TOPK)
    with pytest.warns(UserWarning, match="error feedback restarts from zero"):
        diloco.load_state_dict(states[1][topk])
    assert _equal(diloco.state_dict()["anchor"], states[1][topk]["anchor"])
    for case in (topk, onebit):
        manager = fakes.Manager()
        elastic = ElasticDiLoCo(
            model, inner, manager=manager, process_group=fakes.ProcessGroup(manager),
            sync_every=worker.H, **CASES[case],
        )  # fmt: skip
        saved = plain[0][case][2]
        elastic.load_state_dict(saved)
        loaded = elastic.state_dict()
        assert _equal(loaded["anchor"], saved["anchor"]) and loaded["counts"] == saved["counts"]
        feedback = loaded["per_rank"]["rank0"]["error_feedback"]
        if case == topk:
            assert _equal(feedback, saved["per_rank"]["rank0"]["error_feedback"])
        else:  # laid out by the quorum's rank and size: restarts
            assert all(not bool(e.ne(0).any()) for e in feedback)


FAULTS = {
    "cases": [TOPK],
    "starters": 4,
    "replicas": 3,  # 3 stays dead
    "nan_at": {"replica": 1, "step": 1},  # replica 1 sits out the 2nd outer step
    "deaths": {"3": {"in_exchange": 4}, "2": {"after": 9}},  # the 3rd step fails; then 2 dies
    "watch_after": 8,
    "until_full": 2,
    "pause": 0.2,
}


@pytest.fixture(scope="module")
def with_faults(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchft")
    deadline = time.monotonic() + 400
    with cluster(out, min_replicas=2) as running:
        processes = [running.launch(r, FAULTS) for r in range(4)]
        killed = [running.wait(processes[r], deadline) for r in (3, 2)]
        started = time.monotonic()
        processes[2] = running.launch(2, dict(FAULTS, restarted=True), tag="-restarted")
        codes = [running.wait(p, deadline) for p in processes[:3]]
        assert killed == [-signal.SIGKILL] * 2 and codes == [0, 0, 0], running.logs()
        rejoined = time.monotonic() - started
    final = {r: torch.load(out / f"params-{r}.pt")[0] for r in range(3)}
    return _records(out), final, rejoined


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_workers_leave_and_join_and_the_others_go_on(with_faults):
    records, final, rejoined = with_faults
    steps = {r: [(line["inner_steps"], line) for line in lines] for r, lines in records.items()}
    by_step = {r: dict(lines) for r, lines in steps.items()}
    # the NaN: replica 1 sat the 2nd step out, the other three committed it
    assert by_step[0][4]["participants"] == [True, False, True, True]
    # replica 3 died inside the 3rd step's exchange: the vote failed, the others went on
    assert all(not by_step[r][6]["committed"] for r in range(3))
    assert all(by_step[r][8]["committed"] and by_step[r][8]["world"] == 3 for r in range(3))
    # replica 2 died after it: the other two went on, committing steps with 2 workers
    assert any(line["world"] == 2 and line["committed"] for line in records[0])
    # restarted, it rejoined: it sat its first step out, then took part
    first = next(line for line in records[2] if line["inner_steps"] > 8)
    assert first["committed"] and first["world"] == 3 and first["sat_out"] == 1
    assert not first["participants"][first["rank"]]
    # every committed anchor is the same on every worker and a loop over the participants'
    expected = _replay(records, TOPK)
    for lines in records.values():
        for line in lines:
            if line["committed"]:
                assert line["anchor"] == worker.crc(expected[line["inner_steps"]]), line
    last = expected[max(expected)]
    for r in range(3):
        assert all(torch.equal(a, b) for a, b in zip(final[r], last, strict=True)), r
    print(f"the restarted worker rejoined and finished {rejoined:.1f} s after its start")


def _replay(records: dict[int, list[dict]], case: dict) -> dict[int, list[torch.Tensor]]:
    """The committed outer steps of ``records`` (each worker's lines of one case) replayed
    plainly, one worker after the other: each participant's SGD steps from the anchor it last
    continued from, to the step's inner step; the mean over the participants (top-k with each
    worker's error feedback, zero for a worker that (re)joins; or the exact mean), Nesterov's
    outer step (lr 0.7, momentum 0.9). Returns the anchor after each step, by its inner step."""
    steps: dict[int, dict[int, dict]] = {}
    for replica, lines in records.items():
        for line in lines:
            if line["committed"]:
                steps.setdefault(line["inner_steps"], {})[replica] = line
    anchor = [p.detach().clone() for p in worker.model().parameters()]
    momentum = [torch.zeros_like(a) for a in anchor]
    errors: dict[int, list[torch.Tensor]] = {}
    last: dict[int, int] = {}  # each member's inner step when it last continued from the anchor
    members: set[int] = set()
    out = {}
    for t in sorted(steps):
        lines = steps[t]
        order = sorted(lines, key=lambda r: lines[r]["rank"])
        masks = {tuple(line["participants"]) for line in lines.values()}
        assert len(masks) == 1 and len(next(iter(masks))) == len(order), (t, lines)
        for r in set(order) - members:  # a worker that (re)joins: its error feedback is zero
            errors[r] = [torch.zeros_like(a) for a in anchor]
        taking_part = [r for r, m in zip(order, next(iter(masks)), strict=True) if m]
        deltas = [_deltas(anchor, r, last.get(r, 0), t) for r in taking_part]
        for j, a in enumerate(anchor if taking_part else []):  # none: the anchor stays
            pieces = [d[j] for d in deltas]
            if case == TOPK:
                mean, kept = _reference.topk_allreduce(
                    pieces, [errors[r][j] for r in taking_part], 2, 4, 1.0
                )
                for r, e in zip(taking_part, kept, strict=True):
                    errors[r][j] = e
            else:
                mean = _reference.cast_mean(pieces, torch.float32)
            momentum[j] = momentum[j] * 0.9 + mean
            anchor[j] = a + torch.add(mean, momentum[j], alpha=0.9) * torch.tensor(-0.7)
        last.update(dict.fromkeys(order, t))
        members = set(order)
        out[t] = [a.clone() for a in anchor]
    return out


def _deltas(anchor: list[torch.Tensor], replica: int, first: int, last: int) -> list[torch.Tensor]:
    """``anchor - params`` of ``replica`` after its SGD steps ``first .. last - 1`` from
    ``anchor``."""
    net = worker.model()
    with torch.no_grad():
        for p, a in zip(net.parameters(), anchor, strict=True):
            p.copy_(a)
    inner = torch.optim.SGD(net.parameters(), lr=worker.LR)
    for t in range(first, last):
        worker.inner_step(net, inner, replica, t)
    return [a - p.detach() for a, p in zip(anchor, net.parameters(), strict=True)]


SHARDED = {"cases": [{}], "outer_steps": 3, "replicas": 2, "sharded": True, "init_sync": True}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """2 workers of 2 ranks each (torchrun), FSDP2 on each worker's 1-D mesh."""
    out = tmp_path_factory.mktemp("torchft")
    deadline = time.monotonic() + 400
    with cluster(out, min_replicas=2) as running:
        processes = [running.launch(r, SHARDED) for r in range(2)]
        codes = [running.wait(p, deadline) for p in processes]
        assert codes == [0, 0], running.logs()
    final = {r: torch.load(out / f"params-{r}.pt")[0] for r in range(2)}
    return _records(out), final, {r: torch.load(out / f"states-{r}.pt")[0] for r in range(2)}


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_fsdp2_workers_recover_their_shards_and_match_the_loop(sharded):
    """``init_sync``: at the first quorum each shard position recovers from one primary (torchft
    picks it per position: replica 0's for rank 0, replica 1's for rank 1), so every worker has
    a rank that recovered and sits that step out; the later steps are the unsharded loop's."""
    records, final, through_dcp = sharded
    assert through_dcp == {0: True, 1: True}  # fn.fsdp.TrainingCheckpoint saved and loaded it
    first = [lines[0] for lines in records.values()]
    assert all(line["committed"] and line["participants"] == [False, False] for line in first)
    expected = _replay(records, {})
    for lines in records.values():
        assert [line["participants"] for line in lines[1:]] == [[True, True]] * 2
        for line in lines:
            assert line["anchor"] == worker.crc(expected[line["inner_steps"]]), line
    last = expected[max(expected)]
    for params in final.values():
        assert all(torch.equal(a, b) for a, b in zip(params, last, strict=True))
