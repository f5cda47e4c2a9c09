"""DiLoCo against DDP + AdamW in wall-clock time: 4 workers joined by a 10 Mbit/s link with
50 ms delay, each the time it takes to reach a fixed held-out loss.

Needs root, ``ip``, ``tc`` (iproute2) and ``/dev/net/tun``. Every worker is one gloo rank in its
own network namespace (``PREFIX-r0`` ...), whose only interface ``eth0`` (``SUBNET.<i+1>/24``)
is a TUN device held by a switch process on the host side (``--switch``):

- sending: a token bucket (``tc qdisc ... tbf``) on each ``eth0`` at ``--rate``, its queue one
  round trip long (``latency`` twice ``--delay``, one bandwidth-delay product);
- the switch reads every packet a rank sends, holds it ``--delay`` (one way, so the round trip
  between two workers is twice that), then hands it to the destination's ``eth0`` at most at
  ``--rate`` (each worker also receives at most that, as through a full-duplex port);
- with ``--keep-cwnd``, ``net.ipv4.tcp_slow_start_after_idle=0`` in every namespace: Linux
  otherwise shrinks a connection's congestion window back to its initial 10 segments after an
  idle round-trip timeout, and gloo's connections idle for the H inner steps between two outer
  steps, so every outer exchange would start in slow start again.

The switch stands where ``tc ... netem delay`` would (kernels without ``sch_netem``, as this
machine's, cannot delay packets in a qdisc). Everything it creates is removed at the end, also on
errors, timeouts, Ctrl-C and SIGTERM (the TUN devices vanish with the switch, then the namespaces
are deleted); ``--cleanup`` removes what a killed run left behind.

Every run trains :mod:`benchmarks.diloco`'s model (the demo's next-character MLP, 144k params)
on its data (each worker its own shard of the standard library's source and its own generator;
held out: ``fractions.py``), from the same seed, 32 windows per worker and step, AdamW (lr 3e-3)
inside every worker, until rank 0's held-out loss is at most ``--target`` or ``--ddp-steps`` /
``--diloco-steps`` have run. The runs:

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``, a dense fp32
  allreduce of the gradients at every step; evaluated every ``--eval-every`` steps;
- ``diloco-fp32``: ``fn.diloco.DiLoCo`` around the AdamW, an outer step every ``H``
  (``--sync-every``, 30) steps, Nesterov (lr 0.7, momentum 0.9) on the dense fp32 mean;
  ``diloco-int8`` and ``diloco-onebit``: the same on ``fn.diloco.compression("int8")`` (no
  error feedback) and ``("onebit")`` (the error-compensated 1-bit allreduce);
- ``diloco-sparseloco-1/32``: SparseLoCo's rule (lr 1, beta 0.95), chunk-wise top-k of 4096 at
  density 1/32 in 2 bits with error feedback: the lowest held-out loss of the error-compensated
  compressors at H = 30 in benchmarks/README.md's quality table (``--density`` sets it);
  ``exchange="auto"`` picks its form; ``...-gather``, ``...-owners`` and ``...-owners4`` set
  it: all-gathered, reduced on owners, and on owners that keep ``server_k = 4 k`` values a
  chunk;
- ``stream-fp32-P<P>`` and ``stream-fp32-P<P>-d<tau>``: Streaming DiLoCo, ``fragments=P``
  (``--fragments``, 3) without and with ``delay=tau`` (``--delay-steps``, H / P - 1): the
  exchange of each fragment on a thread, overlapped with tau inner steps. Where ``DiLoCo``
  raises ``NotImplementedError`` for them, they are reported as not built, with its reason.

DiLoCo runs are evaluated after every H-th step (the anchor, the same on every worker; with
fragments, rank 0's parameters). The clock is rank 0's: the sum of its steps (batch, forward,
backward, optimizer step with the outer exchange it runs), the evaluations left out. Per run:
the step and time at which the target was reached, the median seconds per step, seconds per H
steps, the time ``optimizer.step()`` blocks the loop per H steps beyond its median (the outer
exchange: sum of step times less the steps times their median), the bytes rank 0's ``eth0``
sent until the target (IP packets: payload, headers, acknowledgements and gloo's own messages)
and fn's count of the outer exchange (``comm.bytes_sent``), and the ratio DDP's time / the
run's time. With a delayed streaming run beside its undelayed one, the fraction of the blocked
time the delay hid: ``1 - blocked(delay) / blocked(no delay)``. The bound row: DDP's time over
the run's steps to the target times its median step (the ratio with an exchange that costs
nothing), and the link's floor of DDP's step (the ring allreduce's bytes at ``--rate`` plus
2 (W - 1) one-way delays).

All ranks share this machine's CPUs; the DiLoCo runs are compute-bound between exchanges, so
their times are pessimistic where ranks would have their own cores.

Run:  sudo python3 benchmarks/diloco_wall.py [--runs 3] [--target 2.3] [--rate 10mbit]
      [--delay 50ms] [--sync-every 30] [--methods ddp,diloco-fp32,...] [--keep-cwnd]
      [--probe-bytes 433404,...]
      sudo python3 benchmarks/diloco_wall.py --quick      (a smoke run: high target, few steps)
      python3 benchmarks/diloco_wall.py --dry-run         (print the plan; needs nothing)
      sudo python3 benchmarks/diloco_wall.py --cleanup
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import fcntl
import heapq
import importlib.util
import json
import os
import re
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = 4  # the default of --workers
CHUNK = 4096
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
QUICK = {"target": 3.0, "ddp_steps": 20, "diloco_steps": 60, "eval_every": 5}


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cluster = _load("fn_bench_cluster", os.path.join("benchmarks", "cluster.py"))


class Method(NamedTuple):
    """One run's settings: DDP (``outer`` ``None``) or DiLoCo's outer rule and compressor."""

    name: str
    outer: str | None = None
    compression: str | None = None
    options: dict | None = None
    fragments: int = 1
    delay: int = 0


def methods(args: argparse.Namespace) -> list[Method]:
    """Every run of the plan, in order (``--methods`` picks among them)."""
    k = CHUNK // args.density
    stream = f"stream-fp32-P{args.fragments}"
    every = [
        Method("probe"),
        Method("ddp"),
        Method("diloco-fp32", "nesterov", "fp32"),
        Method("diloco-int8", "nesterov", "int8"),
        Method("diloco-onebit", "nesterov", "onebit"),
        Method(
            f"diloco-sparseloco-1/{args.density}",
            "sparseloco",
            None,
            {"k": k, "chunk_size": CHUNK},
        ),
        Method(
            f"diloco-sparseloco-1/{args.density}-gather",
            "sparseloco",
            None,
            {"k": k, "chunk_size": CHUNK, "exchange": "gather"},
        ),
        Method(
            f"diloco-sparseloco-1/{args.density}-owners",
            "sparseloco",
            None,
            {"k": k, "chunk_size": CHUNK, "exchange": "owner"},
        ),
        Method(
            f"diloco-sparseloco-1/{args.density}-owners4",
            "sparseloco",
            None,
            {"k": k, "chunk_size": CHUNK, "exchange": "owner", "server_k": 4 * k},
        ),
        Method(stream, "nesterov", "fp32", fragments=args.fragments),
        Method(
            f"{stream}-d{args.delay_steps}",
            "nesterov",
            "fp32",
            fragments=args.fragments,
            delay=args.delay_steps,
        ),
    ]
    if args.methods is None:
        return every
    chosen = [m for m in every if m.name in args.methods]
    unknown = set(args.methods) - {m.name for m in chosen}
    if unknown:
        raise ValueError(
            f"--methods: unknown {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(m.name for m in every)}"
        )
    return chosen


def not_built(method: Method, sync_every: int) -> str | None:
    """``DiLoCo``'s ``NotImplementedError`` message for ``method``'s settings, or ``None`` where
    it builds (tried on a one-rank ``Local`` group)."""
    if method.outer is None:
        return None
    import torch

    import fn.diloco

    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(method.fragments)))
    try:
        fn.diloco.DiLoCo(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            sync_every=sync_every,
            fragments=method.fragments,
            delay=method.delay,
        ).remove()
    except NotImplementedError as err:
        return str(err)
    return None


# ----------------------------------------------------------------------------------------------
# Plan (pure; printed by --dry-run).


def parse_delay(text: str) -> float:
    """Seconds of a delay such as ``50ms`` or ``0.05s``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s)", text)
    if not m:
        raise ValueError(f"delay {text!r}: expected e.g. 50ms or 0.05s")
    return float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)


def parse_byte_counts(text: str) -> list[int]:
    """``"433404,72000"`` -> ``[433404, 72000]`` (positive byte counts)."""
    if not re.fullmatch(r"\d+(,\d+)*", text) or 0 in (counts := [int(b) for b in text.split(",")]):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of positive byte counts")
    return counts


def tbf_burst(rate_bits: float, mtu: int) -> int:
    """The token bucket's burst: 2 ms of traffic, at least two packets."""
    return max(2 * mtu, int(rate_bits / 8 * 0.002))


def link_commands(args: argparse.Namespace, nodes: int = WORKERS) -> list[list[str]]:
    """What configures every node's ``eth0`` once the switch has made it (``nodes`` of them, the
    ranks by default): address, MTU, up, the sending token bucket and, with ``--keep-cwnd``, no
    slow start after idle in the node's namespace."""
    _, rank_ns = cluster.namespaces(args.prefix, nodes)
    burst = tbf_burst(cluster.parse_rate(args.rate), args.mtu)
    queue_ms = max(1, round(2000 * parse_delay(args.delay)))
    cmds = []
    for i, ns in enumerate(rank_ns):
        cmds += [
            ["ip", "-n", ns, "addr", "add", f"{cluster.address(args.subnet, i)}/24", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "mtu", str(args.mtu), "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["tc", "-n", ns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", args.rate]
            + ["burst", str(burst), "latency", f"{queue_ms}ms"],
        ]
        if args.keep_cwnd:
            cmds.append(
                ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"]
            )
    return cmds


def switch_config(args: argparse.Namespace, nodes: int = WORKERS) -> dict:
    return {
        "namespaces": cluster.namespaces(args.prefix, nodes)[1],
        "addresses": [cluster.address(args.subnet, i) for i in range(nodes)],
        "rate_bits": cluster.parse_rate(args.rate),
        "delay_s": parse_delay(args.delay),
        "parent": os.getpid(),
    }


def worker_config(args: argparse.Namespace, method: Method, run: int) -> dict:
    """One run's config for its ranks (``cluster.run_ranks`` adds rank and output path)."""
    diloco = method.outer is not None
    return {
        "world_size": args.workers,
        "rate": args.rate,
        "master_addr": cluster.address(args.subnet, 0),
        "timeout": args.timeout,
        "method": method._asdict(),
        "run": run,
        "seed": args.seed,
        "lr": args.lr,
        "batch": args.batch,
        "sync_every": args.sync_every,
        "target": args.target,
        "max_steps": args.diloco_steps if diloco else args.ddp_steps,
        "eval_every": args.sync_every if diloco else args.eval_every,
        "probe_bytes": args.probe_bytes,
    }


def print_plan(args: argparse.Namespace, plan: list[Method]) -> None:
    _, rank_ns = cluster.namespaces(args.prefix, args.workers)
    delay = parse_delay(args.delay)
    print(f"# set up: {args.workers} namespaces, one TUN eth0 each, held by the switch")
    for ns in rank_ns:
        print(f"ip netns add {ns}")
    switch = json.dumps(switch_config(args, args.workers))
    print(f"{sys.executable} {os.path.abspath(__file__)} --switch '{switch}'")
    print(
        f"#   (holds every packet {delay * 1000:g} ms one way, delivers at most {args.rate} to "
        "each eth0)"
    )
    for cmd in link_commands(args, args.workers):
        print(" ".join(cmd))
    for run in range(args.runs):
        print(f"# run {run + 1} of {args.runs} (load average noted before it)")
        for method in plan:
            config = worker_config(args, method, run)
            reason = not_built(Method(**config["method"]), args.sync_every)
            if reason is not None:
                print(f"#   {method.name}: not built ({reason})")
                continue
            print(
                f"#   {method.name}: up to {config['max_steps']} steps, evaluated every "
                f"{config['eval_every']}, target {args.target}"
            )
            for rank in range(args.workers):
                cmd = cluster.worker_command(args.prefix, rank, config, __file__)
                print(" ".join(cmd[:-1]), f"'{cmd[-1]}'")
    print("# clean up: stop the switch (its TUN devices go with it), then")
    for ns in rank_ns:
        print(f"ip netns delete {ns}")


# ----------------------------------------------------------------------------------------------
# The switch (host side, its own process): TUN devices in the namespaces, delay and rate.


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def open_tuns(namespaces: Sequence[str]) -> list[int]:
    """A TUN device ``eth0`` in each namespace (made there by entering it), its file
    descriptor non-blocking; this process returns to its own namespace."""
    home = f"/proc/{os.getpid()}/ns/net"
    home_fd = os.open(home, os.O_RDONLY)
    fds = []
    try:
        for ns in namespaces:
            _setns(f"/run/netns/{ns}")
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", b"eth0", IFF_TUN | IFF_NO_PI))
            fds.append(fd)
    finally:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns(home_fd, CLONE_NEWNET)
        os.close(home_fd)
    return fds


class Link:
    """The switch's schedule: each packet is due ``delay_s`` after it was read, then leaves for
    its destination no faster than ``rate_bits`` (a FIFO per destination)."""

    def __init__(self, rate_bits: float, delay_s: float) -> None:
        self.rate_bits, self.delay_s = rate_bits, delay_s
        self.busy_until: dict[int, float] = {}
        self.queue: list[tuple[float, int, int, bytes]] = []
        self.count = 0

    def push(self, now: float, dest: int, packet: bytes) -> None:
        start = max(now + self.delay_s, self.busy_until.get(dest, 0.0))
        done = start + len(packet) * 8 / self.rate_bits
        self.busy_until[dest] = done
        self.count += 1
        heapq.heappush(self.queue, (done, self.count, dest, packet))

    def due(self, now: float) -> Iterator[tuple[int, bytes]]:
        while self.queue and self.queue[0][0] <= now:
            _, _, dest, packet = heapq.heappop(self.queue)
            yield dest, packet

    def wait(self, now: float) -> float | None:
        return None if not self.queue else max(0.0, self.queue[0][0] - now)


def run_switch(config: dict) -> None:
    """Makes the TUN devices, says ``ready`` on stdout, then forwards IPv4 packets between them
    until SIGTERM, which it also gets when the benchmark that started it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != config["parent"]:  # it died before prctl
        return
    fds = open_tuns(config["namespaces"])
    by_address = {
        bytes(map(int, a.split("."))): fd for a, fd in zip(config["addresses"], fds, strict=True)
    }
    link = Link(config["rate_bits"], config["delay_s"])
    poll = select.epoll()
    for fd in fds:
        poll.register(fd, select.EPOLLIN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    while True:
        for fd, _ in poll.poll(link.wait(time.monotonic())):
            for _ in range(64):
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                dest = by_address.get(packet[16:20]) if packet[:1] == b"\x45" else None
                if dest is not None:
                    link.push(time.monotonic(), dest, packet)
        for dest, packet in link.due(time.monotonic()):
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(dest, packet)


@contextlib.contextmanager
def delayed_cluster(args: argparse.Namespace, nodes: int = WORKERS) -> Iterator[str]:
    """The namespaces, the switch and the shaped links of ``nodes`` nodes (the ranks by default)
    for the duration; yields a log folder. Removes everything on leaving, also on errors and on
    SIGINT / SIGTERM / SIGHUP (raised inside as ``cluster.Interrupted``)."""
    cluster.check_no_leftovers(args.prefix)
    _, rank_ns = cluster.namespaces(args.prefix, nodes)
    switch, logdir = None, None

    def interrupted(signum, frame):
        raise cluster.Interrupted(signal.Signals(signum).name)

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    try:
        for sig in signals:
            signal.signal(sig, interrupted)
        logdir = tempfile.mkdtemp(prefix=f"{args.prefix}-logs-")
        print(f"building {nodes} namespaces ({args.prefix}-*), subnet {args.subnet}.0/24")
        for ns in rank_ns:
            cluster.run(["ip", "netns", "add", ns])
        switch = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--switch"]
            + [json.dumps(switch_config(args, nodes))],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        ready, _, _ = select.select([switch.stdout], [], [], 30)
        if not ready or switch.stdout.readline().strip() != "ready":
            raise RuntimeError("the switch did not start (see its error above)")
        for cmd in link_commands(args, nodes):
            cluster.run(cmd)
        yield logdir
    finally:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        if switch is not None:
            cluster.stop([switch])
        removed = cluster.cleanup(args.prefix)
        print(f"stopped the switch, removed namespaces {' '.join(removed)}", flush=True)
        if logdir is not None:
            import shutil

            shutil.rmtree(logdir, ignore_errors=True)
        for sig in signals:
            signal.signal(sig, signal.SIG_DFL)


# ----------------------------------------------------------------------------------------------
# Rank side (inside a namespace).


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def train(config: dict) -> dict:
    """One rank's run: steps until rank 0's held-out loss reaches the target (or the step cap).

    Returns:
        Per evaluation ``[step, clock s, loss, eth0 bytes sent, fn bytes]``, and every step's
        wall time and ``optimizer.step()`` time (rank 0's are kept).
    """
    import torch
    import torch.distributed as dist

    import fn.diloco

    bench = _load("fn_bench_diloco", os.path.join("benchmarks", "diloco.py"))
    from fn.app import _data

    method = Method(**config["method"])
    if method.name == "probe":
        probed = probe(dist, sizes=config["probe_bytes"])
        return {"method": "probe", "run": config["run"], "probe": probed}
    rank = dist.get_rank()
    corpus = _data.load_corpus()
    model = bench.make_model(config["seed"])
    next_batch = bench.worker_batches(
        corpus, rank, config["seed"], config["batch"], dist.get_world_size()
    )
    heldout_x, heldout_y = bench.heldout_windows(corpus)
    trained = model
    diloco = None
    if method.outer is None:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=1e-2)
    if method.outer is not None:
        outer = {"lr": 1.0, "beta": 0.95} if method.outer == "sparseloco" else {}
        diloco = fn.diloco.DiLoCo(
            model,
            optimizer,
            sync_every=config["sync_every"],
            outer=method.outer,
            outer_options=outer,
            compression=method.compression,
            compression_options=method.options,
            fragments=method.fragments,
            delay=method.delay,
            timeout=config["timeout"],
        )
        diloco.comm.reset_bytes_sent()
    exchange = None if method.outer is None else outer_collectives(method, model, dist)
    tx0 = _tx_bytes()
    clock, evals, step_s, iter_s = 0.0, [], [], []
    flag = torch.zeros(1)
    for t in range(1, config["max_steps"] + 1):
        start = time.perf_counter()
        x, y = next_batch()
        loss = torch.nn.functional.cross_entropy(trained(x), y)
        loss.backward()
        stepping = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        clock += end - start
        step_s.append(end - stepping)
        iter_s.append(end - start)
        if t % config["eval_every"] == 0 or t == config["max_steps"]:
            with torch.no_grad():
                held = float(torch.nn.functional.cross_entropy(model(heldout_x), heldout_y))
            sent = 0 if diloco is None else diloco.comm.bytes_sent
            evals.append([t, clock, held, _tx_bytes() - tx0, sent])
            flag.fill_(float(held <= config["target"]))
            dist.broadcast(flag, 0)  # rank 0 decides (with fragments the ranks' params differ)
            if flag.item():
                break
    return {
        "method": method.name,
        "run": config["run"],
        "fragments": method.fragments,
        "delay": method.delay,
        "evals": evals,
        "step_s": step_s,
        "iter_s": iter_s,
        "params": sum(p.numel() for p in model.parameters()),
        "exchange": exchange,
    }


def outer_collectives(method: Method, model, dist) -> list[str]:
    """The collectives of one outer step, in order, as ``fn.collectives`` chooses the
    exchange's form for this model and group: one all-gather, or an all_to_all to the owners
    and an all-gather of their results (int8 and 1-bit always); fn sends each all-gather of an
    exchange as an all_to_all of the same message to every rank
    (``fn.collectives.header.gathered``), so each is an all_to_all on the link. SparseLoCo's
    form is the one its rule picks at ``init`` with the run's options (on simulated workers of
    the group's size)."""
    import fn.diloco
    from fn.collectives import Simulated, TopkOwnerState, cast_exchange_form

    params = [p.detach() for p in model.parameters()]
    options, world = method.options or {}, dist.get_world_size()
    if method.outer == "sparseloco":
        state = fn.diloco.sparseloco(comm=Simulated(world), **options).init(params)
        form = "owner" if isinstance(state[0], TopkOwnerState) else "gather"
    elif method.compression in ("int8", "onebit"):  # always to the owners, then from them
        form = "owner"
    else:
        form = cast_exchange_form(sum(p.numel() for p in params) // method.fragments, 4, world)
    return ["all_to_all"] if form == "gather" else ["all_to_all", "all_to_all"]


def probe(dist, repeats: int = 5, sizes: Sequence[int] = ()) -> dict[str, float]:
    """The median seconds of a collective of a few bytes on this link, per kind (after one
    untimed call each): what one collective costs in delays alone. For each of ``sizes``, also
    an all_to_all in which every rank sends that many bytes (fp32, split evenly over the other
    ranks), alone (``"all_to_all N B"``) and twice back to back (``"2 x all_to_all N B"``): what
    gloo itself takes for an outer step's transfers on this link."""
    import torch

    world = dist.get_world_size()

    def all_to_all(values_per_rank: int) -> None:
        dist.all_to_all_single(
            torch.empty(world * values_per_rank), torch.ones(world * values_per_rank)
        )  # fmt: skip

    calls = {
        "all_gather": lambda: dist.all_gather_single(torch.empty(world * 25), torch.ones(25)),
        "all_to_all": lambda: all_to_all(25),
        "all_reduce": lambda: dist.all_reduce(torch.ones(1)),
    }
    for size in sizes:
        per_rank = max(1, size // 4 // max(1, world - 1))
        calls[f"all_to_all {size} B"] = lambda n=per_rank: all_to_all(n)
        calls[f"2 x all_to_all {size} B"] = lambda n=per_rank: (all_to_all(n), all_to_all(n))
    out = {}
    for kind, call in calls.items():
        call()
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out[kind] = statistics.median(times)
    return out


# ----------------------------------------------------------------------------------------------
# Summary (pure).


def summarize(result: dict, target: float, sync_every: int) -> dict:
    """One run's figures from rank 0's record: when it reached ``target`` (``None`` where it did
    not), its step times, the exchange's blocked time per ``sync_every`` steps, its bytes."""
    evals = result["evals"]
    hit = next((e for e in evals if e[2] <= target), None)
    steps = len(result["iter_s"])
    step_med = statistics.median(result["step_s"])
    return {
        "method": result["method"],
        "run": result["run"],
        "fragments": result.get("fragments", 1),
        "delay": result.get("delay", 0),
        "reached": hit is not None,
        "steps": hit[0] if hit else steps,
        "time_s": hit[1] if hit else evals[-1][1],
        "loss": hit[2] if hit else evals[-1][2],
        "wire_bytes": hit[3] if hit else evals[-1][3],
        "fn_bytes": hit[4] if hit else evals[-1][4],
        "s_per_step": statistics.median(result["iter_s"]),
        "s_per_outer": sum(result["iter_s"]) / steps * sync_every,
        "blocked_per_outer": (sum(result["step_s"]) - steps * step_med) / steps * sync_every,
        "compute_s": (hit[0] if hit else steps) * statistics.median(result["iter_s"]),
        "exchange": result.get("exchange"),
        "outer_bytes": (hit[4] if hit else evals[-1][4])
        / max(1, (hit[0] if hit else steps) // sync_every),  # fmt: skip
    }


def outer_model(row: dict, rate_bits: float, latency: dict[str, float]) -> float:
    """The link's time for one outer step: the probed time of each of its collectives (their
    delays) and its bytes (each worker's, sent while it receives as much) at ``rate_bits``."""
    return sum(latency[kind] for kind in row["exchange"]) + row["outer_bytes"] * 8 / rate_bits


def model_lines(rows: list[dict], probes: list[dict], rate_bits: float) -> list[str]:
    """A line per DiLoCo run without fragments: its blocked time per outer step against
    :func:`outer_model` (with the probe of the same repeat), and whether it is within 10%."""
    out = []
    for row in rows:
        latency = next((p["probe"] for p in probes if p["run"] == row["run"]), None)
        if latency is None or row["exchange"] is None or row["fragments"] > 1:
            continue
        model = outer_model(row, rate_bits, latency)
        within = abs(row["blocked_per_outer"] / model - 1) <= 0.10
        out.append(
            f"run {row['run'] + 1} {row['method']}: blocked {row['blocked_per_outer']:.3f} s per "
            f"outer step; link model {model:.3f} s ({' + '.join(row['exchange'])} + "
            f"{row['outer_bytes'] / 1e3:.1f} KB): {row['blocked_per_outer'] / model:.2f}x, "
            f"{'within' if within else 'not within'} 10%"
        )
    return out


def ddp_floor(params: int, rate_bits: float, delay_s: float, world: int = WORKERS) -> float:
    """The link's floor of one DDP step: a ring allreduce's 2 (W - 1) / W * 4 * params bytes at
    ``rate_bits``, plus its 2 (W - 1) sequential one-way delays."""
    return 2 * (world - 1) / world * 4 * params * 8 / rate_bits + 2 * (world - 1) * delay_s


def hidden_fraction(delayed: dict, undelayed: dict) -> float | None:
    """The share of the undelayed run's blocked time that the delay hid (``None`` where the
    undelayed run was not blocked)."""
    if undelayed["blocked_per_outer"] <= 0:
        return None
    return 1 - delayed["blocked_per_outer"] / undelayed["blocked_per_outer"]


def table(rows: list[dict], skipped: dict[str, str]) -> str:
    """The markdown table: every run, its ratio to the same repeat's DDP, the bound."""
    lines = [
        "| run | method | reached | steps | time to target s | s / step (median) "
        "| s / H steps | blocked / H steps s | wire MB / worker | fn MB / worker "
        "| DDP time / time | bound (DDP time / compute) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ddp = next((r for r in rows if r["method"] == "ddp" and r["run"] == row["run"]), None)
        ratio = bound = "-"
        if ddp is not None and row["method"] != "ddp":
            ratio = f"{ddp['time_s'] / row['time_s']:.1f}x"
            bound = f"{ddp['time_s'] / row['compute_s']:.1f}x"
        outer = row["method"] != "ddp"
        lines.append(
            f"| {row['run'] + 1} | {row['method']} | {'yes' if row['reached'] else 'NO'} "
            f"| {row['steps']} | {row['time_s']:.1f} | {row['s_per_step']:.4f} | "
            + (f"{row['s_per_outer']:.2f} | {row['blocked_per_outer']:.3f}" if outer else "- | -")
            + f" | {row['wire_bytes'] / 1e6:.3f} | "
            + (f"{row['fn_bytes'] / 1e6:.3f}" if outer else "-")
            + f" | {ratio} | {bound} |"
        )
    for name, reason in skipped.items():
        lines.append(f"| - | {name} | not built: {reason} |" + " |" * 9)
    return "\n".join(lines)


def hideable(delayed: dict, undelayed: dict) -> float:
    """The most of the exchange a delay can hide: its ``delay`` inner steps (at the delayed
    run's median step) against one fragment's blocked time without the delay, at most 1."""
    per_fragment = undelayed["blocked_per_outer"] / undelayed["fragments"]
    return min(1.0, delayed["delay"] * delayed["s_per_step"] / per_fragment)


def streaming_lines(rows: list[dict]) -> list[str]:
    """A line per delayed streaming run with its undelayed run of the same repeat: the blocked
    time per H steps of each, the fraction the delay hid, and the most it could
    (:func:`hideable`)."""
    out = []
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if r["run"] == row["run"]
                and r["fragments"] == row["fragments"] > 1
                and r["delay"] == 0 < row["delay"]
            ),
            None,
        )
        if base:
            hidden = hidden_fraction(row, base)
            text = "-" if hidden is None else f"{100 * hidden:.0f}%"
            out.append(
                f"run {row['run'] + 1} {row['method']}: blocked {row['blocked_per_outer']:.3f} s "
                f"per H steps, {base['blocked_per_outer']:.3f} s without the delay: {text} hidden "
                f"(bound {100 * hideable(row, base):.0f}%: {row['delay']} steps of "
                f"{row['s_per_step']:.4f} s against "
                f"{base['blocked_per_outer'] / base['fragments']:.3f} s per fragment)"
            )
    return out


# ----------------------------------------------------------------------------------------------


def add_run_arguments(p: argparse.ArgumentParser, prefix: str, subnet: str) -> None:
    """The options this script and ``diloco_elastic.py`` share: the links, the task, the runs,
    the namespaces' names and the modes (``--dry-run``, ``--cleanup``)."""
    p.add_argument("--rate", default="10mbit", help="tc rate of every node's link")
    p.add_argument("--delay", default="50ms", help="one-way delay between two nodes")
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument(
        "--keep-cwnd",
        action="store_true",
        help="net.ipv4.tcp_slow_start_after_idle=0 in every namespace",
    )
    p.add_argument(
        "--probe-bytes",
        type=parse_byte_counts,
        default=[],
        help="the probe also times an all_to_all of each of these bytes per rank, alone and "
        "twice back to back (comma list, e.g. 433404: dense fp32's per collective here)",
    )
    p.add_argument("--target", type=float, default=2.3, help="held-out loss to reach (nats)")
    p.add_argument("--sync-every", type=int, default=30, help="H, inner steps per outer step")
    p.add_argument("--density", type=int, default=32, help="SparseLoCo's top-k density 1/D")
    p.add_argument("--runs", type=int, default=1, help="repeats of every method")
    p.add_argument("--methods", help="comma list of run names (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's lr (DDP and inner)")
    p.add_argument("--batch", type=int, default=32, help="windows per worker per step")
    p.add_argument("--prefix", default=prefix, help="name prefix of the namespaces")
    p.add_argument("--subnet", default=subnet, help="first three octets of the /24")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run (all ranks)")
    p.add_argument("--json", help="also write every run's record here")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--cleanup", action="store_true", help="remove PREFIX-* leftovers")
    p.add_argument("--worker", help=argparse.SUPPRESS)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_run_arguments(p, "fnwall", "10.216.0")
    p.add_argument("--workers", type=int, default=WORKERS, help="gloo ranks, one per namespace")
    p.add_argument("--fragments", type=int, default=3, help="P of the streaming runs")
    p.add_argument("--delay-steps", type=int, help="tau of the delayed streaming run (H/P - 1)")
    p.add_argument("--ddp-steps", type=int, default=300, help="DDP's step cap")
    p.add_argument("--diloco-steps", type=int, default=900, help="DiLoCo's step cap")
    p.add_argument("--eval-every", type=int, default=10, help="DDP's steps between evaluations")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: target 3.0, 60 / 20 steps (where not given)",
    )
    p.add_argument("--switch", help=argparse.SUPPRESS)
    args = cluster.parse_with_quick(p, argv, QUICK)
    if args.delay_steps is None:
        args.delay_steps = max(0, args.sync_every // args.fragments - 1)
    if args.methods is not None:
        args.methods = args.methods.split(",")
    try:
        cluster.parse_rate(args.rate)
        parse_delay(args.delay)
        methods(args)
    except ValueError as err:
        p.error(str(err))
    if problem := cluster.naming_error(args.prefix, args.subnet):
        p.error(problem)
    if args.workers < 2:
        p.error("--workers must be >= 2")
    if min(args.sync_every, args.fragments, args.runs, args.eval_every, args.density) < 1:
        p.error("--sync-every, --fragments, --runs, --eval-every and --density must be >= 1")
    if args.diloco_steps % args.sync_every:
        p.error(f"--diloco-steps {args.diloco_steps} is not a multiple of --sync-every")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        config = json.loads(args.worker)
        sys.path.insert(0, REPO)
        cluster.serve_rank(config, lambda: train(config), threads=1)
        return
    if args.switch is not None:
        run_switch(json.loads(args.switch))
        return
    sys.path.insert(0, REPO)
    plan = methods(args)
    if args.dry_run:
        print_plan(args, plan)
        return
    cluster.check_host("benchmarks/diloco_wall.py")
    if args.cleanup:
        removed = cluster.cleanup(args.prefix)
        print(f"removed {len(removed)} namespaces: {' '.join(removed) or '-'}")
        return
    skipped = {m.name: r for m in plan if (r := not_built(m, args.sync_every)) is not None}
    built = [m for m in plan if m.name not in skipped]
    results = []

    def repeat(run: int, logdir: str) -> None:
        for method in built:
            started = time.monotonic()
            config = worker_config(args, method, run)
            result = cluster.run_ranks(args.prefix, config, logdir, args.timeout, __file__)
            results.append(result)
            if method.name == "probe":
                print(f"  probe: {result['probe']}", flush=True)
                continue
            row = summarize(result, args.target, args.sync_every)
            print(
                f"  {method.name}: {'reached' if row['reached'] else 'NOT reached'} "
                f"{row['loss']:.4f} at step {row['steps']}, {row['time_s']:.1f} s "
                f"({time.monotonic() - started:.0f} s with start and evaluations)",
                flush=True,
            )

    loads = run_repeats(args, "diloco_wall.py", args.workers, repeat)
    report(results, skipped, args, loads)


def run_repeats(
    args: argparse.Namespace, script: str, nodes: int, repeat: Callable[[int, str], None]
) -> list[tuple[float, float, float]]:
    """Prints the start line, builds the cluster of ``nodes`` nodes and calls ``repeat(run,
    logdir)`` for each of ``--runs`` repeats, the load average printed before each; removes
    everything at the end. Exits with status 130 where interrupted, 1 where a run failed.

    Returns:
        The load averages (1, 5, 15 min) taken before each repeat.
    """
    print(
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} "
        f"CPUs; {getattr(args, 'workers', WORKERS)} workers at {args.rate}, {args.delay} one "
        f"way; target {args.target}",
        flush=True,
    )
    loads = []
    try:
        with delayed_cluster(args, nodes) as logdir:
            for run in range(args.runs):
                loads.append(os.getloadavg())
                print(f"run {run + 1}: load average {' '.join(f'{x:.2f}' for x in loads[-1])}")
                repeat(run, logdir)
    except cluster.Interrupted as err:
        print(f"interrupted by {err}: cleaned up", file=sys.stderr)
        raise SystemExit(130) from None
    except RuntimeError as err:
        print(f"{script} failed: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    return loads


def save_runs(args: argparse.Namespace, loads: list, results: list[dict]) -> None:
    """Prints the load averages before each repeat and, with ``--json``, writes every run's
    record there."""
    print(
        "load average (1, 5, 15 min) before each run:",
        "; ".join(" ".join(f"{x:.2f}" for x in load) for load in loads),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "loads": loads, "results": results}, f)


def unbuilt_streaming_bound(rows: list[dict], args: argparse.Namespace) -> list[str]:
    """Where no streaming pair ran, a line per dense DiLoCo run: the most a delay of
    ``--delay-steps`` could hide with ``--fragments`` fragments, taking a fragment's exchange as
    ``1 / P`` of the whole model's blocked time (its round trips do not shrink, so the true
    share is smaller)."""
    out = []
    for row in rows:
        if row["method"] == "diloco-fp32":
            as_if = {**row, "fragments": args.fragments, "delay": args.delay_steps}
            out.append(
                f"run {row['run'] + 1}, bound of stream-fp32-P{args.fragments}-"
                f"d{args.delay_steps} from diloco-fp32: "
                f"{100 * hideable(as_if, as_if):.0f}% of the exchange at most can hide "
                f"({args.delay_steps} steps of {row['s_per_step']:.4f} s against "
                f"{row['blocked_per_outer'] / args.fragments:.3f} s per fragment)"
            )
    return out


def report(results: list[dict], skipped: dict[str, str], args, loads) -> None:
    probes = [r for r in results if r["method"] == "probe"]
    results = [r for r in results if r["method"] != "probe"]
    rows = [summarize(r, args.target, args.sync_every) for r in results]
    print()
    print(table(rows, skipped))
    for line in streaming_lines(rows) or unbuilt_streaming_bound(rows, args):
        print(line)
    for p in probes:
        print(
            f"run {p['run'] + 1}, gloo's collectives on this link (a few bytes where no size): "
            + ", ".join(f"{kind} {s:.3f} s" for kind, s in p["probe"].items())
        )
    for line in model_lines(rows, probes, cluster.parse_rate(args.rate)):
        print(line)
    if results:
        floor = ddp_floor(
            results[0]["params"], cluster.parse_rate(args.rate), parse_delay(args.delay),
            args.workers,
        )  # fmt: skip
        print(
            f"DDP's floor per step from the link: {floor:.3f} s ({results[0]['params']:,} params)"
        )
    save_runs(args, loads, results)


if __name__ == "__main__":
    main()
