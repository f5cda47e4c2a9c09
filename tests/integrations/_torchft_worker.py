"""One torchft replica group of one rank for tests/integrations/test_torchft.py, and the same
training on fn.diloco's own gloo ranks (:func:`plain`), with the same model, data and settings.

``python _torchft_worker.py REPLICA LIGHTHOUSE OUT CONFIG`` (``CONFIG`` a JSON object) builds a
Manager over its own store and ``torchft.ProcessGroupGloo``, then trains every case of
``CONFIG["cases"]`` in turn with :class:`fn.integrations.torchft.ElasticDiLoCo`, a tiny linear
model and plain SGD, worker ``r``'s batch of inner step ``t`` drawn from seed ``1000 r + t``.
After every outer step it appends a line to ``OUT/records-REPLICA.jsonl`` (the Manager's step,
whether it committed, its quorum rank and size, the participants, a CRC-32 of the anchor) and at
the end saves the parameters of every case to ``OUT/params-REPLICA.pt``.

- ``CONFIG["deaths"]``: ``{"<replica>": {"after": t}}``: that replica SIGKILLs itself before
  inner step ``t`` (of the first case), unless ``CONFIG["restarted"]``; ``{"in_exchange": t}``:
  inside the outer exchange after inner step ``t`` instead (a collective that fails on the
  others). ``CONFIG["starters"]`` (default ``replicas``) first workers wait for each other;
  ``CONFIG["pause"]`` seconds before each inner step while the quorum has fewer workers.
- ``CONFIG["until_full"]``: instead of ``outer_steps`` steps, train until, after a step with
  fewer than ``CONFIG["replicas"]`` workers past inner step ``CONFIG["watch_after"]``, the last
  ``until_full`` committed steps had that many workers, all taking part (every worker decides
  alike: the quorum and the participants are the same on all).
- ``CONFIG["nan_at"]``: this replica's parameters become NaN before that outer step
  (``{"replica": r, "step": s}``): it sits the step out.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed.device_mesh
import torch.distributed.tensor

import fn.diloco

H = 2
LR = 0.1


def model(batchnorm: bool = False) -> torch.nn.Module:
    """The tiny model every worker starts from (with ``batchnorm``: buffers to average)."""
    torch.manual_seed(0)
    if batchnorm:
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    return torch.nn.Linear(4, 3)


def settings(case: dict) -> tuple[bool, dict]:
    """A case's model (``"batchnorm"``) and its DiLoCo settings."""
    case = dict(case)
    return bool(case.pop("batchnorm", False)), case


def inner_step(net: torch.nn.Module, inner: torch.optim.Optimizer, worker: int, t: int) -> None:
    g = torch.Generator().manual_seed(1000 * worker + t)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    torch.nn.functional.mse_loss(net(x), y).backward()
    inner.step()
    inner.zero_grad()


def crc(tensors: list[torch.Tensor]) -> int:
    digest = 0
    for x in tensors:
        digest = zlib.crc32(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy(), digest)
    return digest


def full(x: torch.Tensor) -> torch.Tensor:
    """``x`` whole: a ``DTensor`` gathered over its mesh (a collective), a tensor itself."""
    return x.full_tensor() if isinstance(x, torch.distributed.tensor.DTensor) else x


def plain(rank: int, world_size: int, cases: list[dict], outer_steps: int) -> list:
    """fn.diloco.DiLoCo on gloo ranks (``run_distributed``): every case's parameters, the bytes
    its outer steps sent and its state dict."""
    torch.set_num_threads(1)
    out = []
    for case in cases:
        batchnorm, kwargs = settings(case)
        net = model(batchnorm)
        inner = torch.optim.SGD(net.parameters(), lr=LR)
        diloco = fn.diloco.DiLoCo(net, inner, sync_every=H, **kwargs)
        diloco.comm.reset_bytes_sent()  # the settings' agreement at construction
        for t in range(H * outer_steps):
            inner_step(net, inner, rank, t)
        params = [p.detach().clone() for p in net.state_dict().values()]
        out.append((params, diloco.comm.bytes_sent, diloco.state_dict()))
    return out


class Worker:
    """A replica group: its store, Manager and process group. One rank (its own store), or with
    ``CONFIG["sharded"]`` the ranks of a ``torchrun`` launch, each model sharded by FSDP2 on
    their 1-D mesh (every rank of a worker draws the worker's batch)."""

    def __init__(self, replica: int, lighthouse: str, out: Path, config: dict) -> None:
        from torchft import Manager, ProcessGroupGloo

        self.replica, self.out, self.config = replica, out, config
        self.mesh, store = None, {"rank": 0, "world_size": 1}
        if config.get("sharded"):  # torchrun's store and ranks
            torch.distributed.init_process_group("gloo")
            self.mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
            store = {}
        else:
            self.store = torch.distributed.TCPStore("localhost", 0, is_master=True)
            store.update(store_addr="localhost", store_port=self.store.port)
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=config.get("pg_timeout", 10)))
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            use_async_quorum=False,
            init_sync=config.get("init_sync", False),  # else every worker starts from model()
            replica_id=str(replica),
            lighthouse_addr=lighthouse,
            timeout=timedelta(seconds=10),
            quorum_timeout=timedelta(seconds=60),
            connect_timeout=timedelta(seconds=30),
            **store,
        )
        self.writes = self.mesh is None or self.mesh.get_local_rank() == 0
        name = f"records-{replica}.jsonl" if self.writes else os.devnull
        self.records = open(out / name, "a", buffering=1)  # noqa: SIM115
        if not config.get("restarted"):
            self.wait_for_all()

    def model(self, batchnorm: bool = False) -> torch.nn.Module:
        net = model(batchnorm)
        if self.mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(net, mesh=self.mesh)
        return net

    def wait_for_all(self) -> None:
        """Every first worker's Manager is up (heartbeating) before any asks for a quorum, so
        that the lighthouse waits for all of them (``join_timeout_ms``) in the first one."""
        (self.out / f"ready-{self.replica}-{os.environ.get('RANK', 0)}").touch()
        starters = self.config.get("starters", self.config["replicas"])
        starters *= 2 if self.mesh is not None else 1
        while len(list(self.out.glob("ready-*"))) < starters:
            time.sleep(0.05)

    def run(self) -> None:
        from fn.integrations.torchft import ElasticDiLoCo

        params, states = [], []
        for index, case in enumerate(self.config["cases"]):
            batchnorm, kwargs = settings(case)
            net = self.model(batchnorm)
            inner = torch.optim.SGD(net.parameters(), lr=LR)
            diloco = ElasticDiLoCo(
                net, inner, manager=self.manager, process_group=self.pg, sync_every=H,
                name=f"case{index}", **kwargs,
            )  # fmt: skip
            self.train(index, net, inner, diloco)
            params.append([full(p).detach().clone() for p in net.state_dict().values()])
            sharded = self.mesh is not None
            states.append(self.through_dcp(net, inner, diloco) if sharded else diloco.state_dict())
        if self.writes:
            torch.save(params, self.out / f"params-{self.replica}.pt")
            torch.save(states, self.out / f"states-{self.replica}.pt")
        self.manager.shutdown(wait=False)
        if self.mesh is not None:
            torch.distributed.destroy_process_group()

    def through_dcp(self, net, inner, diloco) -> bool:
        """Saves the run through DCP (``fn.fsdp.TrainingCheckpoint``) and loads it into a fresh
        one: whether the parameters, the anchor and the counts came back."""
        import fn.fsdp
        from fn.integrations.torchft import ElasticDiLoCo

        path = str(self.out / f"dcp-{self.replica}")
        fn.fsdp.TrainingCheckpoint(net, inner, extra={"diloco": diloco}).save(path)
        net2 = self.model()
        inner2 = torch.optim.SGD(net2.parameters(), lr=LR)
        fresh = ElasticDiLoCo(
            net2, inner2, manager=self.manager, process_group=self.pg, sync_every=H, name="dcp"
        )
        fn.fsdp.TrainingCheckpoint(net2, inner2, extra={"diloco": fresh}).load(path)
        before, after = diloco.state_dict(), fresh.state_dict()
        anchors = zip(before["anchor"], after["anchor"], strict=True)
        pairs = [*anchors, *zip(net.parameters(), net2.parameters(), strict=True)]
        same = all(torch.equal(full(a), full(b)) for a, b in pairs)
        return same and before["counts"] == after["counts"]

    def train(self, case: int, net, inner, diloco) -> None:
        config, streak = self.config, 0
        degraded = bool(config.get("restarted"))  # restarted: the others lost it
        while True:
            t = diloco.inner_steps
            self.maybe_die(case, t, diloco)
            if t % H == H - 1:
                self.maybe_nan(net)
            before = (diloco.outer_steps, diloco.failed_commits)
            if diloco.participants and len(diloco.participants) < config["replicas"]:
                time.sleep(config.get("pause", 0.0))  # fewer steps to replay while one is away
            inner_step(net, inner, self.replica, t)
            if (diloco.outer_steps, diloco.failed_commits) == before:
                continue  # no outer step after this inner step
            committed = diloco.outer_steps != before[0]
            self.record(case, diloco, committed)
            if "until_full" not in config:
                if diloco.outer_steps >= config["outer_steps"]:
                    return
                continue
            # after inner step watch_after: a step with fewer workers, then until_full steps
            # with every one of them taking part (the same decision on every worker)
            watched = diloco.inner_steps > config["watch_after"]
            degraded = degraded or (watched and diloco.comm.world_size < config["replicas"])
            every = committed and diloco.participants == [True] * config["replicas"]
            streak = streak + 1 if every else 0
            if degraded and streak >= config["until_full"]:
                return

    def maybe_die(self, case: int, t: int, diloco) -> None:
        death = self.config.get("deaths", {}).get(str(self.replica))
        if case or self.config.get("restarted") or death is None:
            return
        if t == death.get("after"):
            os.kill(os.getpid(), signal.SIGKILL)
        if t == death.get("in_exchange"):  # the outer step's first collective: its message

            def dying(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            for collective in ("all_reduce", "all_gather", "all_to_all", "reduce_scatter"):
                setattr(diloco.comm, collective, dying)

    def maybe_nan(self, net) -> None:
        nan = self.config.get("nan_at")
        if nan and nan["replica"] == self.replica and self.manager.current_step() == nan["step"]:
            with torch.no_grad():
                net.weight[0, 0] = float("nan")

    def record(self, case: int, diloco, committed: bool) -> None:
        line = {
            "case": case,
            "committed": committed,
            "step": self.manager.current_step(),
            "inner_steps": diloco.inner_steps,
            "failed_commits": diloco.failed_commits,
            "outer_steps": diloco.outer_steps,
            "world": diloco.comm.world_size,
            "rank": diloco.comm.rank,
            "participants": diloco.participants,
            "anchor": crc([full(a) for a in diloco.state_dict()["anchor"]]),
            "sat_out": diloco.sat_out_steps,
            "bytes": diloco.comm.bytes_sent,
        }
        self.records.write(json.dumps(line) + "\n")


def main() -> None:
    torch.set_num_threads(1)
    replica, lighthouse, out, config = sys.argv[1:5]
    Worker(int(replica), lighthouse, Path(out), json.loads(config)).run()


if __name__ == "__main__":
    main()
