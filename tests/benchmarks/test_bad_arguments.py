"""The benchmark scripts refuse bad arguments with an argparse error (exit 2), not a traceback:
each parser runs in this process, before any work starts."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")

_MODULES: dict[str, object] = {}


@contextlib.contextmanager
def _as_a_script():
    """The scripts' folder first on the path, as when a script runs (it imports cluster.py),
    and the path as it was afterwards: left there, ``benchmarks/torchtitan.py`` would pass for
    torchtitan in every later test of this process."""
    saved = list(sys.path)
    sys.path.insert(0, BENCH)
    try:
        yield
    finally:
        sys.path[:] = saved


def _load(name):
    if name not in _MODULES:
        path = os.path.join(BENCH, f"{name}.py")
        spec = importlib.util.spec_from_file_location(f"_bench_args_{name}", path)
        module = importlib.util.module_from_spec(spec)
        with _as_a_script():
            spec.loader.exec_module(module)
        _MODULES[name] = module
    return _MODULES[name]


CASES = [
    ("diloco_bytes", "main", ["--densities", "0"], "--densities: each must be at least 1"),
    ("diloco_bytes", "main", ["--densities", "abc"], "--densities: expected comma-separated"),
    ("diloco_bytes", "main", ["--workers", "0"], "--workers: each must be at least 1"),
    ("diloco_bytes", "main", ["--chunk", "0"], "--chunk: must be a positive integer"),
    ("diloco_bytes", "main", ["--chunk", "100"], "--chunk must be a power of two"),
    ("diloco_bytes", "main", ["--densities", "8192"], "--densities must be at most --chunk"),
    ("diloco", "parse_args", ["--sync-every", "0"], "--sync-every: each must be at least 1"),
    ("diloco", "parse_args", ["--seeds", "x"], "--seeds: expected comma-separated"),
    (
        "diloco",
        "parse_args",
        ["--steps", "31", "--quick"],
        "--steps 31 is not a multiple of --sync-every [15]",
    ),
    ("freeze", "main", ["--seeds", "x", "--quick"], "--seeds: expected comma-separated"),
    ("freeze", "main", ["--mlp-steps", "0"], "--mlp-steps: must be a positive integer"),
    ("diloco", "parse_args", ["--steps", "31"], "--steps 31 is not a multiple"),
    ("kernels", "main", ["--repeat", "0"], "--repeat: must be a positive integer"),
    ("kernels", "main", ["--sizes", "-3"], "--sizes must be log2 counts within 3..40"),
    ("kernels", "main", ["--sizes", "4"], "--group-size 2048 must divide"),
    ("collectives", "main", ["--repeats", "0"], "--repeats: must be a positive integer"),
    ("collectives", "main", ["--log2n", "-1"], "--log2n must be within 0..34"),
    ("optim", "main", ["--repeats", "0"], "--repeats: must be a positive integer"),
    ("diloco_blocking", "parse_args", ["--rounds", "0"], "--rounds: must be a positive integer"),
    ("diloco_blocking", "parse_args", ["--delays", "x"], "--delays: expected comma-separated"),
    ("diloco_blocking", "parse_args", ["--delays", "4"], "--delays must be below"),
    ("clipping", "main", ["--seeds", "x"], "--seeds: expected comma-separated"),
    ("clipping", "main", ["--steps", "0"], "--steps: must be a positive integer"),
    ("loss_vs_bytes", "main", ["--results", "/nonexistent.json"], "no such file: /nonexistent"),
]


@pytest.mark.parametrize(
    "script, entry, argv, message", CASES, ids=[f"{c[0]} {' '.join(c[2])}" for c in CASES]
)
def test_bad_argument_is_a_parser_error(script, entry, argv, message, capsys):
    with pytest.raises(SystemExit) as stop, _as_a_script():
        getattr(_load(script), entry)(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err, err
    assert message in err, err


def test_diloco_quick_and_defaults_still_parse():
    diloco = _load("diloco")
    quick = diloco.parse_args(["--quick"])
    assert (quick.steps, quick.sync_every, quick.densities, quick.seeds) == (30, [15], [64], [0])
    full = diloco.parse_args(["--seeds", "0,1"])
    assert (full.steps, full.sync_every, full.densities, full.seeds) == (
        900,
        [15, 30],
        [32, 64, 128],
        [0, 1],
    )


def test_quick_stands_in_for_the_defaults_and_the_command_line_wins():
    """``--quick``'s settings replace the defaults of the options the command line does not
    give; one it gives keeps its value, even the default's (which a comparison with the
    default could not tell apart)."""
    diloco = _load("diloco")
    given = diloco.parse_args(["--quick", "--steps", "900", "--seeds", "1,2"])
    assert (given.steps, given.sync_every, given.densities, given.seeds) == (
        900,
        [15],
        [64],
        [1, 2],
    )
    quality = _load("diloco_quality")
    given = quality.parse_args(["--quick", "--workers", "4,16"])
    assert (given.workers, given.seeds, given.evals, given.sync_every) == ([4, 16], [0], [1, 2], 5)
    assert quality.parse_args(["--quick", "--sync-every", "30"]).sync_every == 30
    assert quality.parse_args(["--sync-every", "30"]).evals == [20, 100]


def test_loading_and_parsing_leave_the_path_as_it_was():
    before = list(sys.path)
    _MODULES.pop("diloco", None)
    with pytest.raises(SystemExit):
        _load("diloco").parse_args(["--steps", "0"])
    assert sys.path == before


def test_int_list_reads_empty_only_where_allowed():
    int_list = _load("cluster").int_list
    assert int_list(empty=True)("") == []
    assert int_list(0)("0,2") == [0, 2]
    with pytest.raises(Exception, match="at least one integer"):
        int_list()("")
