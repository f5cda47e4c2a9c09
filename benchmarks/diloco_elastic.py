"""Elastic DiLoCo on torchft: the time to a held-out loss when one of 4 workers is killed a third
of the way and restarted, over a 10 Mbit/s link with 50 ms delay.

Needs root, ``ip``, ``tc``, ``/dev/net/tun`` (as ``benchmarks/diloco_wall.py``, whose switch,
namespaces and shaped links it reuses: every node's ``eth0`` sends at most ``--rate``, and
every packet is held ``--delay`` one way) and torchft 0.2.0 (the ``torchft`` extra). Five
nodes: the 4 workers (``PREFIX-r0`` .. ``r3``, one process each) and torchft's lighthouse
(``PREFIX-r4``, ``torchft_lighthouse --min_replicas 2 --join_timeout_ms 10000``), so that the
heartbeats and quorum calls cross the same link and are counted apart, on the lighthouse's
interface. Every run trains :mod:`benchmarks.diloco`'s model (the demo's next-character MLP,
144k params) with AdamW (lr 3e-3) inside every worker, worker ``r``'s batch of inner step ``t``
drawn from its own shard by a generator seeded with ``(seed, r, t)`` (so a restarted worker
draws the batches of the steps it resumes at), an outer step every ``H`` (``--sync-every``,
30) inner steps, from the same seed, until worker 0's held-out loss (evaluated after every
outer step) is at most ``--target``. The runs:

- ``fn-torchft-topk``: :class:`fn.integrations.torchft.ElasticDiLoCo`, SparseLoCo's rule (lr 1,
  beta 0.95, chunk-wise top-k of 4096 at density 1/32 in 2 bits with error feedback); worker 3
  SIGKILLs itself at inner step ``--kill-at`` and is started again at once;
- ``fn-torchft-topk-nofault``: the same without the fault;
- ``fn-diloco-restart``: ``fn.diloco.DiLoCo`` on a gloo group of the 4, the same rule, every
  worker saving its state after every outer step; worker 3 is killed at the same step, the
  others raise (``CollectiveTimeoutError``, ``FN_TIMEOUT`` = ``--fn-timeout``), and all 4 are
  started again from their last checkpoints;
- ``torchft-diloco-dense``: torchft's own ``torchft.local_sgd.DiLoCo`` (its outer SGD with
  Nesterov momentum, lr 0.7, momentum 0.9, on the dense fp32 allreduce), the Manager recovering
  the model, the inner and the outer optimizer as torchft's ``train_diloco.py`` does; worker 3
  killed and restarted as above.

``--kill-at`` defaults to a third of the no-fault run's inner steps to the target (that run goes
first in each repeat), moved to the middle of an outer step's interval. The torchft runs use
``Manager(use_async_quorum=False, init_sync=False, timeout=--fn-timeout)``.

The time to the target is worker 0's: from its first inner step to the outer step that reached
the target, on the wall clock (a restart and its start-up included), less its evaluations. Per
run also: the outer steps to the target, the median seconds per outer step, worker 3's start-up
after its restart (process start to its first inner step) and the time from its restart to its
first committed outer step, and per outer step of worker 0 in its steady state (the median over
its outer steps): fn's count of the outer exchange (``comm.bytes_sent``) and the bytes its
``eth0`` sent, and torchft's control traffic per worker (the lighthouse's ``eth0``, both ways,
over the run, divided by the workers and the outer steps). The summary checks the issue's
targets: the fault costs at most the restarted worker's start-up plus one outer step; the bytes
per outer step within 5% of fn.diloco's (the heartbeats apart); a shorter time to the target
than torchft's dense DiLoCo with the same fault.

All processes share this machine's CPUs: the times are pessimistic where workers would have
their own cores, and move with the load (noted before every repeat).

Run:  sudo python3 benchmarks/diloco_elastic.py [--runs 3] [--target 2.3] [--kill-at N]
      [--methods fn-torchft-topk,...]
      python3 benchmarks/diloco_elastic.py --dry-run     (print the plan; needs nothing)
      sudo python3 benchmarks/diloco_elastic.py --cleanup
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = 4
NODES = WORKERS + 1  # the lighthouse's node is the last
VICTIM = 3
CHUNK = 4096
LIGHTHOUSE_PORT = 29510
AFTER_S = 180  # how long a run goes on after the target, for its restarted worker to rejoin


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wall = _load("fn_bench_diloco_wall", os.path.join("benchmarks", "diloco_wall.py"))
cluster = wall.cluster


class Method(NamedTuple):
    """One run: ``kind`` is ``"fn-torchft"``, ``"fn-diloco"`` or ``"torchft"``."""

    name: str
    kind: str
    fault: bool


METHODS = (
    Method("fn-torchft-topk-nofault", "fn-torchft", False),
    Method("fn-torchft-topk", "fn-torchft", True),
    Method("fn-diloco-restart", "fn-diloco", True),
    Method("torchft-diloco-dense", "torchft", True),
)


def plan(args: argparse.Namespace) -> list[Method]:
    return [m for m in METHODS if args.methods is None or m.name in args.methods]


def mid_interval(step: int, sync_every: int) -> int:
    """``step`` moved to the middle of its outer step's interval (a kill between exchanges)."""
    return step // sync_every * sync_every + sync_every // 2


def worker_config(args: argparse.Namespace, method: Method, run: int, rank: int) -> dict:
    return {
        "rank": rank,
        "method": method._asdict(),
        "run": run,
        "seed": args.seed,
        "lr": args.lr,
        "batch": args.batch,
        "sync_every": args.sync_every,
        "k": CHUNK // args.density,
        "target": args.target,
        "max_steps": args.max_steps,
        "kill_at": args.kill_at if method.fault and rank == VICTIM else None,
        "fn_timeout": args.fn_timeout,
        "address": cluster.address(args.subnet, rank),
        "master": cluster.address(args.subnet, 0),
        "lighthouse": f"http://{cluster.address(args.subnet, WORKERS)}:{LIGHTHOUSE_PORT}",
    }


def node(args: argparse.Namespace, index: int) -> str:
    return cluster.namespaces(args.prefix, NODES)[1][index]


def worker_command(args: argparse.Namespace, config: dict) -> list[str]:
    ns = node(args, config["rank"])
    script = os.path.abspath(__file__)
    return ["ip", "netns", "exec", ns, sys.executable, script, "--worker", json.dumps(config)]


def lighthouse_command(args: argparse.Namespace) -> list[str]:
    lighthouse = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    return ["ip", "netns", "exec", node(args, WORKERS), lighthouse, "--min_replicas", "2"] + [
        "--join_timeout_ms",
        "10000",
        "--bind",
        f"0.0.0.0:{LIGHTHOUSE_PORT}",
    ]


def environment(args: argparse.Namespace) -> dict:
    return {
        **os.environ,
        "MASTER_ADDR": cluster.address(args.subnet, 0),
        "MASTER_PORT": str(cluster.PORT),
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": REPO,
        "RUST_LOG": "warn",
        "FN_TIMEOUT": str(args.fn_timeout),
    }


def print_plan(args: argparse.Namespace) -> None:
    _, nodes = cluster.namespaces(args.prefix, NODES)
    print(f"# set up: {NODES} namespaces, one TUN eth0 each, held by diloco_wall.py's switch")
    for ns in nodes:
        print(f"ip netns add {ns}")
    switch = json.dumps(wall.switch_config(args, NODES))
    print(f"{sys.executable} {os.path.abspath(wall.__file__)} --switch '{switch}'")
    for cmd in wall.link_commands(args, NODES):
        print(" ".join(cmd))
    print(f"# torchft runs: the lighthouse in {node(args, WORKERS)}")
    print(" ".join(lighthouse_command(args)))
    for run in range(args.runs):
        print(f"# run {run + 1} of {args.runs} (load average noted before it)")
        for method in plan(args):
            fault = f"worker {VICTIM} killed at inner step {args.kill_at or 'a third'}"
            print(f"#   {method.name}: {fault if method.fault else 'no fault'}")
            for rank in range(WORKERS):
                cmd = worker_command(args, worker_config(args, method, run, rank))
                print(" ".join(cmd[:-1]), f"'{cmd[-1]}'")
    print("# clean up: stop the switch (its TUN devices go with it), then")
    for ns in nodes:
        print(f"ip netns delete {ns}")


# ----------------------------------------------------------------------------------------------
# Host side: one run.


def interface_bytes(args: argparse.Namespace, index: int) -> tuple[int, int]:
    """``(tx, rx)`` bytes of node ``index``'s ``eth0``."""
    out = cluster.run(["ip", "-n", node(args, index), "-s", "-j", "link", "show", "dev", "eth0"])
    stats = json.loads(out.stdout)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


def events(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class Run:
    """The processes of one run, their logs and event files; everything is stopped on exit."""

    def __init__(self, args: argparse.Namespace, method: Method, run: int, logdir: str) -> None:
        self.args, self.method, self.run = args, method, run
        self.folder = os.path.join(logdir, f"run{run}-{method.name}")
        os.makedirs(self.folder)
        self.procs: dict[str, subprocess.Popen] = {}
        self.launched: dict[str, float] = {}

    def start(self, name: str, command: list[str]) -> None:
        log = open(os.path.join(self.folder, f"{name}.log"), "a")  # noqa: SIM115
        self.launched[name] = time.time()
        self.procs[name] = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=environment(self.args),
            start_new_session=True,
        )  # fmt: skip

    def start_worker(self, rank: int, **extra) -> None:
        config = worker_config(self.args, self.method, self.run, rank)
        config.update(extra, events=os.path.join(self.folder, f"events-{rank}.jsonl"))
        self.start(f"worker{rank}", worker_command(self.args, config))

    def tail(self, name: str) -> str:
        with open(os.path.join(self.folder, f"{name}.log")) as f:
            return "".join(f.readlines()[-30:])

    def stop(self) -> None:
        cluster.stop(list(self.procs.values()))


def run_one(args: argparse.Namespace, method: Method, run: int, logdir: str) -> dict:
    """Runs ``method`` until worker 0 reaches the target (or ``--timeout``), and, where a
    worker was restarted alone, until it took part in an outer step (at most ``AFTER_S`` more
    seconds); returns worker 0's and worker 3's events, the restart's time and the lighthouse's
    byte counts, sampled every second."""
    job = Run(args, method, run, logdir)
    restarted_at, reached_at, samples = None, None, []
    try:
        if method.kind != "fn-diloco":
            job.start("lighthouse", lighthouse_command(args))
        for rank in range(WORKERS):
            job.start_worker(rank)
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            samples.append((time.time(), *interface_bytes(args, WORKERS)))
            if reached_at is None and any(
                e["event"] in ("target", "cap") for e in events(_events(job, 0))
            ):
                reached_at = time.monotonic()
            if reached_at is not None and (
                time.monotonic() > reached_at + AFTER_S
                or not _awaiting_rejoin(job, method, restarted_at)
            ):
                break
            codes = {name: p.poll() for name, p in job.procs.items()}
            if method.fault and restarted_at is None and codes[f"worker{VICTIM}"] == -9:
                restarted_at = _restart(job, method, codes)
                continue
            failed = [n for n, c in codes.items() if c not in (None, 0)]
            if method.fault and restarted_at is None:  # the victim died: fn.diloco's others too
                failed = [n for n in failed if n != f"worker{VICTIM}" and not _all_fail(method)]
            if failed:
                raise RuntimeError(f"{method.name}: {failed[0]} failed:\n{job.tail(failed[0])}")
            time.sleep(0.5)
        else:
            raise RuntimeError(
                f"{method.name}: no result in {args.timeout} s:\n{job.tail('worker0')}"
            )
    finally:
        job.stop()
    return {
        "method": method.name,
        "run": run,
        "target": args.target,
        "events": events(_events(job, 0)),
        "victim_events": events(_events(job, VICTIM)),
        "restarted_at": restarted_at,
        "lighthouse": samples,  # (wall, tx, rx) of the lighthouse's eth0
    }


def _all_fail(method: Method) -> bool:
    """Whether every worker ends when one dies (fn.diloco without torchft)."""
    return method.kind == "fn-diloco"


def _restart(job: Run, method: Method, codes: dict) -> float | None:
    """Starts worker 3 again after its death (fn.diloco: all 4, once every worker has ended);
    the time it did, or ``None`` where fn.diloco's others still run."""
    if method.kind != "fn-diloco":
        job.start_worker(VICTIM, restarted=True)
        return time.time()
    if any(codes[f"worker{r}"] is None for r in range(WORKERS)):
        return None
    started = time.time()
    for rank in range(WORKERS):
        job.start_worker(rank, resume=True)
    return started


def _awaiting_rejoin(job: Run, method: Method, restarted_at: float | None) -> bool:
    """Whether worker 3, restarted alone, has yet to take part in an outer step."""
    if not method.fault or method.kind == "fn-diloco":
        return False
    if restarted_at is None:
        return True
    return not any(
        e["event"] == "outer" and e["wall"] >= restarted_at for e in events(_events(job, VICTIM))
    )


def _events(job: Run, rank: int) -> str:
    return os.path.join(job.folder, f"events-{rank}.jsonl")


# ----------------------------------------------------------------------------------------------
# Worker side (inside its namespace).


class Trainer:
    """One worker: its model, data, inner optimizer and the method's outer step."""

    def __init__(self, config: dict) -> None:
        import socket

        import torch

        self.config, self.torch = config, torch
        # torchft advertises its Manager and checkpoint servers by host name: this node's
        # address, which the other namespaces reach
        socket.gethostname = lambda: config["address"]
        self.log = open(config["events"], "a", buffering=1)  # noqa: SIM115
        self.emit("start")
        torch.set_num_threads(1)
        self.bench = _load("fn_bench_diloco", os.path.join("benchmarks", "diloco.py"))
        from fn.app import _data

        self.data = _data
        corpus = _data.load_corpus()
        self.ids = _data.shard(corpus.train, config["rank"], WORKERS)
        self.heldout = self.bench.heldout_windows(corpus)
        self.model = self.bench.make_model(config["seed"])
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=config["lr"], weight_decay=0.01)
        self.outer = None

    def emit(self, event: str, **values) -> None:
        self.log.write(json.dumps({"event": event, "wall": time.time(), **values}) + "\n")

    def batch(self, t: int):
        seed = (self.config["seed"] * 100_003 + self.config["rank"]) * 1_000_003 + t
        generator = self.torch.Generator().manual_seed(seed)
        batch = self.config["batch"]
        starts = self.data.batch_starts(self.ids.numel(), self.bench.CONTEXT, batch, generator)
        return self.data.windows(self.ids, starts, self.bench.CONTEXT)

    def evaluate(self) -> float:
        with self.torch.no_grad():
            logits = self.model(self.heldout[0])
            return float(self.torch.nn.functional.cross_entropy(logits, self.heldout[1]))

    def wait_for_all(self) -> None:
        """The first workers start training together, once every one is set up (the lighthouse
        waits ``--join_timeout_ms`` for a late worker's first quorum, not for its start-up)."""
        folder = os.path.dirname(self.config["events"])
        open(os.path.join(folder, f"ready-{self.config['rank']}"), "w").close()
        while sum(os.path.exists(os.path.join(folder, f"ready-{r}")) for r in range(WORKERS)) < 4:
            time.sleep(0.05)

    def tx_bytes(self) -> int:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())

    def train(self, step, outer_steps, sent, after_outer=None, participants=None) -> None:
        """Inner steps until the cap; after each outer step, worker 0 evaluates."""
        config, torch = self.config, self.torch
        if not (config.get("restarted") or config.get("resume")):
            self.wait_for_all()
        self.emit("train_start", step=step())
        seen = outer_steps()
        while step() < config["max_steps"]:
            t = step()
            if t == config["kill_at"] and not config.get("restarted") and not config.get("resume"):
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = self.batch(t)
            torch.nn.functional.cross_entropy(self.model(x), y).backward()
            self.inner.step()
            self.inner.zero_grad(set_to_none=True)
            if outer_steps() == seen:
                continue
            seen = outer_steps()
            if after_outer is not None:
                after_outer()
            if config["rank"] == VICTIM:
                self.emit("outer", outer=seen)
            if config["rank"] != 0:
                continue
            started = time.time()
            loss = self.evaluate()
            self.emit(
                "eval", step=step(), outer=seen, loss=loss, eval_s=time.time() - started,
                fn_bytes=sent(), tx=self.tx_bytes(), took_part=participants and participants(),
            )  # fmt: skip
            if loss <= config["target"]:
                self.emit("target", step=step(), outer=seen)
        self.emit("cap")


def _manager(config: dict, **state):
    import torch
    from torchft import Manager, ProcessGroupGloo

    store = torch.distributed.TCPStore(config["address"], 0, is_master=True)
    pg = ProcessGroupGloo(timeout=datetime.timedelta(seconds=config["fn_timeout"]))
    manager = Manager(
        pg=pg, min_replica_size=2, use_async_quorum=False, init_sync=False,
        replica_id=str(config["rank"]), store_addr=config["address"], store_port=store.port,
        rank=0, world_size=1, hostname=config["address"], lighthouse_addr=config["lighthouse"],
        timeout=datetime.timedelta(seconds=config["fn_timeout"]),
        quorum_timeout=datetime.timedelta(seconds=600),
        connect_timeout=datetime.timedelta(seconds=120), **state,
    )  # fmt: skip
    return manager, pg, store


def fn_torchft(trainer: Trainer) -> None:
    from fn.integrations.torchft import ElasticDiLoCo

    config = trainer.config
    manager, pg, _store = _manager(config, load_state_dict=None, state_dict=None)
    diloco = ElasticDiLoCo(
        trainer.model, trainer.inner, manager=manager, process_group=pg,
        sync_every=config["sync_every"], outer="sparseloco",
        outer_options={"lr": 1.0, "beta": 0.95},
        compression_options={"k": config["k"], "chunk_size": CHUNK},
    )  # fmt: skip
    trainer.train(
        lambda: diloco.inner_steps,
        lambda: diloco.outer_steps,
        lambda: diloco.comm.bytes_sent,
        participants=lambda: sum(diloco.participants),
    )


def fn_diloco(trainer: Trainer) -> None:
    import torch
    import torch.distributed as dist

    import fn.diloco

    config = trainer.config
    dist.init_process_group(
        "gloo", rank=config["rank"], world_size=WORKERS,
        timeout=datetime.timedelta(seconds=config["fn_timeout"]),
    )  # fmt: skip
    diloco = fn.diloco.DiLoCo(
        trainer.model, trainer.inner, sync_every=config["sync_every"], outer="sparseloco",
        outer_options={"lr": 1.0, "beta": 0.95},
        compression_options={"k": config["k"], "chunk_size": CHUNK},
        timeout=config["fn_timeout"],
    )  # fmt: skip
    path = os.path.join(os.path.dirname(config["events"]), f"checkpoint-{config['rank']}.pt")
    if config.get("resume"):
        saved = torch.load(path)
        trainer.model.load_state_dict(saved["model"])
        trainer.inner.load_state_dict(saved["inner"])
        diloco.load_state_dict(saved["diloco"])
    diloco.comm.reset_bytes_sent()

    def save() -> None:
        state = {k: v.state_dict() for k, v in [("model", trainer.model), ("inner", trainer.inner)]}
        torch.save({**state, "diloco": diloco.state_dict()}, path + ".tmp")
        os.replace(path + ".tmp", path)

    trainer.train(
        lambda: diloco.inner_steps, lambda: diloco.outer_steps, lambda: diloco.comm.bytes_sent, save
    )


def torchft_diloco(trainer: Trainer) -> None:
    import torch
    from torchft.local_sgd import DiLoCo

    config, model, inner = trainer.config, trainer.model, trainer.inner
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def state_dict() -> dict:
        return {
            "model": model.state_dict(),
            "inner": inner.state_dict(),
            "outer": outer.state_dict(),
        }

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])
        outer.load_state_dict(state["outer"])

    manager, _pg, _store = _manager(config, load_state_dict=load_state_dict, state_dict=state_dict)
    counted = {"inner": 0}
    inner.register_step_post_hook(lambda *_: counted.update(inner=counted["inner"] + 1))
    with DiLoCo(manager, [model], inner, outer, sync_every=config["sync_every"]):
        h = config["sync_every"]
        trainer.train(
            lambda: manager.current_step() * h + counted["inner"] % h,
            manager.current_step,
            lambda: 0,
            participants=manager.num_participants,
        )


def worker_main(config: dict) -> None:
    trainer = Trainer(config)
    kind = config["method"]["kind"]
    {"fn-torchft": fn_torchft, "fn-diloco": fn_diloco, "torchft": torchft_diloco}[kind](trainer)


# ----------------------------------------------------------------------------------------------
# Summary (pure).


def _sample_at(samples: list, wall: float) -> list:
    """The last sample of the lighthouse's counters at or before ``wall`` (else the first)."""
    before = [x for x in samples if x[0] <= wall]
    return before[-1] if before else samples[0]


def per_outer_step(result: dict, evals: list[dict]) -> dict:
    """Medians over worker 0's consecutive outer steps: seconds (its evaluations left out),
    fn's bytes, its ``eth0``'s bytes, torchft's control traffic per worker (the lighthouse's
    interface, both ways, over ``WORKERS``) and what worker 0 sent less its share of what the
    lighthouse received (the data, as fn.diloco's runs send it)."""
    samples, out = result.get("lighthouse") or [], {}
    rows = []
    for a, b in itertools.pairwise(evals):
        row = {"s": b["wall"] - a["wall"] - b["eval_s"], "fn": b["fn_bytes"] - a["fn_bytes"]}
        row["wire"] = b["tx"] - a["tx"]
        if samples:
            (_, tx0, rx0), (_, tx1, rx1) = (
                _sample_at(samples, a["wall"]),
                _sample_at(samples, b["wall"]),
            )
            row["control"] = (tx1 - tx0 + rx1 - rx0) / WORKERS
            row["data"] = row["wire"] - (rx1 - rx0) / WORKERS
        rows.append(row)
    for key in ("s", "fn", "wire", "control", "data"):
        values = [r[key] for r in rows if key in r and (key == "s" or r[key] > 0)]
        out[key] = statistics.median(values) if values else None
    return out


def summarize(result: dict) -> dict:
    """One run's figures from worker 0's and worker 3's events (see the module docstring)."""
    evs = result["events"]
    first = next(e for e in evs if e["event"] == "train_start")
    evals = [e for e in evs if e["event"] == "eval"]
    hit = next((e for e in evals if e["loss"] <= result["target"]), None)
    end = hit or evals[-1]
    eval_s = sum(e["eval_s"] for e in evals if e["wall"] <= end["wall"])
    medians = per_outer_step(result, evals)
    row = {
        "method": result["method"],
        "run": result["run"],
        "reached": hit is not None,
        "steps": end["step"],
        "outer_steps": end["outer"],
        "loss": end["loss"],
        "time_s": end["wall"] - first["wall"] - eval_s,
        "s_per_outer": medians["s"],
        "fn_bytes_per_outer": medians["fn"],
        "wire_per_outer": medians["wire"],
        "control_per_outer": medians["control"],
        "data_per_outer": medians["data"],
        "startup_s": None,
        "rejoin_s": None,
    }
    if result["restarted_at"] is not None:
        lives = [e for e in result["victim_events"] if e["wall"] >= result["restarted_at"]]
        trained = next((e for e in lives if e["event"] == "train_start"), None)
        joined = next((e for e in lives if e["event"] == "outer"), None)
        if trained:
            row["startup_s"] = trained["wall"] - result["restarted_at"]
        if joined:
            row["rejoin_s"] = joined["wall"] - result["restarted_at"]
    return row


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(rows: list[dict]) -> str:
    lines = [
        "| run | method | reached | inner steps | outer steps | time to target s "
        "| s / outer step | restart: start-up s | restart: rejoined after s "
        "| fn B / outer step | wire B / outer step | torchft control B / outer step "
        "| wire less control B / outer step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['run'] + 1} | {r['method']} | {'yes' if r['reached'] else 'NO'} "
            f"| {r['steps']} | {r['outer_steps']} | {r['time_s']:.1f} "
            f"| {_f(r['s_per_outer'], '.2f')} | {_f(r['startup_s'], '.1f')} "
            f"| {_f(r['rejoin_s'], '.1f')} | {_f(r['fn_bytes_per_outer'] or None, ',.0f')} "
            f"| {_f(r['wire_per_outer'], ',.0f')} | {_f(r['control_per_outer'], ',.0f')} "
            f"| {_f(r['data_per_outer'], ',.0f')} |"
        )
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, per repeat: what each measures and whether it is met."""
    out = []
    for run in sorted({r["run"] for r in rows}):
        by = {r["method"]: r for r in rows if r["run"] == run}
        fault, clean = by.get("fn-torchft-topk"), by.get("fn-torchft-topk-nofault")
        plain, theirs = by.get("fn-diloco-restart"), by.get("torchft-diloco-dense")
        if fault and clean and fault["startup_s"] is not None:
            cost = fault["time_s"] - clean["time_s"]
            bound = fault["startup_s"] + clean["s_per_outer"]
            out.append(
                f"run {run + 1}: the fault costs {cost:.1f} s (bound: start-up "
                f"{fault['startup_s']:.1f} s + one outer step {clean['s_per_outer']:.2f} s = "
                f"{bound:.1f} s): {'met' if cost <= bound else 'NOT met'}"
            )
        if clean and plain and plain["fn_bytes_per_outer"]:
            ratio = clean["fn_bytes_per_outer"] / plain["fn_bytes_per_outer"]
            wire = clean["data_per_outer"] / plain["wire_per_outer"]
            out.append(
                f"run {run + 1}: bytes per outer step against fn.diloco: fn's count {ratio:.3f}x, "
                f"worker 0's wire less what it sent the lighthouse {wire:.3f}x: "
                f"{'met' if abs(wire - 1) <= 0.05 and abs(ratio - 1) <= 0.05 else 'NOT met'}"
            )
        if fault and theirs:
            out.append(
                f"run {run + 1}: time to target with the fault {fault['time_s']:.1f} s against "
                f"torchft's dense DiLoCo {theirs['time_s']:.1f} s "
                f"({theirs['time_s'] / fault['time_s']:.2f}x): "
                f"{'met' if fault['time_s'] < theirs['time_s'] and fault['reached'] else 'NOT met'}"
            )
    return out


# ----------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    wall.add_run_arguments(p, "fnelastic", "10.217.0")
    p.add_argument("--kill-at", type=int, help="worker 3's last inner step (default: a third)")
    p.add_argument("--max-steps", type=int, default=1500, help="inner steps cap")
    p.add_argument("--fn-timeout", type=float, default=30, help="FN_TIMEOUT, torchft timeout s")
    args = p.parse_args(argv)
    if args.methods is not None:
        args.methods = args.methods.split(",")
        unknown = set(args.methods) - {m.name for m in METHODS}
        if unknown:
            p.error(f"--methods: unknown {', '.join(sorted(unknown))}")
    if problem := cluster.naming_error(args.prefix, args.subnet):
        p.error(problem)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        sys.path.insert(0, REPO)
        worker_main(json.loads(args.worker))
        return
    sys.path.insert(0, REPO)
    if args.dry_run:
        print_plan(args)
        return
    cluster.check_host("benchmarks/diloco_elastic.py")
    if args.cleanup:
        removed = cluster.cleanup(args.prefix)
        print(f"removed {len(removed)} namespaces: {' '.join(removed) or '-'}")
        return
    rows, results = [], []

    def repeat(run: int, logdir: str) -> None:
        for method in plan(args):
            if method.fault and args.kill_at is None:  # a third of the no-fault run's steps
                clean = [r for r in rows if r["method"] == "fn-torchft-topk-nofault"]
                args.kill_at = mid_interval(
                    (clean[0]["steps"] if clean else 330) // 3, args.sync_every
                )
                print(f"  worker {VICTIM} is killed at inner step {args.kill_at}")
            result = run_one(args, method, run, logdir)
            results.append(result)
            rows.append(summarize(result))
            print(
                f"  {method.name}: {'reached' if rows[-1]['reached'] else 'NOT reached'} "
                f"{rows[-1]['loss']:.4f} after {rows[-1]['outer_steps']} outer steps, "
                f"{rows[-1]['time_s']:.1f} s",
                flush=True,
            )

    loads = wall.run_repeats(args, "diloco_elastic.py", NODES, repeat)
    print()
    print(table(rows))
    for line in targets(rows):
        print(line)
    wall.save_runs(args, loads, results)


if __name__ == "__main__":
    main()
