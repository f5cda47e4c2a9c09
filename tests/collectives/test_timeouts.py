"""ProcessGroup's timeout on real gloo processes: a stalled rank is named by every waiting rank
at the limit, a rank whose process ended is named as such right after the failure, ranks that
call different collectives are told what each called, every message states the limit and the
seconds waited, and the limit comes from the argument, ``FN_TIMEOUT`` or the default."""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import torch

from fn.app.launch import WorkerError
from fn.collectives import CollectiveTimeoutError, ProcessGroup
from fn.collectives.process_group import DEFAULT_TIMEOUT, TIMEOUT_ENV, resolve_timeout
from tests._distributed import run_distributed

pytestmark = pytest.mark.distributed

LIMIT_S = 2.0
STALL_S = 4 * LIMIT_S
GRACE_S = LIMIT_S / 2  # the last part of the limit, in which the ranks look for each other


def _outcome(run):
    start = time.monotonic()
    try:
        run()
    except CollectiveTimeoutError as err:
        return {"missing": err.missing_ranks, "message": str(err), "s": time.monotonic() - start}
    return {"missing": None, "message": "", "s": time.monotonic() - start}


def _faults(rank, world_size, folder):
    """A late rank, then three faults in a row on one group, the limit set by ``FN_TIMEOUT``;
    each rank saves its outcomes and ends at once (torch's process group would wait for the
    abandoned collectives until its own timeout)."""
    import torch.distributed as dist

    os.environ[TIMEOUT_ENV] = f"{LIMIT_S:g}"
    comm = ProcessGroup()
    dist.barrier()  # the limit is short: start together
    out = {"ok": comm.all_reduce(torch.ones(3), op="sum").tolist()}
    # 0. Rank 2 arrives in the last part of the limit, while the others look for it: no error.
    if rank == 2:
        time.sleep(LIMIT_S - GRACE_S / 2)
    out["late"] = _outcome(lambda: comm.all_reduce(torch.ones(4)))
    dist.barrier()
    # 1. Rank 2 is late (stalled): the others give up; its all_reduce then completes theirs.
    if rank == 2:
        time.sleep(STALL_S)
    out["stalled"] = _outcome(lambda: comm.all_reduce(torch.ones(4)))
    dist.barrier()
    # 1b. gather_to_first: every rank's tensor on rank 0, in rank order; then rank 0 gathers
    # while the others stall (a checkpoint saved on rank 0 only): rank 0 gives up at the limit.
    got = comm.gather_to_first(torch.full((2,), float(rank)))
    out["gathered"] = None if got is None else [t.tolist() for t in got]
    if rank != 0:
        time.sleep(STALL_S)
    gather = _outcome(lambda: comm.gather_to_first(torch.ones(2)))
    if rank == 0:
        out["gathered alone"] = gather
    dist.barrier()
    # 2. Rank 0 calls an all_gather while the others call an all_reduce: nobody is missing.
    if rank == 0:
        out["mismatch"] = _outcome(lambda: comm.all_gather(torch.ones(2, dtype=torch.int64)))
    else:
        out["mismatch"] = _outcome(lambda: comm.all_reduce(torch.ones(1, dtype=torch.int64)))
    # 3. Rank 2's process ends; the others' collective fails at once.
    if rank != 2:
        time.sleep(0.5)  # rank 2 has ended
        out["gone"] = _outcome(lambda: comm.all_reduce(torch.ones(4)))
    _save_and_end(out, folder, rank)


def _save_and_end(out, folder, rank):
    torch.save(out, os.path.join(folder, f"{rank}.pt"))
    os._exit(0)


@pytest.mark.timeout(120)
def test_faults_are_named_on_every_rank_within_the_limit(tmp_path):
    with pytest.raises(WorkerError, match="exited without a result"):
        run_distributed(_faults, 3, str(tmp_path), timeout=80)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(3)]
    for rank, out in enumerate(results):
        assert out["ok"] == [3.0, 3.0, 3.0]
        assert out["late"]["missing"] is None and out["late"]["s"] < LIMIT_S
        assert out["gathered"] == ([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]] if rank == 0 else None)
        if rank == 0:
            alone = out["gathered alone"]
            assert alone["missing"] == [1, 2] and "gather of (2,)" in alone["message"], alone
            assert LIMIT_S <= alone["s"] < LIMIT_S + 1.5
        stalled, mismatch = out["stalled"], out["mismatch"]
        if rank == 2:
            assert stalled["missing"] is None
        else:
            assert stalled["missing"] == [2]
            assert "rank(s) [2] never reached it" in stalled["message"]
            assert "FN_TIMEOUT" in stalled["message"]
            waited = re.search(
                r"did not complete within 2 s on rank \d \(waited ([\d.]+) s\)", stalled["message"]
            )
            # (the message rounds to 0.1 s)
            assert waited and LIMIT_S <= float(waited[1]) < stalled["s"] + 0.1 < LIMIT_S + 1.5
            gone = out["gone"]
            assert gone["missing"] == [2]
            failed = re.search(
                r"failed on rank \d after ([\d.]+) s, before its limit of 2 s: "
                r"rank\(s\) \[2\] never reached it in ([\d.]+) s",
                gone["message"],
            )
            assert failed and float(failed[1]) < GRACE_S <= float(failed[2]) < gone["s"] + 0.1
            assert "their process exited or crashed" in gone["message"]
            assert gone["s"] < GRACE_S + 1.5  # found after the last part of the limit
        assert mismatch["missing"] == []
        assert "rank 0: all_gather of (2,) int64" in mismatch["message"]
        assert "rank 1: all_reduce of (1,) int64" in mismatch["message"]
        assert "limit 2 s" in mismatch["message"] or "limit of 2 s" in mismatch["message"]
        assert mismatch["s"] < LIMIT_S + 1.5


def test_timeout_from_argument_environment_or_default(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT == datetime.timedelta(minutes=5)
    assert resolve_timeout(2.5) == datetime.timedelta(seconds=2.5)
    assert resolve_timeout(datetime.timedelta(seconds=7)) == datetime.timedelta(seconds=7)
    monkeypatch.setenv(TIMEOUT_ENV, "30")
    assert resolve_timeout(None) == datetime.timedelta(seconds=30)
    assert resolve_timeout(4) == datetime.timedelta(seconds=4)  # the argument wins
    monkeypatch.setenv(TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="FN_TIMEOUT must be a number of seconds"):
        resolve_timeout(None)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive"):
            resolve_timeout(bad)
    with pytest.raises(TypeError, match="timedelta or a number"):
        resolve_timeout("5")


def test_split_groups_inherit_the_timeout():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = ProcessGroup(timeout=3)
        assert comm.timeout == datetime.timedelta(seconds=3)
        assert all(sub.timeout == comm.timeout for sub in comm.split(1))
        assert "timeout=3 s" in repr(comm)
    finally:
        dist.destroy_process_group()


def _group_added_on_one_rank(rank, world_size, folder):
    """Rank 0 adds a param group while rank 1 steps: both give up after the limit, each told what
    the other called (the config check's fingerprint all_gather against the step's vote)."""
    import torch.distributed as dist

    import fn.optim
    from tests.optim._problem import backward, make_model

    model = make_model()
    opt = fn.optim.OnebitAdam([model[0].weight], lr=1e-2, freeze_step=3)
    backward(model, rank, 0)
    opt.step()  # together: the first step's check of the ranks' params is behind them
    opt.comm = ProcessGroup(timeout=LIMIT_S)  # after the build, which is slow on a busy machine
    dist.barrier()  # the limit is short: start together
    if rank == 0:
        out = _outcome(lambda: opt.add_param_group({"params": [model[2].weight]}))
    else:
        out = _outcome(opt.step)
    _save_and_end(out, folder, rank)


@pytest.mark.timeout(120)
def test_param_group_added_on_one_rank_gives_up_on_both(tmp_path):
    with pytest.raises(WorkerError, match="exited without a result"):
        run_distributed(_group_added_on_one_rank, 2, str(tmp_path), timeout=80)
    for rank in range(2):
        out = torch.load(tmp_path / f"{rank}.pt")
        assert out["missing"] == []
        assert (
            "rank 0: all_gather of (2,) int64; rank 1: all_reduce of (3,) int64" in (out["message"])
        )
        assert out["s"] < LIMIT_S + 1.5


def _stalled_transfers(rank, world_size, folder):
    """Rank 1 is late to a point-to-point exchange: rank 0's wait gives up and names it."""
    import torch.distributed as dist

    comm = ProcessGroup(timeout=LIMIT_S)
    dist.barrier()
    if rank == 1:
        time.sleep(STALL_S)

    def exchange():
        with comm.transfers("exchange") as transfers:
            transfers.recv(torch.empty(4), 1 - rank)
            transfers.send(torch.ones(4), 1 - rank)

    _save_and_end({"stalled": _outcome(exchange)}, folder, rank)


@pytest.mark.timeout(120)
def test_point_to_point_transfers_time_out_naming_the_late_rank(tmp_path):
    with pytest.raises(WorkerError, match="exited without a result"):
        run_distributed(_stalled_transfers, 2, str(tmp_path), timeout=80)
    stalled = torch.load(tmp_path / "0.pt")["stalled"]
    assert stalled["missing"] == [1]
    assert "exchange of (4,) float32" in stalled["message"]
    assert "rank(s) [1] never reached it" in stalled["message"]
    # a transfer waits the whole limit, then its ranks look for each other
    assert re.search(
        r"did not complete within 2 s on rank 0 \(waited 3\.\d s\)", stalled["message"]
    )
    assert LIMIT_S + GRACE_S <= stalled["s"] < LIMIT_S + GRACE_S + 1.5


class _VanishingStore:
    """rank 0's store as rank 1 sees it: rank 0 arrived, and the store answers ``answers``
    checks before its host (rank 0, which raised too) ends."""

    def __init__(self, answers: int, reachable: bool = True):
        self.keys = {}
        self.answers = answers
        self.reachable = reachable

    def set(self, key, value):
        if not self.reachable:
            raise RuntimeError("Connection refused")
        self.keys.setdefault(key.replace("/1", "/0"), b"all_reduce of (4,) float32")
        self.keys[key] = value.encode()

    def check(self, keys):
        self.answers -= 1
        if self.answers < 0:
            raise RuntimeError("Connection reset by peer")
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]


def _diagnosing_rank(monkeypatch, stores, rank, world_size, timeout_s):
    """A ``ProcessGroup`` of ``world_size`` ranks as ``rank`` sees it, its store ``stores[-1]``."""
    from fn.collectives import process_group

    monkeypatch.setattr(
        process_group.distributed_c10d, "_get_process_group_store", lambda g: stores[-1]
    )
    monkeypatch.setattr(process_group.dist, "get_rank", lambda group=None: rank)
    comm = object.__new__(ProcessGroup)
    comm.group, comm._world_size = None, world_size
    comm.timeout = datetime.timedelta(seconds=timeout_s)
    return comm


class _ReadingStore:
    """rank 0's store as rank 0 sees it: rank 1 called another collective and marks that it has
    read every call after ``late`` checks (never with ``late=None``)."""

    def __init__(self, late: int | None):
        self.keys = {"fn/5/1": b"all_gather of (2,) int64"}
        self.late, self.checks = late, 0

    def set(self, key, value):
        self.keys[key] = value.encode()

    def check(self, keys):
        self.checks += 1
        if self.late is not None and self.checks >= self.late:
            self.keys["fn/5/read/1"] = b""
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]


@pytest.mark.parametrize("late", [3, 6, None])
def test_the_store_host_stays_until_every_rank_read_the_calls(monkeypatch, late):
    """Every rank arrived: rank 0 (the store's host) returns only once rank 1 has read the calls,
    or at the grace deadline."""
    store = _ReadingStore(late)
    comm = _diagnosing_rank(monkeypatch, [store], rank=0, world_size=2, timeout_s=0.5)
    start = time.monotonic()
    err = comm._diagnose("all_reduce", 5, torch.ones(4), RuntimeError("failed"), time.monotonic())
    assert err.missing_ranks == []
    assert "rank 0: all_reduce of (4,) float32; rank 1: all_gather of (2,) int64" in str(err)
    assert "fn/5/read/0" in store.keys
    if late is None:  # after a failure: the last part of the limit, half of it here
        assert 0.25 <= time.monotonic() - start < 1.25
    else:
        assert store.checks >= late and "fn/5/read/1" in store.keys


@pytest.mark.parametrize("answers", [2, 3, 7])
def test_a_store_that_ends_while_looking_keeps_what_was_seen(monkeypatch, answers):
    """Rank 0 hosts the store and ends once it raised: a rank still looking for the missing
    ranks names those it has not seen (rank 2 here), not rank 0."""
    stores = [_VanishingStore(answers)]
    comm = _diagnosing_rank(monkeypatch, stores, rank=1, world_size=3, timeout_s=30)
    err = comm._diagnose("all_reduce", 5, torch.ones(4), RuntimeError("failed"), time.monotonic())
    assert err.missing_ranks == [2]
    assert "rank(s) [2] never reached it" in str(err) and "store went away" in str(err)

    stores.append(_VanishingStore(99, reachable=False))  # never reached: rank 0 is the suspect
    err = comm._diagnose("all_reduce", 6, torch.ones(4), RuntimeError("failed"), time.monotonic())
    assert err.missing_ranks == [0] and "rank 0 likely died" in str(err)


class _Store:
    """A store in which the ranks of ``calls`` ({rank: call}) arrived."""

    def __init__(self, calls: dict[int, str]):
        self.keys = {f"fn/5/{rank}": call.encode() for rank, call in calls.items()}
        self.keys.update({f"fn/5/read/{rank}": b"" for rank in calls})

    def set(self, key, value):
        self.keys[key] = value.encode()

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]


class _Work:
    """A collective on host tensors that completes ``done_after`` seconds from now (never with
    ``None``), failing with ``error`` if one is given."""

    def __init__(self, done_after: float | None, error: str | None = None):
        self.done_at = None if done_after is None else time.monotonic() + done_after
        self.error = error

    def is_completed(self):
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout):
        end = time.monotonic() + timeout.total_seconds()
        while not self.is_completed() and time.monotonic() < end:
            time.sleep(0.01)
        if not self.is_completed():
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise RuntimeError(self.error)


LIMIT_UNIT_S = 0.6  # the limit of the single-process tests below; their last part is 0.3 s


def _diagnose_after_first_part(monkeypatch, calls, work):
    """``_diagnose`` on rank 0 of two, called as ``_wait`` does when ``work``, started the first
    part of the limit ago, is still running (``work=None``: the collective failed at once).
    Returns its result and the seconds from the collective's start to the return."""
    comm = _diagnosing_rank(monkeypatch, [_Store(calls)], 0, 2, LIMIT_UNIT_S)
    started = time.monotonic() - (LIMIT_UNIT_S / 2 if work is not None else 0)
    err = comm._diagnose("all_reduce", 5, torch.ones(4), RuntimeError("gloo"), started, work)
    return err, time.monotonic() - started


def test_a_collective_that_completes_in_the_last_part_of_the_limit_is_no_error(monkeypatch):
    for calls in ({}, {1: "all_reduce of (4,) float32"}):  # rank 1 arrived or not
        err, elapsed = _diagnose_after_first_part(monkeypatch, calls, _Work(0.1))
        assert err is None and elapsed < LIMIT_UNIT_S


def test_a_missing_rank_is_reported_at_the_limit_with_the_seconds_waited(monkeypatch):
    err, elapsed = _diagnose_after_first_part(monkeypatch, {}, _Work(None))
    assert err.missing_ranks == [1]
    waited = re.search(r"did not complete within 0.6 s on rank 0 \(waited ([\d.]+) s\)", str(err))
    assert waited and LIMIT_UNIT_S <= float(waited[1]) < elapsed + 0.1 < LIMIT_UNIT_S + 0.5
    assert "rank(s) [1] never reached it" in str(err) and "FN_TIMEOUT" in str(err)


def test_a_slow_collective_every_rank_reached_is_reported_at_the_limit(monkeypatch):
    err, elapsed = _diagnose_after_first_part(
        monkeypatch, {1: "all_reduce of (4,) float32"}, _Work(None)
    )
    assert err.missing_ranks == [] and LIMIT_UNIT_S <= elapsed < LIMIT_UNIT_S + 0.5
    assert "did not complete within 0.6 s on rank 0 (waited 0.6 s), though every rank " in str(err)
    assert "raise the limit" in str(err)


@pytest.mark.parametrize("when", ["at once", "in the last part of the limit"])
def test_a_failure_is_reported_with_its_time_not_as_a_timeout(monkeypatch, when):
    work = None if when == "at once" else _Work(0.1, error="Connection closed by peer")
    err, elapsed = _diagnose_after_first_part(monkeypatch, {}, work)
    assert err.missing_ranks == [1]
    failed = re.search(
        r"failed on rank 0 after ([\d.]+) s, before its limit of 0.6 s: rank\(s\) \[1\] never "
        r"reached it in ([\d.]+) s; .* their process exited or crashed",
        str(err),
    )
    assert failed, str(err)
    assert float(failed[1]) <= float(failed[2]) < elapsed + 0.1
    assert "did not complete" not in str(err)
    if work is not None:  # the failure that ended the collective is the one named
        assert "Connection closed by peer" in str(err)
