"""Held-out loss against the bytes each rank sent: the figure on the documentation's front page.

Runs ``python3 -m fn demo`` with its default settings (2 gloo worker processes on the CPU, the
next-character model on the standard library's source, ``adam`` with a dense fp32 allreduce
against ``onebit_adam``, ``zero_one_adam``, ``onebit_lamb`` and ``loco_adam``), then plots each
optimizer's held-out loss against the bytes one rank had sent by then (``comm.bytes_sent``, the
largest over the ranks), read from the demo's ``results.json``. ``--results`` plots an earlier
run's ``results.json`` instead of running the demo. The demo's table is printed, so the figure's
numbers can be checked against it.

Run: python3 benchmarks/loss_vs_bytes.py [--results fn-demo-out/results.json]
     [--out docs/_static/loss-vs-bytes.png]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MB = 1e6


def run_demo(out: Path) -> Path:
    """Runs the demo with its defaults, writing to ``out``; returns its ``results.json``."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    subprocess.run([sys.executable, "-m", "fn", "demo", "--out", str(out)], check=True, env=env)
    return out / "results.json"


def plot(results: dict[str, Any], path: Path) -> None:
    """Draws the held-out loss of each optimizer against the bytes sent per rank to ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.6, 3.2), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    rows = {row["optimizer"]: row for row in results["results"]}
    losses = []
    for i, (name, curve) in enumerate(results["curves"].items()):
        sent = [b / MB for b in curve["heldout_bytes"]]
        loss = [x for _, x in curve["heldout_loss"]]
        losses += [x for x in loss if math.isfinite(x)]
        label = f"{name}: {rows[name]['heldout_loss']:.3f}, {sent[-1]:.0f} MB"
        ax.plot(sent, loss, color=f"C{i}", lw=1.8, label=label)
        ax.plot(sent[-1:], loss[-1:], "o", color=f"C{i}", ms=4)
    if losses:
        ax.set_ylim(min(losses) - 0.05, min(max(losses), min(losses) + 1.2))
    ax.set_xlim(left=0)
    settings = results["settings"]
    ax.set_xlabel("MB sent per rank")
    ax.set_ylabel("held-out loss (nats/char)")
    ax.set_title(
        f"python3 -m fn demo: {settings['world_size']} gloo ranks on a CPU, "
        f"{settings['steps']} updates",
        fontsize=10,
    )
    ax.legend(title="held-out loss at the end, MB sent", fontsize=9, title_fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, help="a demo's results.json (default: run it)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "_static" / "loss-vs-bytes.png")
    args = parser.parse_args(argv)
    if args.results is not None and not args.results.is_file():
        parser.error(f"--results: no such file: {args.results}")
    with tempfile.TemporaryDirectory() as tmp:
        source = args.results or run_demo(Path(tmp))
        results = json.loads(source.read_text())
    plot(results, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
