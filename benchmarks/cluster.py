"""Compressed collectives and training steps over rate-limited links: a cluster in namespaces.

Needs root, ``ip`` and ``tc`` (iproute2). It builds a private virtual cluster on this machine:

- one network namespace per rank (``PREFIX-r0`` ...) and one for a bridge (``PREFIX-br``);
- one veth pair per rank: ``eth0`` in the rank's namespace, port ``p<i>`` on bridge ``br0`` in
  the bridge namespace (created there directly: nothing is added to the host's network);
- addresses ``SUBNET.<i+1>/24`` (default 10.213.0.0/24), used only inside those namespaces;
- a token bucket (``tc qdisc ... tbf``) on both ends of every link, so each rank sends and
  receives at most RATE, like a full-duplex NIC port of that speed.

Then it runs one gloo rank per namespace (``ip netns exec NS python3 cluster.py --worker ...``,
MASTER_ADDR the rank-0 address, GLOO_SOCKET_IFNAME=eth0, ``--threads`` intra-op threads) and
measures, for each rate, in the same processes, in steady state (after ``--warmup`` untimed
calls, every buffer reused):

1. allreduce of fp32 buffers of 2^k values: ``dist.all_reduce`` in place (the baseline), fn's
   1-bit ``compressed_allreduce`` with ``out=`` (errors updated in place, the mean written into a
   preallocated buffer) and the 4-bit ``loco_allreduce`` with ``donate=True``;
2. full training steps of an MLP (~25M params, synthetic data): forward, backward, gradient
   communication and optimizer, for Adam with one dense allreduce of the flat gradient, Adam
   under DDP (the two baselines), ``fn.onebit_adam`` in its compressed phase with
   ``fn.update_and_apply`` (state and gradient buffer donated, params updated in place), the
   ``fn.optim.OnebitAdam`` adapter in its compressed phase, the same step with no
   communication (the floor), and forward + backward alone (the bound: no step that computes
   the gradient is faster, so Adam's time over it is the most any optimizer's "x Adam" can be
   in that run).

Every method is timed between barriers, the methods interleaved in each repeat, and the median
of rank 0's times is printed with the speedup over the dense baseline (allreduce) or the faster
Adam row (training) and each step's ratio to the floor. A summary ends the run: every target of
issue #17 that cluster.py measures, its ratio and "met", "NOT met" or "not measured" (a rate or
size this run left out), the bound of the "x Adam" targets, with the load average before the run
and THP_MEM_ALLOC_ENABLE (set it as ``sudo THP_MEM_ALLOC_ENABLE=1 python3 ...``).

Two-level (``--nodes N --ranks-per-node L``, ``N * L`` ranks numbered ``node * L + local`` as
torchrun lays them out): each rank's ``eth0`` joins its node's bridge (in namespace
``PREFIX-n<k>``) by an unlimited veth, and each node's bridge joins the core bridge
(``PREFIX-br``) by one veth, the node's uplink, with the token bucket on both of its ends: ranks
of a node talk over fast links, nodes over RATE. The allreduce rows are then dense, the flat and
the hierarchical (``local_world_size=L``) 1-bit ``compressed_allreduce``, the hierarchical 4-bit
``loco_allreduce`` and the bound of the hierarchical ones: the hierarchical 1-bit's intra-node
part alone (its dense exchange inside the node and the all-gather of the packed result); the
training rows add ``fn.onebit_adam`` and ``fn.optim.OnebitAdam`` with ``local_world_size=L``.
Every row also gives the bytes each rank
sent across nodes in one untimed call, read by rank 0 from the uplinks' counters (``ip -n
PREFIX-n<k> -s -j link show dev uplink``), and for fn's collectives the comm's own count by
level (``bytes_sent_by_hop``); the summary gives the targets of issue #28.

All ranks share this machine's CPUs: compute that would run in parallel on a real cluster
(compression, backward) competes here, so compute-bound rows are pessimistic.

Everything it creates is removed at the end, also on errors, timeouts, Ctrl-C and SIGTERM
(deleting the namespaces removes their veths, bridge and qdiscs); ``--cleanup`` removes what a
killed run left behind (namespaces named PREFIX-*, after killing the processes inside them).
Every child has a timeout and every loop is bounded.

Run:  sudo python3 benchmarks/cluster.py [--ranks 4] [--rates 1gbit,10gbit] [--log2-sizes 20-25]
      [--threads 1]
      sudo python3 benchmarks/cluster.py --nodes 2 --ranks-per-node 2 [--rates 1gbit,10gbit]
      python3 benchmarks/cluster.py --dry-run     (print the plan; needs nothing)
      sudo python3 benchmarks/cluster.py --cleanup
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
RATE_UNIT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
PORT = 29500
MAX_TUNING_ROUNDS = 30  # untimed rounds past --warmup while a kernel tunes (it takes 9 calls)
IFNAME = "eth0"
UPLINK = "uplink"  # a node's end of its link to the core bridge (two-level)


class Interrupted(Exception):
    """Raised in the parent by SIGINT / SIGTERM / SIGHUP, so that cleanup runs."""


# ----------------------------------------------------------------------------------------------
# Plan: the commands that build and shape the cluster (pure; printed by --dry-run).


def parse_rate(rate: str) -> float | None:
    """Bits per second of a tc rate (``100mbit``, ``1gbit``, ...); ``None`` for ``unlimited``."""
    if rate == "unlimited":
        return None
    m = RATE_RE.match(rate)
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. 100mbit, 1gbit, 10gbit or unlimited")
    bits = float(m.group(1)) * RATE_UNIT[m.group(2)]
    if bits <= 0:
        raise ValueError(f"rate {rate!r} must be positive")
    return bits


def int_list(minimum: int = 1, empty: bool = False) -> Callable[[str], list[int]]:
    """An argparse ``type`` shared by the benchmark scripts: a comma-separated list of integers,
    each at least ``minimum``; ``""`` is the empty list when ``empty``, an error otherwise."""

    def parse(text: str) -> list[int]:
        words = text.split(",") if text else []
        try:
            values = [int(w) for w in words]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated integers, got {text!r}"
            ) from None
        if not values and not empty:
            raise argparse.ArgumentTypeError("expected at least one integer, got ''")
        if any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"each must be at least {minimum}, got {text!r}")
        return values

    return parse


def parse_with_quick(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, quick: dict[str, object]
) -> argparse.Namespace:
    """``parser.parse_args(argv)``; with ``--quick``, each of ``quick``'s settings stands in for
    its option's default, while an option the command line gives keeps its value (even one
    equal to the default). The scripts' one rule for ``--quick`` (the values in ``quick`` are
    what the option's ``type`` would return)."""
    args = parser.parse_args(argv)
    if args.quick:
        absent = object()  # a default no command line can give
        parser.set_defaults(**dict.fromkeys(quick, absent))
        given = parser.parse_args(argv)
        for name, value in quick.items():
            if getattr(given, name) is absent:
                setattr(args, name, value)
    return args


def parse_sizes(text: str) -> list[int]:
    """``"20-25"`` or ``"20,22,24"`` -> log2 buffer sizes."""
    if re.fullmatch(r"\d+-\d+", text):
        lo, hi = map(int, text.split("-"))
        sizes = list(range(lo, hi + 1))
    elif re.fullmatch(r"\d+(,\d+)*", text):
        sizes = [int(s) for s in text.split(",")]
    else:
        raise ValueError(f"sizes {text!r}: expected LO-HI or a comma list of log2 sizes")
    if not sizes or min(sizes) < 10 or max(sizes) > 28:
        raise ValueError(f"log2 sizes must be within 10..28, got {text!r}")
    return sizes


def namespaces(prefix: str, ranks: int) -> tuple[str, list[str]]:
    return f"{prefix}-br", [f"{prefix}-r{i}" for i in range(ranks)]


def node_namespaces(prefix: str, nodes: int) -> list[str]:
    """The namespaces of the two-level cluster's nodes, each holding its node's bridge."""
    return [f"{prefix}-n{k}" for k in range(nodes)]


def address(subnet: str, rank: int) -> str:
    return f"{subnet}.{rank + 1}"


def setup_commands(
    prefix: str, ranks: int, subnet: str, ranks_per_node: int | None = None
) -> list[list[str]]:
    """Namespaces, bridges, veth pairs, addresses; all inside the new namespaces.

    Flat (``ranks_per_node`` ``None``): every rank's ``eth0`` is a port ``p<i>`` of the bridge
    namespace's ``br0``. Two-level (``ranks_per_node=L``): rank ``i``'s ``eth0`` is a port
    ``p<i>`` of its node's ``br0`` (in ``PREFIX-n<i // L>``), and each node's bridge is joined to
    the core bridge (``PREFIX-br``) by one veth, the node's uplink: ``uplink`` in the node,
    ``n<k>`` on the core bridge. One /24 either way.
    """
    bridge, rank_ns = namespaces(prefix, ranks)
    nodes = [] if ranks_per_node is None else node_namespaces(prefix, ranks // ranks_per_node)
    cmds = [["ip", "netns", "add", ns] for ns in (bridge, *nodes, *rank_ns)]
    for ns in (bridge, *nodes):
        cmds += [
            ["ip", "-n", ns, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", ns, "link", "set", "br0", "up"],
        ]
    for k, node in enumerate(nodes):
        cmds += _veth_to_bridge(node, UPLINK, bridge, f"n{k}")
        cmds.append(["ip", "-n", node, "link", "set", UPLINK, "master", "br0"])
    for i, ns in enumerate(rank_ns):
        port_ns = bridge if ranks_per_node is None else nodes[i // ranks_per_node]
        cmds += _veth_to_bridge(ns, IFNAME, port_ns, f"p{i}")
        cmds += [
            ["ip", "-n", ns, "addr", "add", f"{address(subnet, i)}/24", "dev", IFNAME],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
    return cmds


def _veth_to_bridge(ns: str, dev: str, bridge_ns: str, port: str) -> list[list[str]]:
    """A veth pair from ``dev`` in ``ns`` to ``port`` on ``bridge_ns``'s ``br0``, both up."""
    return [
        ["ip", "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", port]
        + ["netns", bridge_ns],
        ["ip", "-n", bridge_ns, "link", "set", port, "master", "br0"],
        ["ip", "-n", bridge_ns, "link", "set", port, "up"],
        ["ip", "-n", ns, "link", "set", dev, "up"],
    ]


def shaping_commands(
    prefix: str, ranks: int, rate: str, ranks_per_node: int | None = None
) -> list[list[str]]:
    """A tbf qdisc at RATE on both ends of every rate-limited link (``unlimited``: remove them):
    every rank's link when flat, every node's uplink when two-level (``ranks_per_node``; the
    links inside a node stay unlimited).

    The bucket holds 2 ms of traffic (at least 128 KiB, so that 64 KiB GSO packets pass whole);
    packets wait at most 50 ms in the queue.
    """
    bits = parse_rate(rate)
    bridge, rank_ns = namespaces(prefix, ranks)
    if ranks_per_node is None:
        ends = [(ns, IFNAME) for ns in rank_ns] + [(bridge, f"p{i}") for i in range(ranks)]
    else:
        nodes = node_namespaces(prefix, ranks // ranks_per_node)
        ends = [(ns, UPLINK) for ns in nodes] + [(bridge, f"n{k}") for k in range(len(nodes))]
    if bits is None:
        return [["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"] for ns, dev in ends]
    burst = max(128 * 1024, int(bits / 8 * 0.002))
    return [
        ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate]
        + ["burst", str(burst), "latency", "50ms"]
        for ns, dev in ends
    ]


def worker_command(prefix: str, rank: int, config: dict, script: str = __file__) -> list[str]:
    """``script --worker CONFIG`` for one rank, run inside its namespace."""
    ns = namespaces(prefix, config["world_size"])[1][rank]
    return ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(script)] + [
        "--worker",
        json.dumps({**config, "rank": rank}),
    ]


# ----------------------------------------------------------------------------------------------
# Host side: run commands, start and watch the ranks, clean up.


def run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}")
    return proc


def existing_namespaces(prefix: str) -> list[str]:
    out = run(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{prefix}-")]


def cleanup(prefix: str) -> list[str]:
    """Kills the processes inside the PREFIX-* namespaces, then deletes the namespaces and the
    rank logs a killed run left in ``$TMPDIR/PREFIX-logs-*``.

    Deleting a namespace deletes its interfaces (veth pairs, the bridge) and their qdiscs.
    """
    removed = []
    for ns in existing_namespaces(prefix):
        pids = [int(p) for p in run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
                time.sleep(0.1)
        run(["ip", "netns", "delete", ns], check=False)
        removed.append(ns)
    for logdir in glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}-logs-*")):
        shutil.rmtree(logdir, ignore_errors=True)
    return removed


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM, then SIGKILL after 5 s, to each child's own process group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)


def run_ranks(
    prefix: str,
    config: dict,
    logdir: str,
    timeout: float,
    script: str = __file__,
    echo: bool = False,
) -> dict:
    """Starts one ``script --worker`` per namespace, waits (at most ``timeout`` s) and returns
    rank 0's results. Any failing rank stops all of them and raises with its log. ``echo``
    copies rank 0's output to stdout as it comes (progress of long runs)."""
    world = config["world_size"]
    out_path = os.path.join(logdir, f"result-{config['rate']}.json")
    config = {**config, "out": out_path}
    env = {
        **os.environ,
        "MASTER_ADDR": config["master_addr"],
        "MASTER_PORT": str(PORT),
        "GLOO_SOCKET_IFNAME": IFNAME,
        "OMP_NUM_THREADS": str(config.get("threads", 1)),  # fsdp.py and ddp.py use 1
        "PYTHONPATH": REPO,
    }
    procs, logs = [], []
    reader = None
    try:
        for rank in range(world):
            log = open(os.path.join(logdir, f"rank{rank}-{config['rate']}.log"), "w")  # noqa: SIM115
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    worker_command(prefix, rank, config, script),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
            )
        reader = open(logs[0].name) if echo else None  # noqa: SIM115
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if reader is not None:
                print(reader.read(), end="", flush=True)
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                raise RuntimeError(f"rank {failed[0]} failed:\n{_tail(logs[failed[0]].name)}")
            if all(c == 0 for c in codes):
                if reader is not None:
                    print(reader.read(), end="", flush=True)
                with open(out_path) as f:
                    return json.load(f)
            time.sleep(0.2)
        raise RuntimeError(f"ranks still running after {timeout:.0f} s:\n{_tail(logs[0].name)}")
    finally:
        stop(procs)
        for log in logs:
            log.close()
        if reader is not None:
            reader.close()


def _tail(path: str, lines: int = 30) -> str:
    with open(path) as f:
        return "".join(f.readlines()[-lines:])


def check_host(name: str = "cluster.py", hint: str = "; --dry-run shows the plan") -> None:
    """Exits with a message unless this is root and ``ip`` and ``tc`` are on PATH."""
    if os.geteuid() != 0:
        sys.exit(f"{name} needs root (network namespaces, veth, tc){hint}")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"{name} needs iproute2: {', '.join(missing)} not found on PATH")


def check_no_leftovers(prefix: str) -> None:
    leftovers = existing_namespaces(prefix)
    if leftovers:
        sys.exit(f"namespaces {' '.join(leftovers)} exist: run with --cleanup first")


@contextlib.contextmanager
def namespace_cluster(
    prefix: str, ranks: int, subnet: str, ranks_per_node: int | None = None
) -> Iterator[str]:
    """Builds the namespaces (two-level with ``ranks_per_node``, see :func:`setup_commands`) and
    yields a fresh log directory; removes both on leaving, also on errors and on SIGINT /
    SIGTERM / SIGHUP (raised inside as ``Interrupted``)."""
    check_no_leftovers(prefix)
    logdir = None
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_interrupted)
        logdir = tempfile.mkdtemp(prefix=f"{prefix}-logs-")
        layout = "" if ranks_per_node is None else f" on {ranks // ranks_per_node} nodes"
        print(
            f"building namespaces for {ranks} ranks{layout} ({prefix}-*), subnet {subnet}.0/24",
            flush=True,
        )
        for cmd in setup_commands(prefix, ranks, subnet, ranks_per_node):
            run(cmd)
        yield logdir
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        removed = cleanup(prefix)
        print(f"removed namespaces {' '.join(removed)}", flush=True)
        if logdir is not None:
            shutil.rmtree(logdir, ignore_errors=True)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)


def shape(prefix: str, ranks: int, rate: str, ranks_per_node: int | None = None) -> None:
    """Sets every rate-limited link's rate (``unlimited``: removes the limits)."""
    for cmd in shaping_commands(prefix, ranks, rate, ranks_per_node):
        run(cmd, check=parse_rate(rate) is not None)


def _raise_interrupted(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def run_on_links(
    prefix: str,
    subnet: str,
    configs: Sequence[dict],
    timeout: float,
    script: str = __file__,
    echo: bool = False,
) -> list[dict]:
    """Rank 0's results of each config, run one after the other as ``script --worker`` with
    every one of ``config["world_size"]`` ranks in its own namespace behind a link at
    ``config["rate"]`` (see :func:`run_ranks`); with ``config["ranks_per_node"]``, on the
    two-level cluster of :func:`setup_commands` with each node's uplink at that rate. On a
    failing rank or an interrupt it removes the namespaces and exits with a message (status 1
    or 130)."""
    ranks, per_node = configs[0]["world_size"], configs[0].get("ranks_per_node")
    master = {"master_addr": address(subnet, 0)}
    results = []
    try:
        with namespace_cluster(prefix, ranks, subnet, per_node) as logdir:
            for config in configs:
                shape(prefix, ranks, config["rate"], per_node)
                print(f"rate {config['rate']}: running {ranks} ranks", flush=True)
                config = {**config, **master}
                results.append(run_ranks(prefix, config, logdir, timeout, script, echo))
    except Interrupted as err:
        print(f"interrupted by {err}: cleaned up", file=sys.stderr)
        raise SystemExit(130) from None
    except RuntimeError as err:
        print(f"{os.path.basename(script)} failed: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    return results


# ----------------------------------------------------------------------------------------------
# Rank side (inside a namespace).


def tuning_anywhere() -> bool:
    """Whether a CPU kernel on some rank is still timing its settings (``fn.kernels``)."""
    import torch
    import torch.distributed as dist

    import fn.kernels

    pending = torch.tensor([float(fn.kernels.tuning_pending())])
    dist.all_reduce(pending, dist.ReduceOp.MAX)
    return bool(pending.item())


def _timed(fns: dict[str, Callable[[], None]], repeats: int, warmup: int) -> dict[str, float]:
    """Median seconds per call of each fn, timed between barriers, interleaved per repeat, after
    ``warmup`` untimed rounds and as many more (up to ``MAX_TUNING_ROUNDS``) as the kernels'
    tuning of their first large calls lasts on any rank."""
    import torch.distributed as dist

    for i in range(warmup + MAX_TUNING_ROUNDS):
        if i >= warmup and not tuning_anywhere():
            break
        for f in fns.values():
            dist.barrier()
            f()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            dist.barrier()
            start = time.perf_counter()
            f()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def uplink_tx_bytes(prefix: str, nodes: int) -> int:
    """Bytes sent so far out of every node's uplink (their sum: every byte that crossed nodes).

    Read with ``ip -n PREFIX-n<k> -s -j link show dev uplink``; a rank runs as root, so ``ip -n``
    reaches the node namespaces from inside its own.
    """
    total = 0
    for ns in node_namespaces(prefix, nodes):
        (link,) = json.loads(
            run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", UPLINK]).stdout
        )
        total += link["stats64"]["tx"]["bytes"]
    return total


def bytes_across_nodes(
    cfg: dict, fns: dict[str, Callable[[], None]], comms: dict[str, object] | None = None
) -> dict[str, dict]:
    """Per rank, what one untimed call of each fn sent across nodes, on the two-level cluster.

    Rank 0 reads the uplinks' counters (:func:`uplink_tx_bytes`) between barriers around one
    call of each fn; their difference, less that of a call that does nothing (the barriers' own
    traffic), divided by the world size, is ``"across"``. For a fn in ``comms``, ``"by_hop"`` is
    that comm's own count of the same call (``bytes_sent_by_hop``). Only rank 0's numbers are
    read (the other ranks return zeros).
    """
    import torch.distributed as dist

    nodes = cfg["world_size"] // cfg["ranks_per_node"]
    comms = comms or {}

    def measured(f: Callable[[], None]) -> int:
        dist.barrier()
        before = uplink_tx_bytes(cfg["prefix"], nodes) if cfg["rank"] == 0 else 0
        dist.barrier()
        f()
        dist.barrier()
        return (uplink_tx_bytes(cfg["prefix"], nodes) if cfg["rank"] == 0 else 0) - before

    barriers = measured(lambda: None)
    out = {}
    for name, f in fns.items():
        comm = comms.get(name)
        if comm is not None:
            comm.reset_bytes_sent()
        # at least 0: a call that sends nothing across may read a few bytes under the barriers'
        row = {"across": max(0, measured(f) - barriers) / cfg["world_size"]}
        if comm is not None:
            row["by_hop"] = comm.bytes_sent_by_hop
        out[name] = row
    return out


def bench_collectives(cfg: dict) -> list[dict]:
    """Allreduce times in steady state: every call writes into buffers made once.

    Dense: ``dist.all_reduce`` in place on a copy of ``x``. 1-bit: ``compressed_allreduce`` with
    its errors updated in place and ``y`` into a preallocated buffer (``out=``). 4-bit:
    ``loco_allreduce`` with its state donated (``donate=True``, errors updated in place) and the
    mean written into the buffer it is given (a copy of ``x``, as for dense). On the two-level
    cluster (``cfg["ranks_per_node"]``): see :func:`bench_two_level_collectives`.
    """
    if cfg.get("ranks_per_node") is not None:
        return bench_two_level_collectives(cfg)

    import torch
    import torch.distributed as dist

    from fn.collectives import (
        ProcessGroup,
        compressed_allreduce,
        init_error_feedback,
        loco_allreduce,
    )

    comm = ProcessGroup()
    rows = []
    for log2n in cfg["log2_sizes"]:
        n = 2**log2n
        x = torch.randn(n, generator=torch.Generator().manual_seed(cfg["rank"]))
        buf, y = torch.empty_like(x), torch.empty_like(x)
        worker_error, server_error = init_error_feedback(n, comm=comm)
        loco = loco_allreduce(4, 128, comm=comm)
        box = {"loco": loco.init({"x": x})}

        def dense(x=x, buf=buf):
            buf.copy_(x)
            dist.all_reduce(buf)

        def onebit(x=x, y=y, we=worker_error, se=server_error):
            compressed_allreduce(x, we, se, comm=comm, out=(y, we, se))

        def loco4(x=x, buf=buf, box=box, loco=loco):
            buf.copy_(x)
            _, box["loco"] = loco.update({"x": buf}, box["loco"], donate=True)

        comm.reset_bytes_sent()
        onebit()
        onebit_bytes = comm.reset_bytes_sent()
        loco4()
        loco_bytes = comm.reset_bytes_sent()
        times = _timed(
            {"dense": dense, "onebit": onebit, "loco4": loco4}, cfg["repeats"], cfg["warmup"]
        )
        w = cfg["world_size"]
        rows.append(
            {
                "log2n": log2n,
                **times,
                "dense_bytes": 2 * (w - 1) * 4 * n // w,
                "onebit_bytes": onebit_bytes,
                "loco4_bytes": loco_bytes,
            }
        )
        _log(cfg, f"collectives 2^{log2n}: " + ", ".join(f"{k} {v:.4f}s" for k, v in times.items()))
        del x, buf, y, worker_error, server_error, box
    return rows


def bench_two_level_collectives(cfg: dict) -> list[dict]:
    """The allreduces on the two-level cluster, ``L = cfg["ranks_per_node"]``: dense
    (``dist.all_reduce``), the flat 1-bit ``compressed_allreduce``, the hierarchical one
    (``local_world_size=L``) and the hierarchical 4-bit ``loco_allreduce``, buffers reused as
    in :func:`bench_collectives`; and the bound of the hierarchical 1-bit: its intra-node part
    alone (``"intra"``: the dense fp32 exchange of the node's reduce-scatter and the all-gather
    of the packed result, over the unlimited links), which no hierarchical call can beat.
    Each row has, per method, the bytes per rank across nodes (:func:`bytes_across_nodes`).
    """
    import torch
    import torch.distributed as dist

    from fn.collectives import (
        ProcessGroup,
        compressed_allreduce,
        init_error_feedback,
        loco_allreduce,
        padded_numel,
    )

    world, local = cfg["world_size"], cfg["ranks_per_node"]
    nodes = world // local
    comm = ProcessGroup()
    intra, _ = comm.split(local)
    rows = []
    for log2n in cfg["log2_sizes"]:
        n = 2**log2n
        x = torch.randn(n, generator=torch.Generator().manual_seed(cfg["rank"]))
        buf, y = torch.empty_like(x), torch.empty_like(x)
        flat_errors = init_error_feedback(n, comm=comm)
        hier_errors = init_error_feedback(n, comm=comm, local_world_size=local)
        loco = loco_allreduce(4, 128, comm=comm, local_world_size=local)
        box = {"loco": loco.init({"x": x})}
        shard = padded_numel(n, world, local) // local
        node_input = torch.zeros(local * shard)
        message = torch.zeros(shard // 8 + 4 * nodes, dtype=torch.uint8)

        def dense(x=x, buf=buf):
            buf.copy_(x)
            dist.all_reduce(buf)

        def onebit(x=x, y=y, errors=flat_errors):
            compressed_allreduce(x, *errors, comm=comm, out=(y, *errors))

        def onebit_hier(x=x, y=y, errors=hier_errors):
            compressed_allreduce(x, *errors, comm=comm, local_world_size=local, out=(y, *errors))

        def loco4_hier(x=x, buf=buf, box=box, loco=loco):
            buf.copy_(x)
            _, box["loco"] = loco.update({"x": buf}, box["loco"], donate=True)

        def intra_part(node_input=node_input, message=message):
            intra.all_to_all(node_input.view(local, -1)).sum(0)
            intra.all_gather(message)

        fns = {
            "dense": dense,
            "onebit": onebit,
            "onebit_hier": onebit_hier,
            "loco4_hier": loco4_hier,
            "intra": intra_part,
        }
        counted = {name: comm for name in fns if name != "dense"}
        sent = bytes_across_nodes(cfg, fns, counted)
        times = _timed(fns, cfg["repeats"], cfg["warmup"])
        rows.append({"log2n": log2n, **times, "bytes": sent})
        _log(cfg, f"collectives 2^{log2n}: " + ", ".join(f"{k} {v:.4f}s" for k, v in times.items()))
        del x, buf, y, flat_errors, hier_errors, box, node_input, message
    return rows


def build_mlp(width: int, hidden: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, width),
    )


def flat_views(model):
    """One flat param buffer and one flat grad buffer; params and ``.grad`` become views.

    ``backward`` then accumulates straight into the flat gradient (zero it before each step).
    """
    import torch

    params = list(model.parameters())
    flat_p = torch.cat([p.detach().reshape(-1) for p in params])
    flat_g = torch.zeros_like(flat_p)
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat_p[offset : offset + n].view_as(p)
        p.grad = flat_g[offset : offset + n].view_as(p)
        offset += n
    return flat_p, flat_g


def bench_training(cfg: dict) -> dict:
    """Training step times (:data:`TRAINING_ROWS`), with, on the two-level cluster, the
    hierarchical 1-bit Adam rows (:data:`HIERARCHICAL_TRAINING_ROWS`) and the bytes per rank
    across nodes of one step of each row (``"bytes"``)."""
    import torch
    import torch.distributed as dist

    import fn
    import fn.optim
    from fn.collectives import ProcessGroup

    world, rank = cfg["world_size"], cfg["rank"]
    local = cfg.get("ranks_per_node")
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(cfg["batch"], cfg["width"], generator=gen)
    y = torch.randn(cfg["batch"], cfg["width"], generator=gen)

    def loss_of(model):
        return torch.nn.functional.mse_loss(model(x), y)

    def flat_adam(average: bool) -> Callable[[], None]:
        """A step of torch.optim.Adam(foreach=True) on a flat gradient, averaged with one dense
        allreduce, or (the compute floor) without any communication: each rank alone."""
        model = build_mlp(cfg["width"], cfg["hidden"])
        _, flat_grad = flat_views(model)
        adam = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)

        def step():
            flat_grad.zero_()
            loss_of(model).backward()
            if average:
                dist.all_reduce(flat_grad)
                flat_grad.div_(world)
            adam.step()

        return step

    adam_dense, adam_local = flat_adam(average=True), flat_adam(average=False)

    # Forward and backward alone: no data-parallel step that computes the gradient is faster.
    backward_model = build_mlp(cfg["width"], cfg["hidden"])
    _, backward_grad = flat_views(backward_model)

    def backward_only():
        backward_grad.zero_()
        loss_of(backward_model).backward()

    # Adam under DDP (bucketed allreduce overlapped with backward).
    ddp_model = torch.nn.parallel.DistributedDataParallel(build_mlp(cfg["width"], cfg["hidden"]))
    ddp_opt = torch.optim.Adam(ddp_model.parameters(), lr=1e-4, foreach=True)

    def adam_ddp():
        ddp_opt.zero_grad(set_to_none=False)
        loss_of(ddp_model).backward()
        ddp_opt.step()

    def onebit_step(**hierarchical) -> tuple[Callable[[], None], ProcessGroup]:
        """fn.onebit_adam on the flat buffer (one leaf: one compressed allreduce per step)
        through fn.update_and_apply: its state and the gradient buffer donated, params updated
        in place; in its compressed phase, after one warmup step."""
        model = build_mlp(cfg["width"], cfg["hidden"])
        flat_p, flat_g = flat_views(model)
        comm = ProcessGroup()
        opt = fn.onebit_adam(lr=1e-4, freeze_step=2, comm=comm, **hierarchical)
        box = {"state": opt.init({"w": flat_p}), "t": 1}
        flat_g.zero_()
        loss_of(model).backward()
        updates, state = opt.warmup_update({"w": flat_g}, box["state"], step=1)
        with torch.no_grad():
            flat_p.copy_(fn.apply_updates({"w": flat_p}, updates)["w"])
        variance = long_warmup_variance(state.exp_avg_sq["w"])
        box["state"] = state._replace(exp_avg_sq={"w": variance})

        def step():
            box["t"] += 1
            flat_g.zero_()
            loss_of(model).backward()
            with torch.no_grad():
                _, box["state"] = fn.update_and_apply(
                    opt, {"w": flat_g}, box["state"], {"w": flat_p}, step=box["t"]
                )

        return step, comm

    def onebit_optim_step(**hierarchical) -> tuple[Callable[[], None], ProcessGroup]:
        """The torch.optim adapter (always donates; one flat leaf), with the same frozen
        variance, in its compressed phase."""
        model = build_mlp(cfg["width"], cfg["hidden"])
        comm = ProcessGroup()
        opt = fn.optim.OnebitAdam(
            model.parameters(), lr=1e-4, freeze_step=2, comm=comm, **hierarchical
        )
        loss_of(model).backward()
        opt.step()
        checkpoint = opt.state_dict()
        functional = checkpoint["state"][0]["functional"]
        functional[".exp_avg_sq"] = long_warmup_variance(functional[".exp_avg_sq"])
        opt.load_state_dict(checkpoint)

        def step():
            opt.zero_grad(set_to_none=False)
            loss_of(model).backward()
            opt.step()

        return step, comm

    onebit, onebit_comm = onebit_step()
    onebit_optim, optim_comm = onebit_optim_step()
    fns = {
        "adam_dense": adam_dense,
        "adam_ddp": adam_ddp,
        "onebit": onebit,
        "onebit_optim": onebit_optim,
    }
    comms = {"onebit": onebit_comm, "onebit_optim": optim_comm}
    if local is not None:
        fns["onebit_hier"], comms["onebit_hier"] = onebit_step(local_world_size=local)
        fns["onebit_optim_hier"], comms["onebit_optim_hier"] = onebit_optim_step(
            local_world_size=local
        )
    fns |= {"adam_local": adam_local, "backward": backward_only}
    sent = {} if local is None else {"bytes": bytes_across_nodes(cfg, fns, comms)}
    times = _timed(fns, cfg["train_repeats"], cfg["warmup"])
    _log(cfg, "training: " + ", ".join(f"{k} {v:.4f}s" for k, v in times.items()))
    params = sum(p.numel() for p in ddp_model.parameters())
    return {"params": params, **times, **sent}


def long_warmup_variance(v):
    """A frozen variance standing in for a long warmup: after one update it is (1 - b2) g^2, and
    m / sqrt(v) would blow the params up within a few steps. The step's cost does not depend on
    it."""
    import torch

    return torch.full_like(v, v.mean().item() / 1e-3)


def _log(cfg: dict, msg: str) -> None:
    if cfg["rank"] == 0:
        print(f"[{cfg['rate']}] {msg}", flush=True)


def serve_rank(config: dict, work: Callable[[], object], threads: int | None = None) -> None:
    """One rank inside its namespace (``script --worker CONFIG``): joins the gloo group of
    ``config``'s ``rank`` and ``world_size`` (``timeout`` seconds for everything), runs ``work()``
    and rank 0 writes its result as JSON to ``config["out"]``, then ends the process with
    :func:`fn.collectives.exit_distributed`. ``threads``: torch's intra-op threads (``None``: as
    set by ``OMP_NUM_THREADS``)."""
    import faulthandler

    import torch
    import torch.distributed as dist

    from fn.collectives import exit_distributed

    faulthandler.dump_traceback_later(config["timeout"], exit=True)
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        rank=config["rank"],
        world_size=config["world_size"],
        timeout=datetime.timedelta(seconds=config["timeout"]),
    )
    try:
        dist.barrier()  # gloo connects lazily: connect before the timed work starts
        result = work()
        if config["rank"] == 0:
            with open(config["out"], "w") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_distributed()  # a finished rank must not abort in gloo's teardown at interpreter exit


def worker_main(cfg: dict) -> None:
    def work() -> dict:
        result = {"rate": cfg["rate"]}
        if not cfg["skip_collectives"]:
            result["collectives"] = bench_collectives(cfg)
        if not cfg["skip_training"]:
            result["training"] = bench_training(cfg)
        return result

    serve_rank(cfg, work, cfg["threads"])


# ----------------------------------------------------------------------------------------------
# Report.


def print_results(results: list[dict], args: argparse.Namespace) -> None:
    if args.ranks_per_node is not None:
        print_two_level_results(results, args)
        return
    for res in results:
        rate = res["rate"]
        if "collectives" in res:
            print(
                f"\nallreduce of n fp32 values, {args.ranks} ranks at {rate}, median of "
                f"{args.repeats} (ms; speedup = dense time / this time; MiB sent per rank)"
            )
            print(
                f"  {'n':>5s} {'dense':>9s} {'1-bit':>9s} {'4-bit':>9s} "
                f"{'x 1-bit':>8s} {'x 4-bit':>8s}   {'MiB dense/1-bit/4-bit':>24s}"
            )
            for r in res["collectives"]:
                mib = [r[k] / 2**20 for k in ("dense_bytes", "onebit_bytes", "loco4_bytes")]
                print(
                    f"  2^{r['log2n']:<3d} {1e3 * r['dense']:9.1f} {1e3 * r['onebit']:9.1f} "
                    f"{1e3 * r['loco4']:9.1f} {r['dense'] / r['onebit']:8.2f} "
                    f"{r['dense'] / r['loco4']:8.2f}   "
                    f"{mib[0]:8.2f}/{mib[1]:6.2f}/{mib[2]:6.2f}"
                )
        if "training" in res:
            t = res["training"]
            adam, floor = adam_baseline(t), t["adam_local"]
            print(
                f"\ntraining step, MLP {args.width}-{args.hidden}-{args.hidden}-{args.width} "
                f"({t['params'] / 1e6:.1f}M params), batch {args.batch} per rank, {args.ranks} "
                f"ranks at {rate}, median of {args.train_repeats} (ms; x Adam = the faster Adam "
                "row's time / this; / floor = this / the no-communication row's)"
            )
            for key, label in TRAINING_ROWS.items():
                print(
                    f"  {label:48s} {1e3 * t[key]:9.1f}   x Adam {adam / t[key]:5.2f}   "
                    f"/ floor {t[key] / floor:5.2f}"
                )


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.2f}"


def _hops(row: dict) -> str:
    """A comm's own count of one call, MiB per level (the levels it used)."""
    hops = {k: v for k, v in row.get("by_hop", {}).items() if v}
    return "  comm: " + " ".join(f"{k} {v / 2**20:.2f}" for k, v in hops.items()) if hops else ""


COLLECTIVE_ROWS = {
    "dense": "dense dist.all_reduce",
    "onebit": "1-bit compressed_allreduce, flat",
    "onebit_hier": "1-bit compressed_allreduce, hierarchical",
    "loco4_hier": "4-bit loco_allreduce, hierarchical",
    "intra": "bound: the hierarchical 1-bit's intra-node part",
}


def print_two_level_results(results: list[dict], args: argparse.Namespace) -> None:
    """The rows of a two-level run: per rate, the allreduces and the training steps, each with
    its time, its ratio and the MiB each rank sent across nodes (measured on the uplinks; for
    fn's collectives also the comm's own count by level, MiB per rank)."""
    layout = f"{args.nodes} nodes x {args.ranks_per_node} ranks"
    for res in results:
        rate = res["rate"]
        if "collectives" in res:
            print(
                f"\nallreduce of n fp32 values, {layout}, uplinks at {rate}, links inside a node "
                f"unlimited, median of {args.repeats} (ms; x dense = dense time / this; MiB per "
                "rank across nodes)"
            )
            for r in res["collectives"]:
                print(f"  n = 2^{r['log2n']}")
                for key, label in COLLECTIVE_ROWS.items():
                    print(
                        f"    {label:48s} {1e3 * r[key]:9.1f}   x dense {r['dense'] / r[key]:6.2f}"
                        f"   across {_mib(r['bytes'][key]['across'])}{_hops(r['bytes'][key])}"
                    )
                across = r["bytes"]["onebit_hier"]["across"] / r["bytes"]["onebit"]["across"]
                print(
                    "    hierarchical 1-bit over flat 1-bit: "
                    f"{r['onebit'] / r['onebit_hier']:.2f}x faster, {across:.3f}x the bytes across "
                    "nodes"
                )
        if "training" in res:
            t = res["training"]
            print(
                f"\ntraining step, MLP {args.width}-{args.hidden}-{args.hidden}-{args.width} "
                f"({t['params'] / 1e6:.1f}M params), batch {args.batch} per rank, {layout}, "
                f"uplinks at {rate}, median of {args.train_repeats} (ms; x DDP = the DDP + Adam "
                "row's time / this; / floor = this / the no-communication row's; MiB per rank "
                "across nodes)"
            )
            for key, label in (TRAINING_ROWS | HIERARCHICAL_TRAINING_ROWS).items():
                print(
                    f"  {label:48s} {1e3 * t[key]:9.1f}   x DDP {t['adam_ddp'] / t[key]:5.2f}   "
                    f"/ floor {t[key] / t['adam_local']:5.2f}   across "
                    f"{_mib(t['bytes'][key]['across'])}{_hops(t['bytes'][key])}"
                )


TRAINING_ROWS = {
    "adam_dense": "Adam: flat dense allreduce + torch Adam",
    "adam_ddp": "Adam: DDP + torch Adam",
    "onebit": "fn.onebit_adam compressed, update_and_apply",
    "onebit_optim": "fn.optim.OnebitAdam compressed",
    "adam_local": "no communication (local Adam, the floor)",
    "backward": "forward + backward only (the bound)",
}


HIERARCHICAL_TRAINING_ROWS = {
    "onebit_hier": "fn.onebit_adam hierarchical, update_and_apply",
    "onebit_optim_hier": "fn.optim.OnebitAdam hierarchical",
}


def adam_baseline(training: dict) -> float:
    """The Adam baseline of a training result: the faster of its two Adam rows."""
    return min(training["adam_dense"], training["adam_ddp"])


class Target(NamedTuple):
    """A target of issue #17 that one cluster.py run measures."""

    text: str
    rate_bits: float
    measure: Callable[[dict], float | None]  # one rate's results -> the ratio
    at_least: float | None = None  # met when ratio >= at_least
    at_most: float | None = None  # met when ratio <= at_most
    bound: Callable[[dict], float | None] | None = None  # the best ratio any method could reach


class Status(NamedTuple):
    """A target's outcome in one run."""

    text: str
    ratio: float | None  # None: not measured in this run
    verdict: str  # "met", "NOT met" or "not measured"
    bound: float | None = None  # the target's bound in this run, where it has one


def _allreduce_speedup(log2n: int, key: str) -> Callable[[dict], float | None]:
    def measure(res: dict) -> float | None:
        rows = [r for r in res.get("collectives", ()) if r["log2n"] == log2n]
        return rows[0]["dense"] / rows[0][key] if rows else None

    return measure


def _speedup_bound(res: dict) -> float | None:
    """Adam's step over forward + backward alone: what a step that computes the gradient and
    then does no work at all would measure as its speedup over Adam in that run."""
    t = res.get("training")
    return None if t is None else adam_baseline(t) / t["backward"]


def _training_ratio(key: str, over_floor: bool) -> Callable[[dict], float | None]:
    def measure(res: dict) -> float | None:
        t = res.get("training")
        if t is None:
            return None
        return t[key] / t["adam_local"] if over_floor else adam_baseline(t) / t[key]

    return measure


TARGETS = (
    Target("1-bit allreduce >= 8x dense, 2^24, 1 Gbit/s", 1e9, _allreduce_speedup(24, "onebit"), 8),
    Target(
        "1-bit allreduce >= 1x dense, 2^24, 10 Gbit/s", 1e10, _allreduce_speedup(24, "onebit"), 1
    ),
    Target(
        "4-bit LoCo allreduce >= 4x dense, 2^24, 1 Gbit/s", 1e9, _allreduce_speedup(24, "loco4"), 4
    ),
    Target(
        "fn.onebit_adam step >= 3x Adam, 1 Gbit/s",
        1e9,
        _training_ratio("onebit", False),
        3,
        bound=_speedup_bound,
    ),
    Target(
        "fn.optim.OnebitAdam step >= 3x Adam, 1 Gbit/s",
        1e9,
        _training_ratio("onebit_optim", False),
        3,
        bound=_speedup_bound,
    ),
    Target(
        "fn.onebit_adam step <= 1.3x the floor, 1 Gbit/s",
        1e9,
        _training_ratio("onebit", True),
        at_most=1.3,
    ),
    Target(
        "fn.optim.OnebitAdam step <= 1.3x the floor, 1 Gbit/s",
        1e9,
        _training_ratio("onebit_optim", True),
        at_most=1.3,
    ),
)


def _collective_row(res: dict, log2n: int) -> dict | None:
    rows = [r for r in res.get("collectives", ()) if r["log2n"] == log2n]
    return rows[0] if rows else None


def _two_level_ratio(key: str, over: str, bound: bool = False) -> Callable[[dict], float | None]:
    """``over``'s time / ``key``'s at 2^24 on the two-level cluster (``bound``: / the intra-node
    part's instead of ``key``'s: the most a hierarchical call can reach in that run)."""

    def measure(res: dict) -> float | None:
        r = _collective_row(res, 24)
        return None if r is None else r[over] / r["intra" if bound else key]

    return measure


def _hierarchical_bytes(res: dict) -> float | None:
    r = _collective_row(res, 24)
    return (
        None if r is None else r["bytes"]["onebit_hier"]["across"] / r["bytes"]["onebit"]["across"]
    )


def _two_level_step(key: str, over_floor: bool) -> Callable[[dict], float | None]:
    def measure(res: dict) -> float | None:
        t = res.get("training")
        if t is None or t[key] is None:
            return None
        return t[key] / t["adam_local"] if over_floor else t["adam_ddp"] / t[key]

    return measure


def _ddp_bound(res: dict) -> float | None:
    """DDP + Adam's step over forward + backward alone (see :func:`_speedup_bound`)."""
    t = res.get("training")
    return None if t is None else t["adam_ddp"] / t["backward"]


def two_level_targets(ranks_per_node: int) -> tuple[Target, ...]:
    """The targets of issue #28 on the two-level cluster of ``ranks_per_node`` ranks a node."""
    targets = [
        Target(
            f"hier. 1-bit bytes across nodes <= 1/{ranks_per_node} of flat, 2^24, 1 Gbit/s",
            1e9,
            _hierarchical_bytes,
            at_most=1 / ranks_per_node,
        ),
        Target(
            "hier. 1-bit allreduce >= 1.5x flat 1-bit, 2^24, 1 Gbit/s",
            1e9,
            _two_level_ratio("onebit_hier", "onebit"),
            1.5,
            bound=_two_level_ratio("onebit_hier", "onebit", bound=True),
        ),
        Target(
            "hier. 1-bit allreduce >= 12x dense, 2^24, 1 Gbit/s",
            1e9,
            _two_level_ratio("onebit_hier", "dense"),
            12,
            bound=_two_level_ratio("onebit_hier", "dense", bound=True),
        ),
    ]
    for text, key in (
        ("fn.onebit_adam hierarchical", "onebit_hier"),
        ("fn.optim.OnebitAdam hierarchical", "onebit_optim_hier"),
    ):
        targets += [
            Target(
                f"{text} step >= 3x DDP+Adam, 1 Gbit/s",
                1e9,
                _two_level_step(key, False),
                3,
                bound=_ddp_bound,
            ),
            Target(
                f"{text} step <= 1.1x the floor, 1 Gbit/s",
                1e9,
                _two_level_step(key, True),
                at_most=1.1,
            ),
        ]
    return tuple(targets)


def target_status(results: list[dict], targets: Sequence[Target] = TARGETS) -> list[Status]:
    """Every target's :class:`Status`: its measured ratio and verdict, and its bound where it
    has one (from the same rate's results)."""
    rows = []
    for target in targets:
        res = next(
            (
                res
                for res in results
                if parse_rate(res["rate"]) == target.rate_bits and target.measure(res) is not None
            ),
            None,
        )
        if res is None:
            rows.append(Status(target.text, None, "not measured"))
            continue
        ratio = target.measure(res)
        met = (target.at_least is None or ratio >= target.at_least) and (
            target.at_most is None or ratio <= target.at_most
        )
        bound = None if target.bound is None else target.bound(res)
        rows.append(Status(target.text, ratio, "met" if met else "NOT met", bound))
    return rows


def print_summary(results: list[dict], args: argparse.Namespace, load: float) -> None:
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    if args.ranks_per_node is None:
        title, targets = f"issue #17 targets ({args.ranks} ranks", TARGETS
        bound = "a step that is forward + backward alone"
    else:
        title = f"issue #28 targets ({args.nodes} nodes x {args.ranks_per_node} ranks"
        targets = two_level_targets(args.ranks_per_node)
        bound = (
            "an allreduce that is the hierarchical 1-bit's intra-node part alone, or a step "
            "that is forward + backward alone"
        )
    print(
        f"\n{title}, {args.threads} thread(s) per rank; load average before the run "
        f"{load:.2f}; THP_MEM_ALLOC_ENABLE={thp}; bound: the ratio of {bound})"
    )
    statuses = target_status(results, targets)
    width = max(54, *(len(status.text) for status in statuses))
    for status in statuses:
        measured = "-" if status.ratio is None else f"{status.ratio:.2f}x"
        bound = "" if status.bound is None else f"   (bound {status.bound:.2f}x)"
        print(f"  {status.text:{width}s} {measured:>8s}   {status.verdict}{bound}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ranks", type=int, help="ranks = namespaces (2..16; default 4), on one flat bridge"
    )
    parser.add_argument(
        "--nodes",
        type=int,
        help="two-level cluster: this many nodes (>= 2), each with --ranks-per-node ranks on "
        "unlimited links and one uplink at the rate to the others",
    )
    parser.add_argument("--ranks-per-node", type=int, help="ranks per node (with --nodes)")
    parser.add_argument(
        "--rates", default="1gbit,10gbit", help="comma list of tc rates (e.g. 100mbit, unlimited)"
    )
    parser.add_argument("--log2-sizes", default="20-25", help="allreduce sizes 2^k: LO-HI or list")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per collective")
    parser.add_argument("--train-repeats", type=int, default=5, help="timed training steps")
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed calls before timing (the fn.optim adapter, double-buffered, needs a few "
        "steps to reach its steady state)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    parser.add_argument("--width", type=int, default=1024, help="MLP input/output width")
    parser.add_argument("--hidden", type=int, default=4096, help="MLP hidden width")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--skip-collectives", action="store_true")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--prefix", default="fnbench", help="name prefix of the namespaces")
    parser.add_argument("--subnet", default="10.213.0", help="first three octets of the /24")
    parser.add_argument("--timeout", type=float, default=420, help="seconds per rate (all ranks)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    parser.add_argument("--cleanup", action="store_true", help="remove PREFIX-* leftovers")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.rate_list = args.rates.split(",")
        for rate in args.rate_list:
            parse_rate(rate)
        args.log2_list = parse_sizes(args.log2_sizes)
    except ValueError as err:
        parser.error(str(err))
    if (args.nodes is None) != (args.ranks_per_node is None):
        parser.error("--nodes and --ranks-per-node go together")
    if args.nodes is not None:
        if args.ranks is not None:
            parser.error("--ranks: leave it out with --nodes (ranks = nodes x ranks per node)")
        if args.nodes < 2 or args.ranks_per_node < 1:
            parser.error("--nodes must be >= 2 and --ranks-per-node >= 1")
        args.ranks = args.nodes * args.ranks_per_node
    elif args.ranks is None:
        args.ranks = 4
    if not 2 <= args.ranks <= 16:
        parser.error(
            f"--ranks (or --nodes x --ranks-per-node) must be within 2..16, not {args.ranks}"
        )
    if min(args.repeats, args.train_repeats, args.threads) < 1 or args.warmup < 0:
        parser.error("--repeats, --train-repeats and --threads must be >= 1, --warmup >= 0")
    problem = naming_error(args.prefix, args.subnet)
    if problem:
        parser.error(problem)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    return args


def add_link_arguments(parser: argparse.ArgumentParser, prefix: str, subnet: str) -> None:
    """``--rate``, ``--prefix`` and ``--subnet`` of a benchmark that runs on local gloo, or with
    ``--rate`` on namespace links (:func:`run_on_links`); check them with
    :func:`check_link_arguments`."""
    parser.add_argument("--rate", help="tc rate of every rank's link (e.g. 1gbit; needs root)")
    parser.add_argument("--prefix", default=prefix, help="name prefix of the namespaces (--rate)")
    parser.add_argument("--subnet", default=subnet, help="first three octets of the /24 (--rate)")


def check_link_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits through ``parser.error`` naming a bad ``--rate``, ``--prefix`` or ``--subnet``
    (checked only with ``--rate``)."""
    if args.rate is None:
        return
    try:
        parse_rate(args.rate)
    except ValueError as err:
        parser.error(f"--rate: {err}")
    if problem := naming_error(args.prefix, args.subnet):
        parser.error(problem)


def naming_error(prefix: str, subnet: str) -> str | None:
    """What is wrong with a ``--prefix`` / ``--subnet`` pair, or ``None``."""
    if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", prefix):
        return "--prefix: 1-12 lowercase letters/digits, starting with a letter"
    octets = subnet.split(".")
    if len(octets) != 3 or not all(o.isdigit() and int(o) < 256 for o in octets):
        return "--subnet: three octets, e.g. 10.213.0"
    if not (octets[0] == "10" or octets[:2] == ["192", "168"]):
        return "--subnet must be private (10.x.y or 192.168.y)"
    return None


def worker_config(args: argparse.Namespace, rate: str) -> dict:
    return {
        "world_size": args.ranks,
        "ranks_per_node": args.ranks_per_node,
        "prefix": args.prefix,
        "rate": rate,
        "master_addr": address(args.subnet, 0),
        "log2_sizes": args.log2_list,
        "repeats": args.repeats,
        "train_repeats": args.train_repeats,
        "warmup": args.warmup,
        "threads": args.threads,
        "width": args.width,
        "hidden": args.hidden,
        "batch": args.batch,
        "skip_collectives": args.skip_collectives,
        "skip_training": args.skip_training,
        "timeout": args.timeout,
    }


def print_plan(args: argparse.Namespace) -> None:
    per_node = args.ranks_per_node
    layout = "" if per_node is None else f" ({args.nodes} nodes x {per_node} ranks)"
    print(f"# set up{layout}")
    for cmd in setup_commands(args.prefix, args.ranks, args.subnet, per_node):
        print(" ".join(cmd))
    links = "every link" if per_node is None else "every node's uplink"
    for rate in args.rate_list:
        print(
            f"# rate {rate}: shape {links}, then run one rank per namespace (timeout "
            f"{args.timeout} s)"
        )
        for cmd in shaping_commands(args.prefix, args.ranks, rate, per_node):
            print(" ".join(cmd))
        for rank in range(args.ranks):
            cmd = worker_command(args.prefix, rank, worker_config(args, rate))
            print(" ".join(cmd[:-1]), f"'{cmd[-1]}'")
        if per_node is not None:
            print("# rank 0 reads the bytes across nodes, around one call of each method:")
            for ns in node_namespaces(args.prefix, args.nodes):
                print(f"#   ip -n {ns} -s -j link show dev {UPLINK}")
    print("# clean up")
    bridge, rank_ns = namespaces(args.prefix, args.ranks)
    nodes = [] if per_node is None else node_namespaces(args.prefix, args.nodes)
    for ns in (*rank_ns, *nodes, bridge):
        print(f"ip netns delete {ns}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        sys.path.insert(0, REPO)
        worker_main(json.loads(args.worker))
        return
    if args.dry_run:
        print_plan(args)
        return
    check_host()
    if args.cleanup:
        removed = cleanup(args.prefix)
        print(f"removed {len(removed)} namespaces: {' '.join(removed) or '-'}")
        return
    check_no_leftovers(args.prefix)
    load = os.getloadavg()[0]
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{os.cpu_count()} CPUs, load average {load:.2f}, "
        f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"
    )
    configs = [worker_config(args, rate) for rate in args.rate_list]
    results = run_on_links(args.prefix, args.subnet, configs, args.timeout)
    print_results(results, args)
    print_summary(results, args, load)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": sys.argv[1:], "load": load, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
