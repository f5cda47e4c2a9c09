"""The command line of ``python -m fn`` (or ``fn-optim``).

``python -m fn demo`` trains a small character-level model on Python source from the standard
library with Adam, 1-bit Adam, 0/1 Adam, 1-bit LAMB and Adam over a LoCo 4-bit allreduce, on real
gloo worker processes (``--workers N``) or on simulated ranks in one process (``--simulate N``),
and compares held-out loss and the bytes each rank sent. See :mod:`fn.app.demo`.

``python -m fn from-deepspeed CHECKPOINT_DIR OUT`` converts a DeepSpeed checkpoint of a 1-bit
optimizer run into a file fn resumes from (:func:`fn.optim.convert_checkpoint`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fn.app import _report, demo
from fn.app._progress import make_progress
from fn.app.launch import WorkerError
from fn.errors import RecordingFile

DEFAULT_STEPS = 400
DEFAULT_WORKERS = 2
MAX_WORLD_SIZE = 64
DEFAULT_TIMEOUT = 600.0
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 7 * 24 * 3600.0  # seconds
# The batches' generators are seeded with seed * 100_003 + rank: within int64 for |seed| <= 2**40.
MAX_SEED = 2**40
EXIT_SIGTERM = 128 + 15  # what a shell reports for a process ended by SIGTERM
_FILE_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _int_at_least(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _timeout(text: str) -> float:
    value = _positive_float(text)
    if not MIN_TIMEOUT <= value <= MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"must be between {MIN_TIMEOUT:g} s and {MAX_TIMEOUT:g} s (7 days), got {text}"
        )
    return value


def _optimizers(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in demo.OPTIMIZERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown optimizer(s) {', '.join(unknown) or '(none given)'}; "
            f"choose a comma-separated subset of {','.join(demo.OPTIMIZERS)}"
        )
    return names


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fn",
        description="fn: functional, communication-compressed optimizers for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser(
        "demo",
        help="compare the compressed optimizers on a real model, data and workers",
        description=(
            "Trains a small character-level model (embedding + MLP over a 32-character window) "
            "on Python source files of the standard library, each worker on its own shard, "
            "with every optimizer in turn. The optimizers do the gradient communication "
            "themselves; the first 15% of the updates are the full-precision warmup, the rest "
            "run compressed. Prints a progress bar (stderr), then a table (stdout) of held-out "
            "loss, bytes sent per rank, wire reduction vs adam, wall time and whether all ranks "
            "ended with bit-identical params, and writes results.csv, results.json and loss.png "
            "to --out."
        ),
    )
    d.add_argument(
        "--steps",
        type=_int_at_least(10),
        default=DEFAULT_STEPS,
        help="updates per optimizer (default: %(default)s)",
    )
    mode = d.add_mutually_exclusive_group()
    mode.add_argument(
        "--workers",
        type=_int_at_least(1, MAX_WORLD_SIZE),
        metavar="N",
        help=f"real gloo worker processes on this machine (default: {DEFAULT_WORKERS})",
    )
    mode.add_argument(
        "--simulate",
        type=_int_at_least(1, MAX_WORLD_SIZE),
        metavar="N",
        help="instead of processes, N ranks simulated in this process (fn.collectives.Simulated)",
    )
    d.add_argument(
        "--ranks-per-node",
        type=_int_at_least(1),
        metavar="L",
        help="ranks per node: the compressed optimizers average densely inside each node of L "
        "consecutive ranks and compress only across nodes (local_world_size=L); must divide "
        "the number of ranks (default: flat)",
    )
    d.add_argument(
        "--optimizers",
        type=_optimizers,
        default=demo.OPTIMIZERS,
        metavar="LIST",
        help=f"comma-separated subset of {','.join(demo.OPTIMIZERS)} (default: all)",
    )
    d.add_argument(
        "--out",
        type=Path,
        default=Path("fn-demo-out"),
        metavar="DIR",
        help="where results.csv, results.json and loss.png go (default: %(default)s)",
    )
    d.add_argument(
        "--seed",
        type=_int_at_least(-MAX_SEED, MAX_SEED),
        default=0,
        help="model init and data order, from -2**40 to 2**40 (default: %(default)s)",
    )
    d.add_argument(
        "--lr",
        type=_positive_float,
        default=3e-3,
        help="learning rate of every optimizer (default: %(default)s)",
    )
    d.add_argument(
        "--timeout",
        type=_timeout,
        metavar="S",
        help="seconds the worker processes may take in all before they are killed, from "
        f"{MIN_TIMEOUT:g} to {MAX_TIMEOUT:g} (7 days); not with --simulate "
        f"(default: {DEFAULT_TIMEOUT:g})",
    )
    d.set_defaults(demo_parser=d)
    c = sub.add_parser(
        "from-deepspeed",
        help="convert a DeepSpeed checkpoint of a 1-bit optimizer run for fn",
        description=(
            "Converts a DeepSpeed 0.18.x checkpoint folder of a non-ZeRO run with OneBitAdam, "
            "ZeroOneAdam or OneBitLamb (mp_rank_00_model_states.pt: model and optimizer "
            "states) into one file that torch.load(weights_only=True) reads and "
            "fn.optim.from_deepspeed resumes from, and prints what was converted. See "
            "docs/migrating-from-deepspeed.md."
        ),
    )
    c.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT_DIR",
        help="DeepSpeed's save_dir (its 'latest' tag is used) or one tag's folder",
    )
    c.add_argument("out", type=Path, metavar="OUT", help="the file to write")
    c.add_argument(
        "--config",
        type=Path,
        metavar="JSON",
        help="the DeepSpeed config, if the checkpoint does not hold it as a dict",
    )
    c.add_argument(
        "--trust",
        action="store_true",
        help="allow arbitrary pickled objects in the checkpoint (only for trusted files)",
    )
    return parser


def _from_deepspeed(args: argparse.Namespace) -> int:
    from fn.optim import checkpoint_files, convert_checkpoint

    try:
        target = _out_file(args.out, checkpoint_files(args.checkpoint, args.config))
    except ValueError as err:
        return _failed(f"cannot write {args.out}: {err}; nothing was written")
    try:
        converted, summary = convert_checkpoint(args.checkpoint, args.config, trust=args.trust)
    except (OSError, ValueError, NotImplementedError) as err:
        return _failed(str(err))
    existed = target.exists()
    try:
        _save_whole(converted, target)
    except OSError as err:
        kept = f"{args.out} is as it was" if existed else "nothing was written"
        return _failed(f"cannot write {args.out}: {err}; {kept}")
    for line in summary:
        print(line)
    through = f" (the file its link points to: {target})" if target != args.out else ""
    print(f"wrote {args.out}{through}; resume with:")
    print(f"    ckpt = torch.load({str(args.out)!r}, weights_only=True)")
    print('    model.load_state_dict(ckpt["model"])')
    print(
        '    opt = fn.optim.from_deepspeed(model.parameters(), ckpt["config"], '
        'state_dict=ckpt["optimizer"])'
    )
    if "scheduler" in converted["config"]:
        print('    sched = fn.optim.scheduler_from_deepspeed(opt, ckpt["config"])')
    return 0


def _out_file(out: Path, inputs: list[str]) -> Path:
    """The file to write for OUT ``out``: ``out`` itself or, for a symbolic link, the file the
    link points to (the link stays).

    Raises:
        ValueError: ``out`` is a directory, exists and is not a regular file (a device, a FIFO,
            a socket), or is one of the files ``inputs`` the conversion reads (the message says
            which).
    """
    target = Path(os.path.realpath(out)) if out.is_symlink() else out
    if target.is_dir():  # also ".", "" and "/", whose Path has no name
        raise ValueError(f"it is a directory; OUT is the file to write, e.g. {out / 'fn.pt'}")
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        return target
    except OSError as err:
        raise ValueError(err.strerror or str(err)) from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "something else")
        raise ValueError(f"it is {kind}, not a regular file; it is left as it is")
    for path in inputs:
        if os.path.samefile(path, target):
            raise ValueError(f"it is a file the conversion reads ({path})")
    return target


def _save_whole(obj: Any, out: Path) -> None:
    """``torch.save(obj, out)``, whole or not at all: into ``<out>.partial`` beside it, then
    renamed to ``out``. A failed write (a full disk) raises its ``OSError`` (torch's own error
    says only ``unexpected pos ...``), with no ``.partial`` left and ``out`` as it was."""
    partial = out.with_name(f"{out.name}.partial")
    failures: list[OSError] = []
    try:
        with io.BufferedWriter(RecordingFile(partial, "wb", failures)) as file:
            torch.save(obj, file)
        os.replace(partial, out)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        if failures:
            raise failures[0] from None
        raise


def _demo(args: argparse.Namespace) -> int:
    simulate = args.simulate is not None
    cfg = demo.DemoConfig(
        steps=args.steps,
        world_size=args.simulate if simulate else (args.workers or DEFAULT_WORKERS),
        simulate=simulate,
        optimizers=args.optimizers,
        lr=args.lr,
        seed=args.seed,
        timeout=DEFAULT_TIMEOUT if args.timeout is None else args.timeout,
        ranks_per_node=args.ranks_per_node,
    )
    header = _demo_header(cfg, args.out)
    if isinstance(header, int):
        return header
    print("\n".join(header), flush=True)
    # The model is tiny: more intra-op threads only add synchronization (and, on a busy machine,
    # spinning threads that make every step many times slower).
    torch.set_num_threads(1)
    progress = make_progress(sys.stderr, len(cfg.optimizers), cfg.steps)
    if not simulate:
        print(f"starting {cfg.world_size} gloo worker processes ...", file=sys.stderr, flush=True)
    run = demo.run_simulated if simulate else demo.run_workers
    try:
        with contextlib.closing(progress), _sigterm_as_exception():
            results = run(cfg, progress.update)
    except KeyboardInterrupt:
        print("interrupted: the workers were stopped", file=sys.stderr)
        return 130
    except _Terminated:
        print("terminated (SIGTERM): the workers were stopped", file=sys.stderr)
        return EXIT_SIGTERM
    except (ValueError, WorkerError) as err:
        return _failed(f"training failed: {err}{_lr_hint(err)}")

    rows = _report.table_rows(results)
    print()
    print(_report.format_table(rows))
    print()
    for line in demo.notes(cfg, results):
        print(line)
    if not _write_outputs(args.out, cfg, header, rows, results):
        return 1
    if not all(math.isfinite(r.final_loss) for r in results):
        return _failed("a loss is not finite")
    return 0


class _Terminated(BaseException):
    """SIGTERM arrived (``timeout``, ``docker stop``, a job scheduler). A ``BaseException``, as
    ``KeyboardInterrupt`` is: it unwinds through the same ``finally`` blocks, which stop the
    workers and remove their files."""


@contextlib.contextmanager
def _sigterm_as_exception() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`_Terminated` in the main thread (its default
    action ends the process at once: the workers' temporary files and semaphores stay behind)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can set a signal handler
        return

    def terminate(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _demo_header(cfg: demo.DemoConfig, out: Path) -> list[str] | int:
    """The demo's header lines, or the exit status after an error printed: ranks that do not
    fill whole nodes (2), an ``--out`` that cannot be written or a setting ``describe``
    refuses (1). Checked before the training, so that none of it fails after."""
    if cfg.ranks_per_node is not None and cfg.world_size % cfg.ranks_per_node:
        nodes = f"--ranks-per-node {cfg.ranks_per_node} does not divide the {cfg.world_size} ranks"
        return _failed(nodes, status=2)
    try:
        _report.check_writable(out)
    except OSError as err:
        where = f" ({err.filename})" if err.filename and err.strerror else ""
        return _failed(f"cannot write to --out {out}: {err.strerror or err}{where}")
    try:
        return demo.describe(cfg)
    except RuntimeError as err:
        return _failed(str(err))


def _failed(message: str, status: int = 1) -> int:
    """Prints ``error: <message>`` to stderr; returns the exit status ``status``."""
    print(f"error: {message}", file=sys.stderr)
    return status


def _write_outputs(
    out: Path,
    cfg: demo.DemoConfig,
    header: list[str],
    rows: list[dict[str, Any]],
    results: list[demo.OptimizerResult],
) -> bool:
    """Writes the demo's results files and loss plot to ``out`` and says what it wrote; on an
    ``OSError``, prints the error and returns ``False``."""
    settings = {**cfg._asdict(), "warmup_steps": demo.warmup_steps(cfg.steps), "out": str(out)}
    meta = {"settings": settings, "description": header}
    try:
        written = _report.write_results(out, rows, results, meta)
        why_not = _report.plot_losses(
            out / _report.OUTPUTS[2], results, demo.warmup_steps(cfg.steps), demo.title(cfg)
        )
    except OSError as err:
        print(
            f"error: cannot write the results to --out {out}: {err}; the table above holds them",
            file=sys.stderr,
        )
        return False
    if why_not is None:
        written.append(out / "loss.png")
    else:
        print(f"no plot: {why_not}")
    print("wrote " + ", ".join(str(p) for p in written))
    return True


def _lr_hint(err: ValueError | WorkerError) -> str:
    """The learning-rate hint, only where a non-finite loss or gradient stopped the training
    (not where a worker died, stalled or timed out)."""
    if isinstance(err, WorkerError):
        nonfinite = not (err.died or err.timed_out) and any(
            "non-finite" in err.tracebacks.get(rank, "") for rank in err.ranks
        )
    else:
        nonfinite = "non-finite" in str(err)
    return "\n(a smaller --lr may help)" if nonfinite else ""


def main(argv: list[str] | None = None) -> int:
    """Runs the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "from-deepspeed":
        return _from_deepspeed(args)
    if args.simulate is not None and args.timeout is not None:
        # simulated ranks train in this process: there are no worker processes to time out
        args.demo_parser.error("argument --timeout: not allowed with argument --simulate")
    return _demo(args)
