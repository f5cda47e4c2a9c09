"""The demo's outputs: the results table (text, CSV, JSON) and the loss plot (PNG)."""

from __future__ import annotations

import csv
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from fn.app.demo import OptimizerResult

__all__ = [
    "OUTPUTS",
    "check_writable",
    "table_rows",
    "format_table",
    "write_results",
    "plot_losses",
]

OUTPUTS = ("results.csv", "results.json", "loss.png")  # the files written to --out

COLUMNS = (
    "optimizer",
    "heldout_loss",
    "bytes_per_rank",
    "wire_reduction_vs_adam",
    "wall_s",
    "ranks_identical",
    "max_param_diff",
)


def check_writable(out: Path) -> None:
    """Checks, before any training, that the results can be written to ``out``.

    Creates ``out`` (and its parents), writes and removes a temporary file in it, and opens each
    output file that already exists for appending (nothing is truncated), so a read-only
    directory or file, a file where the directory should be, or a directory where an output
    should be fails now, not after the training.

    Raises:
        OSError: ``out`` or one of :data:`OUTPUTS` in it cannot be written.
    """
    out.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=out).close()
    for name in OUTPUTS:
        path = out / name
        if path.exists() or path.is_symlink():
            path.open("ab").close()


def table_rows(results: list[OptimizerResult]) -> list[dict[str, Any]]:
    """One dict per optimizer with the :data:`COLUMNS`; the reduction is ``None`` without adam."""
    adam = next((r for r in results if r.name == "adam"), None)
    rows = []
    for r in results:
        measured = adam is not None and r.bytes_sent > 0
        reduction = adam.bytes_sent / r.bytes_sent if measured else None
        rows.append(
            {
                "optimizer": r.name,
                "heldout_loss": r.final_loss,
                "bytes_per_rank": r.bytes_sent,
                "wire_reduction_vs_adam": reduction,
                "wall_s": r.wall_s,
                "ranks_identical": r.identical,
                "max_param_diff": r.max_param_diff,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table."""
    header = ("optimizer", "held-out loss", "bytes/rank", "vs adam", "wall s", "ranks identical")
    lines = []
    for row in rows:
        reduction = row["wire_reduction_vs_adam"]
        lines.append(
            (
                row["optimizer"],
                f"{row['heldout_loss']:.4f}",
                f"{row['bytes_per_rank']:,}",
                "-" if reduction is None else f"{reduction:.1f}x",
                f"{row['wall_s']:.1f}",
                "yes" if row["ranks_identical"] else f"no (max |dp| {row['max_param_diff']:.1e})",
            )
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    left = {0, 5}  # text columns; numbers are right-aligned

    def fmt(cells):
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *(fmt(line) for line in lines)])


def write_results(
    out: Path, rows: list[dict[str, Any]], results: list[OptimizerResult], meta: dict[str, Any]
) -> list[Path]:
    """Writes ``results.csv`` (the table) and ``results.json`` (settings, table, loss curves,
    and the bytes each rank had sent at each held-out point).

    Returns:
        The paths written.
    """
    csv_path = out / OUTPUTS[0]
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    json_path = out / OUTPUTS[1]
    curves = {
        r.name: {
            "train_loss": r.train_loss,
            "heldout_loss": [list(p) for p in r.heldout],
            "heldout_bytes": list(r.heldout_bytes),
        }
        for r in results
    }
    json_path.write_text(json.dumps({**meta, "results": rows, "curves": curves}, indent=1) + "\n")
    return [csv_path, json_path]


def _running_mean(values: list[float], window: int = 10) -> tuple[list[int], list[float]]:
    """The mean of each ``window`` consecutive values, against the 1-based index of the last."""
    window = min(window, len(values))
    sums = [sum(values[:window])]
    for i in range(window, len(values)):
        sums.append(sums[-1] + values[i] - values[i - window])
    return list(range(window, len(values) + 1)), [x / window for x in sums]


def plot_losses(path: Path, results: list[OptimizerResult], warmup: int, title: str) -> str | None:
    """Plots the held-out loss curves (lines) over the training losses (faint, running mean over
    10 updates) to ``path``.

    matplotlib is imported here, with its Agg canvas (no display needed, no global backend set).

    Returns:
        ``None`` when written, else why not (matplotlib is not installed); a plot already at
        ``path`` (an earlier run's) is then removed, and the reason says so.

    Raises:
        OSError: the plot cannot be written, or the earlier one removed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        why = "matplotlib is not installed (pip install matplotlib)"
        if path.exists() or path.is_symlink():
            path.unlink()
            why += f"; removed {path}, an earlier run's plot"
        return why
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, r in enumerate(results):
        color = f"C{i}"
        ax.plot(*_running_mean(r.train_loss), color=color, alpha=0.3, lw=0.8)
        steps, losses = zip(*r.heldout, strict=True)
        ax.plot(steps, losses, color=color, lw=1.8, label=f"{r.name} ({r.final_loss:.3f})")
    ax.axvline(warmup + 0.5, color="gray", ls="--", lw=1)
    ax.text(
        warmup + 0.5,
        0.98,
        " compressed phase",
        transform=ax.get_xaxis_transform(),
        va="top",
        fontsize=8,
        color="gray",
    )
    finite = [x for r in results for _, x in r.heldout if math.isfinite(x)]
    if finite:
        ax.set_ylim(min(finite) - 0.1, min(max(finite), min(finite) + 2.5) + 0.1)
    ax.set_xlabel("update")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(title, fontsize=10)
    ax.legend(title="held-out loss (final)", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return None
