"""Bytes per worker per outer step of SparseLoCo's top-k exchange, sent and received, against a
dense fp32 ring allreduce, as the number of workers grows: simulated workers, fn's own counters
(``bytes_sent``, ``bytes_received``) and a count of the collectives each outer step runs. No
timing.

One ``fn.diloco.outer_step`` of ``fn.diloco.sparseloco`` on ``Simulated(W)`` over one vector of
``--numel`` values (chunks of ``--chunk``, ``k = chunk * density``), for each ``W`` of
``--workers`` and each density of ``--densities``:

- ``dense fp32 ring``: one ``comm.all_reduce`` of the fp32 vector (a ring allreduce's bytes);
- ``all-gather, before``: the all-gather exchange as it ran before the headers: the outer step's
  agreement (an all-gather of each worker's flag), the size record, then every worker's message
  (the rule given to ``outer_step`` as a plain ``GradientTransformation``, which takes that
  path);
- ``all-gather``: ``exchange="gather"``, its agreement and sizes in the message's header;
- ``owners``: ``exchange="owner"``, each worker reducing ``1 / W`` of the chunks;
- ``owners, server_k = M k``: the same, the owners keeping ``M`` times ``k`` values per chunk
  in their second compression, for each ``M`` of ``--server`` (more bytes from the owners, less
  lost in their compression: docs/guides/diloco.md, "Owners that keep more").

Columns: the bytes each worker sends and receives (the same, for these collectives), the
collectives of one outer step, and the dense ring's bytes (sent + received) over the method's.

Run:  python3 benchmarks/diloco_bytes.py [--numel 1048576] [--chunk 4096]
      [--densities 32,128] [--workers 4,16,64] [--server 4]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fn.diloco  # noqa: E402
from fn.app.examples import positive_int  # noqa: E402
from fn.base import GradientTransformation  # noqa: E402
from fn.collectives import Simulated, replicate, simulate  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import int_list  # noqa: E402


class Counting(Simulated):
    """``Simulated`` that also counts the collectives it runs."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self.calls = 0

    def _call(self, kind, x, *options):
        self.calls += 1
        return super()._call(kind, x, *options)


def measure(comm: Counting, run) -> tuple[int, int, int]:
    """``run()``'s bytes sent and received per worker and its collectives."""
    comm.reset_bytes_sent()
    comm.reset_bytes_received()
    comm.calls = 0
    run()
    return comm.bytes_sent, comm.bytes_received, comm.calls


def rows(world_size: int, numel: int, chunk: int, density: int, server: tuple = ()) -> dict:
    comm = Counting(world_size)
    g = torch.Generator().manual_seed(0)
    anchor = replicate({"w": torch.zeros(numel)}, comm)
    params = {"w": torch.randn(world_size, numel, generator=g)}
    out = {
        "dense fp32 ring": measure(
            comm, lambda: simulate(lambda x: comm.all_reduce(x), comm)(params["w"])
        )
    }
    k = chunk // density
    forms = [
        ("all-gather, before", "gather", True, None),
        ("all-gather", "gather", False, None),
        ("owners", "owner", False, None),
    ]
    forms += [(f"owners, server_k = {m} k", "owner", False, min(chunk, m * k)) for m in server]
    for name, exchange, plain, server_k in forms:
        outer = fn.diloco.sparseloco(
            k=k, chunk_size=chunk, comm=comm, exchange=exchange, server_k=server_k
        )
        if plain:  # no exchange with a header: the outer step agrees and sizes on its own
            outer = GradientTransformation(outer.init, outer.update)
        state = simulate(outer.init, comm)(anchor)
        step = simulate(functools.partial(fn.diloco.outer_step, outer, comm=comm), comm)
        out[name] = measure(comm, lambda step=step, state=state: step(anchor, params, state))
        del state, step
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--numel", type=positive_int, default=2**20)
    p.add_argument("--chunk", type=positive_int, default=4096, help="a power of two, 2..2^16")
    p.add_argument(
        "--densities", type=int_list(), default="32,128", help="1/d of the values kept, d per entry"
    )
    p.add_argument("--workers", type=int_list(), default="4,16,64")
    p.add_argument(
        "--server",
        type=int_list(empty=True),
        default="4",
        help="M of the owners keeping M k values (or '')",
    )
    args = p.parse_args(argv)
    if not 2 <= args.chunk <= 2**16 or args.chunk & (args.chunk - 1):
        p.error(f"--chunk must be a power of two from 2 to 2^16, got {args.chunk}")
    if max(args.densities) > args.chunk:
        p.error(f"--densities must be at most --chunk ({args.chunk}), got {max(args.densities)}")
    server = tuple(args.server)
    torch.set_num_threads(1)
    print(f"{args.numel} fp32 values, chunks of {args.chunk}; bytes per worker per outer step")
    print(
        "| density | W | method | sent | received | collectives | dense / this (sent + received) |"
    )
    print("|---|---|---|---|---|---|---|")
    owners = {}
    for density in args.densities:
        for w in args.workers:
            result = rows(w, args.numel, args.chunk, density, server)
            dense = sum(result["dense fp32 ring"][:2])
            for name, (sent, received, calls) in result.items():
                print(
                    f"| 1/{density} | {w} | {name} | {sent:,} | {received:,} | {calls} | "
                    f"{dense / (sent + received):.1f}x |"
                )
            owners[density, w] = sum(result["owners"][:2])
    for density in sorted({d for d, _ in owners}):
        ws = sorted(w for d, w in owners if d == density)
        first, last = owners[density, ws[0]], owners[density, ws[-1]]
        print(
            f"owners at 1/{density}: W = {ws[-1]} moves {last / first:.2f}x the bytes of "
            f"W = {ws[0]}"
        )


if __name__ == "__main__":
    main()
