"""``python -m fn demo``: real runs (gloo workers and simulated ranks), its outputs, its flags."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fn.app import _data, _report, demo
from fn.app.cli import _parser, main
from fn.app.launch import WorkerError
from tests.app import ROOT, cli

STEPS = 20
WORLD = 2
COMPRESSED = ("onebit_adam", "zero_one_adam", "onebit_lamb", "loco_adam")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The demo run twice at once, on 2 gloo workers and on 2 simulated ranks."""
    procs = {}
    for mode in ("workers", "simulate"):
        out = tmp_path_factory.mktemp(mode)
        cmd = cli("demo", "--steps", str(STEPS), f"--{mode}", str(WORLD), "--out", str(out))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs[mode] = (
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            ),
            out,
        )
    done = {}
    try:
        for mode, (proc, out) in procs.items():
            stdout, stderr = proc.communicate(timeout=100)
            done[mode] = (proc.returncode, stdout, stderr, out)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def _parse(argv: list[str]):
    return _parser().parse_args(argv)


def _rows(out: Path) -> dict[str, dict]:
    with (out / "results.csv").open() as f:
        return {row["optimizer"]: row for row in csv.DictReader(f)}


def _leaf_sizes() -> list[int]:
    cfg = _config()
    model = demo.CharMLP(_data.VOCAB_SIZE, cfg.context, cfg.embed, cfg.hidden)
    return [p.numel() for p in model.parameters()]


def _config(**kw) -> demo.DemoConfig:
    base = dict(
        steps=STEPS,
        world_size=WORLD,
        simulate=True,
        optimizers=demo.OPTIMIZERS,
        lr=3e-3,
        seed=0,
        timeout=60.0,
    )
    return demo.DemoConfig(**{**base, **kw})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["workers", "simulate"])
def test_demo_writes_table_and_plot(runs, mode):
    code, stdout, stderr, out = runs[mode]
    assert code == 0, stderr
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = _rows(out)
    assert list(rows) == list(demo.OPTIMIZERS)
    for name, row in rows.items():
        assert name in stdout  # the table is printed too
        assert math.isfinite(float(row["heldout_loss"]))
    adam_bytes = int(rows["adam"]["bytes_per_rank"])
    for name in COMPRESSED:
        sent = int(rows[name]["bytes_per_rank"])
        assert 0 < sent < adam_bytes
        assert float(rows[name]["wire_reduction_vs_adam"]) == pytest.approx(adam_bytes / sent)
    # Replicas stay bit-identical except for 0/1 Adam, whose local steps let them drift apart
    # between syncs.
    for name in ("adam", "onebit_adam", "onebit_lamb", "loco_adam"):
        assert rows[name]["ranks_identical"] == "True", name
        assert float(rows[name]["max_param_diff"]) == 0.0
    assert "compressed phases run after it" in stdout
    assert f"[{len(demo.OPTIMIZERS)}/{len(demo.OPTIMIZERS)}] loco_adam" in stderr  # progress
    assert f"{STEPS}/{STEPS}" in stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["workers", "simulate"])
def test_demo_learns(runs, mode):
    out = runs[mode][3]
    results = json.loads((out / "results.json").read_text())
    uniform = math.log(_data.VOCAB_SIZE)
    for name, curves in results["curves"].items():
        heldout = curves["heldout_loss"]
        assert heldout[0][0] == 1 and heldout[-1][0] == STEPS
        assert heldout[0][1] == pytest.approx(uniform, abs=0.7)
        assert heldout[-1][1] < heldout[0][1] - 0.2, name
        assert len(curves["train_loss"]) == STEPS
        # The bytes sent by each held-out point grow to the table's bytes/rank.
        sent = curves["heldout_bytes"]
        assert len(sent) == len(heldout) and sent == sorted(sent) and sent[0] > 0
        row = next(r for r in results["results"] if r["optimizer"] == name)
        assert sent[-1] == row["bytes_per_rank"]


@pytest.mark.timeout(120)
def test_demo_bytes_match_the_wire_formulas(runs):
    """Bytes per rank against the traffic formulas of docs/algorithms.md, for W = 2 and the demo's
    model."""
    rows = _rows(runs["workers"][3])
    warm = demo.warmup_steps(STEPS)
    sizes = _leaf_sizes()
    # Ring allreduce of n fp32 values: 2 (W - 1) / W * 4n bytes per rank.
    dense_step = sum(2 * (WORLD - 1) * 4 * n // WORLD for n in sizes)
    assert int(rows["adam"]["bytes_per_rank"]) == STEPS * dense_step

    # 1-bit allreduce of a leaf padded to N (a multiple of W * lcm(W, 8) = 16): all_to_all of the
    # N / 8 sign bytes, all_gather of the scale and the element count (3 fp32), all_gather of the
    # N / (8 W) server sign bytes and of the server scale.
    def onebit(n):
        padded = -(-n // 16) * 16
        signs = padded // 8
        all_to_all = (WORLD - 1) * signs // WORLD
        server_signs = (WORLD - 1) * (signs // WORLD)
        scales = (WORLD - 1) * (3 * 4 + 4)
        return all_to_all + server_signs + scales

    compressed_step = sum(onebit(n) for n in sizes)
    expected = warm * dense_step + (STEPS - warm) * compressed_step
    assert int(rows["onebit_adam"]["bytes_per_rank"]) == expected


@pytest.mark.timeout(120)
def test_simulated_and_real_workers_agree(runs):
    real, sim = _rows(runs["workers"][3]), _rows(runs["simulate"][3])
    for name in demo.OPTIMIZERS:
        assert real[name]["bytes_per_rank"] == sim[name]["bytes_per_rank"], name
        assert float(real[name]["heldout_loss"]) == pytest.approx(
            float(sim[name]["heldout_loss"]), abs=0.02
        ), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workers", "0"], "--workers: must be at least 1, got 0"),
        (["--simulate", "-2"], "--simulate: must be at least 1, got -2"),
        (["--workers", "2", "--simulate", "2"], "not allowed with argument"),
        (["--steps", "9"], "--steps: must be at least 10"),
        (["--steps", "ten"], "expected an integer, got 'ten'"),
        (["--lr", "nan"], "--lr: must be a positive finite number"),
        (["--optimizers", "adam,sgd"], "unknown optimizer(s) sgd"),
        (["--workers", "1000"], "must be at most 64"),
        (["--seed", str(2**63)], f"--seed: must be at most {2**40}, got {2**63}"),
        (["--seed", "200000000000000"], f"--seed: must be at most {2**40}"),
        (["--seed", str(-(2**40) - 1)], f"--seed: must be at least {-(2**40)}"),
        (["--timeout", "0.001"], "--timeout: must be between 1 s and 604800 s (7 days), got 0.001"),
        (["--timeout", "1e10"], "--timeout: must be between 1 s and 604800 s"),
        (["--timeout", "1e14"], "--timeout: must be between 1 s and 604800 s"),
        (["--simulate", "2", "--timeout", "60"], "--timeout: not allowed with argument --simulate"),
        (["--timeout", "60", "--simulate", "2"], "--timeout: not allowed with argument --simulate"),
    ],
)
def test_bad_flags_exit_with_a_message(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_bad_flag_in_a_subprocess():
    result = subprocess.run(
        cli("demo", "--workers", "0"), cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 2
    assert "--workers: must be at least 1, got 0" in result.stderr


@pytest.mark.parametrize("seed", [-(2**40), 2**40])
def test_the_extreme_seeds_the_flag_accepts_draw_batches_on_every_rank(seed):
    args = _parse(["demo", "--seed", str(seed), "--workers", "64"])
    cfg = _config(seed=args.seed, world_size=64)
    ranks = range(cfg.world_size)
    x, y = demo._batches(cfg, demo._prepare_data(cfg, ranks), ranks)()
    assert x.shape == (64, cfg.batch_size, cfg.context) and y.shape == (64, cfg.batch_size)


def test_main_needs_a_command():
    with pytest.raises(SystemExit):
        main([])


@pytest.mark.timeout(60)
def test_in_process_without_matplotlib_and_tqdm(tmp_path, capsys, monkeypatch):
    """The optional dependencies of the ``app`` extra: without them the demo still runs."""
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg", "tqdm"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now fails
    (tmp_path / "loss.png").write_bytes(b"an earlier run's plot")
    threads = torch.get_num_threads()
    try:
        code = main(
            [
                "demo",
                "--steps",
                "10",
                "--simulate",
                "2",
                "--optimizers",
                "onebit_adam,adam",
                "--out",
                str(tmp_path),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert code == 0
    assert "no plot: matplotlib is not installed" in out
    assert f"removed {tmp_path / 'loss.png'}, an earlier run's plot" in out
    assert not (tmp_path / "loss.png").exists()
    assert list(_rows(tmp_path)) == ["onebit_adam", "adam"]
    assert 'pip install "fn-optim[app]"' in err
    assert "[1/2] onebit_adam: 10/10 steps" in err and "[2/2] adam: 10/10 steps" in err


@pytest.mark.parametrize("where", ["file", "file/sub", "/proc/self"])
def test_an_unwritable_out_fails_before_training(where, tmp_path, capsys):
    if where == "/proc/self" and not Path(where).is_dir():
        pytest.skip("needs /proc (a directory that even root cannot write to)")
    (tmp_path / "file").write_text("")
    path = Path(where) if where.startswith("/") else tmp_path / where
    assert main(["demo", "--simulate", "2", "--out", str(path)]) == 1
    out, err = capsys.readouterr()
    assert f"error: cannot write to --out {path}" in err
    assert not out  # nothing was trained


def test_an_output_file_that_cannot_be_written_fails_before_training(tmp_path, capsys):
    (tmp_path / "results.json").mkdir()  # where the results file goes
    assert main(["demo", "--simulate", "2", "--out", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert f"error: cannot write to --out {tmp_path}" in err and "results.json" in err
    assert not out


@pytest.mark.parametrize(
    "error, hint",
    [
        (WorkerError("worker rank 1 died: killed by signal SIGKILL", [1], died=True), False),
        (WorkerError("the workers timed out; rank(s) [1] stalled", [1], timed_out=True), False),
        (
            WorkerError(
                "worker rank 0 failed:\nValueError: non-finite values",
                [0],
                tracebacks={0: "ValueError: the averaged gradient contains non-finite values"},
            ),
            True,
        ),
        (ValueError("the averaged gradient contains non-finite values (NaN or Inf)"), True),
        (ValueError("something else"), False),
    ],
)
def test_the_lr_hint_only_for_nonfinite_failures(error, hint, tmp_path, capsys, monkeypatch):
    def fail(cfg, on_step):
        raise error

    monkeypatch.setattr(demo, "run_workers", fail)
    monkeypatch.setattr(demo, "run_simulated", fail)
    assert main(["demo", "--workers", "2", "--steps", "10", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"error: training failed: {error}" in err
    assert ("a smaller --lr may help" in err) == hint


def test_without_matplotlib_an_earlier_plot_is_removed_and_said(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    plot = tmp_path / "loss.png"
    assert _report.plot_losses(plot, [], 10, "t") == (
        "matplotlib is not installed (pip install matplotlib)"
    )
    plot.write_bytes(b"an earlier run's plot")
    assert _report.plot_losses(plot, [], 10, "t") == (
        f"matplotlib is not installed (pip install matplotlib); removed {plot}, an earlier run's "
        "plot"
    )
    assert not plot.exists()


def test_the_zero_one_adam_note_blames_its_local_steps_not_rounding():
    apart = demo.OptimizerResult("zero_one_adam", [3.0], [(1, 3.0)], 2.5, 100, 1.0, False, 0.042)
    (note,) = [line for line in demo.notes(_config(), [apart]) if "zero_one_adam" in line]
    assert "rounding" not in note
    assert "local steps between the 1-bit syncs" in note and "differ by design" in note
    assert note.endswith("they ended 4.2e-02 apart at most")


def test_table_ratios_and_text():
    def result(name, sent, identical=True):
        return demo.OptimizerResult(
            name, [3.0], [(1, 3.0)], 2.5, sent, 1.0, identical, 0.0 if identical else 0.25
        )

    rows = _report.table_rows([result("adam", 3200), result("onebit_adam", 100, False)])
    assert [r["wire_reduction_vs_adam"] for r in rows] == [1.0, 32.0]
    text = _report.format_table(rows)
    assert "32.0x" in text and "no (max |dp| 2.5e-01)" in text
    no_adam = _report.table_rows([result("onebit_adam", 100)])
    assert no_adam[0]["wire_reduction_vs_adam"] is None
    assert " - " in _report.format_table(no_adam)


def test_schedule_puts_compression_inside_the_run():
    for steps, warm in [(10, 5), (20, 10), (40, 10), (400, 60), (1000, 150)]:
        assert demo.warmup_steps(steps) == warm
        opt = demo.make_optimizer("onebit_adam", demo.collectives.Local(), 1e-3, steps)
        assert [opt.is_compressed(t) for t in (warm, warm + 1)] == [False, True]


def test_data_shards_are_disjoint_and_deterministic():
    corpus = _data.load_corpus()
    assert len(corpus.vocab) == _data.VOCAB_CHARS and len(set(corpus.vocab)) == _data.VOCAB_CHARS
    assert corpus.train.max() < _data.VOCAB_SIZE and corpus.heldout.max() < _data.VOCAB_SIZE
    shards = [_data.shard(corpus.train, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(shards), corpus.train[: 3 * shards[0].numel()])
    again = _data.load_corpus()
    assert torch.equal(again.train, corpus.train) and again.vocab == corpus.vocab
    text = "def f(x):\n    return x\n"
    ids = _data.encode(text, corpus.vocab)
    assert "".join(corpus.vocab[i] for i in ids) == text
    assert _data.encode("\u00e9", corpus.vocab).item() == _data.VOCAB_CHARS  # "other"
