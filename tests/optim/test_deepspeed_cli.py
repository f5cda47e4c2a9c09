"""``python -m fn from-deepspeed CHECKPOINT_DIR OUT`` on DeepSpeed's non-ZeRO checkpoint layout
(``<save_dir>/latest``, ``<save_dir>/<tag>/mp_rank_00_model_states.pt`` with the keys of
DeepSpeed 0.18.9's ``engine._save_checkpoint``), filled with a reference run's states."""

from __future__ import annotations

import argparse
import functools
import json
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch

import fn
from fn.app.cli import main
from fn.collectives import Local
from tests._disk import file_size_limit, filled, small_tmpfs

DATA = Path(__file__).resolve().parent / "deepspeed_data"
RUN = next(
    r
    for r in torch.load(DATA / "optimizers.pt", weights_only=True)["runs"]
    if r["name"] == "zero_one_adam" and r["world_size"] == 2 and r["checkpoint_step"] == 9
)
# what DeepSpeed's engine saves: rank 0's params and optimizer state
PARAMS, STATE_DICT = RUN["params_at_checkpoint"][0], RUN["state_dicts"][0]
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 5}}


def _save_dir(tmp_path: Path) -> Path:
    weight, bias, head = PARAMS
    module = {
        "encoder.weight": weight,
        "encoder.bias": bias,
        "norm.running_mean": torch.zeros(3),  # a buffer
        "head.weight": head,
        "decoder.weight": weight,  # tied to encoder.weight: not a second param
    }
    state = {
        "module": module,
        "buffer_names": ["norm.running_mean"],
        "optimizer": STATE_DICT,
        "lr_scheduler": {"last_batch_iteration": RUN["checkpoint_step"]},
        "sparse_tensor_module_names": set(),
        "skipped_steps": 0,
        "global_steps": RUN["checkpoint_step"] + 1,
        "global_samples": 64,
        "dp_world_size": 2,
        "mp_world_size": 1,
        "ds_config": {**RUN["config"], "scheduler": SCHEDULER, "train_batch_size": 8},
        "ds_version": "0.18.9",
    }
    tag = tmp_path / "ckpt" / "global_step10"
    tag.mkdir(parents=True)
    torch.save(state, tag / "mp_rank_00_model_states.pt")
    (tmp_path / "ckpt" / "latest").write_text("global_step10")
    return tmp_path / "ckpt"


def test_converts_a_checkpoint_that_fn_resumes_from(tmp_path, capsys):
    out = tmp_path / "fn.pt"
    assert main(["from-deepspeed", str(_save_dir(tmp_path)), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ZeroOneAdam -> fn.optim.ZeroOneAdam" in printed and "9 updates" in printed
    assert "resumes at iteration 9" in printed and "train_batch_size" in printed
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["param_names"] == ["encoder.weight", "encoder.bias", "head.weight"]
    assert ckpt["step"] == 9
    assert not any("error" in k for e in ckpt["optimizer"]["state"].values() for k in e)

    params = [torch.nn.Parameter(ckpt["model"][n].clone()) for n in ckpt["param_names"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = fn.optim.from_deepspeed(
            params, ckpt["config"], state_dict=ckpt["optimizer"], comm=Local()
        )
        direct = fn.optim.from_deepspeed(
            [torch.nn.Parameter(p.clone()) for p in PARAMS],
            RUN["config"],
            state_dict=STATE_DICT,
            comm=Local(),
        )
    a, b = ours.state_dict()["state"][0], direct.state_dict()["state"][0]
    assert a["step"] == b["step"] == 9
    for key, value in b["functional"].items():
        assert torch.equal(a["functional"][key], value), key
    sched = fn.optim.scheduler_from_deepspeed(ours, ckpt["config"])
    assert sched.last_epoch == 9 and ours.param_groups[0]["lr"] == pytest.approx(0.01)


def test_unusable_folders_are_clear_errors(tmp_path, capsys):
    out = str(tmp_path / "fn.pt")
    assert main(["from-deepspeed", str(tmp_path / "missing"), out]) == 1
    assert "no mp_rank_00_model_states.pt" in capsys.readouterr().err
    zero = tmp_path / "zero"
    zero.mkdir()
    (zero / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert main(["from-deepspeed", str(zero), out]) == 1
    assert "ZeRO" in capsys.readouterr().err


def test_every_form_of_a_folder_converts(tmp_path, monkeypatch):
    save_dir = _save_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    forms = [
        save_dir, str(save_dir), f"{save_dir}/", "ckpt", "ckpt/", Path("ckpt"), "./ckpt/",
        "~/ckpt/", save_dir / "global_step10", "ckpt/global_step10/",
    ]  # fmt: skip
    for form in forms:
        ckpt, summary = fn.optim.convert_checkpoint(form)
        assert ckpt["step"] == 9 and ckpt["param_names"][0] == "encoder.weight", form
        assert summary[0].startswith(f"read {save_dir / 'global_step10'}"), (form, summary[0])


def _failed_writes(tmp_path: Path, out: Path, failing, capsys) -> dict:
    """Converts into ``out``, then, within ``failing()``, an overwrite of ``out`` and a first
    write beside it: by case, the exit code, the error output and the files in ``out``'s
    folder; and whether ``out`` is intact."""
    save_dir = _save_dir(tmp_path)
    assert main(["from-deepspeed", str(save_dir), str(out)]) == 0
    written = out.read_bytes()
    capsys.readouterr()
    found = {}
    with failing():
        for name, target in (("overwrite", out), ("first", out.with_name("new.pt"))):
            code = main(["from-deepspeed", str(save_dir), str(target)])
            found[name] = code, capsys.readouterr().err, sorted(os.listdir(out.parent))
    found["intact"] = out.read_bytes() == written
    return found


def _expected(out: Path, error: str, files: list[str]) -> dict:
    new = out.with_name("new.pt")
    return {
        "overwrite": (
            1,
            f"error: cannot write {out}: {error}: '{out}.partial'; {out} is as it was\n",
            files,
        ),
        "first": (
            1,
            f"error: cannot write {new}: {error}: '{new}.partial'; nothing was written\n",
            files,
        ),
        "intact": True,
    }


def test_a_failed_write_names_the_error_and_leaves_nothing(tmp_path, capsys):
    """A file over the size limit (``RLIMIT_FSIZE``), which torch.save reports as "unexpected
    pos": the error names the ``OSError`` and the file; no ``.partial`` is left and a file
    already there is as it was."""
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "fn.pt"
    limit = functools.partial(file_size_limit, 100_000)  # the checkpoint is over 200 kB
    found = _failed_writes(tmp_path, out, limit, capsys)
    assert found == _expected(out, "[Errno 27] File too large", ["fn.pt"])


def test_a_full_disk_names_the_error_and_leaves_nothing(tmp_path, capsys):
    """A real full filesystem: a 1 MiB tmpfs, filled after the first write (root only)."""
    with small_tmpfs(tmp_path / "small", "1m") as small:
        out = small / "fn.pt"
        found = _failed_writes(tmp_path, out, functools.partial(filled, small), capsys)
    assert found == _expected(out, "[Errno 28] No space left on device", ["filler", "fn.pt"])


def _model_states(save_dir: Path) -> Path:
    return save_dir / "global_step10" / "mp_rank_00_model_states.pt"


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_an_unreadable_file_is_reported_as_corrupted_without_the_trust_hint(
    damage, trust, tmp_path, capsys
):
    save_dir = _save_dir(tmp_path)
    path = _model_states(save_dir)
    whole = path.read_bytes()
    path.write_bytes(
        {"truncated": whole[: len(whole) // 2], "empty": b"", "garbage": b"xy" * 99}[damage]
    )
    out = tmp_path / "fn.pt"
    flags = ["--trust"] if trust else []
    assert main(["from-deepspeed", str(save_dir), str(out), *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} cannot be read: it is corrupted or truncated (")
    assert "--trust" not in err and "Traceback" not in err
    assert not out.exists()


def test_a_weights_only_refusal_suggests_trust_which_converts(tmp_path, capsys):
    save_dir = _save_dir(tmp_path)
    path = _model_states(save_dir)
    saved = torch.load(path, weights_only=True)
    torch.save({**saved, "args": argparse.Namespace(seed=1)}, path)  # not a weights-only type
    out = tmp_path / "fn.pt"
    assert main(["from-deepspeed", str(save_dir), str(out)]) == 1
    err = capsys.readouterr().err
    assert "a weights-only load refuses" in err and "convert it with --trust" in err
    assert main(["from-deepspeed", str(save_dir), str(out), "--trust"]) == 0
    assert torch.load(out, weights_only=True)["step"] == 9


@pytest.mark.parametrize(
    "change, missing",
    [
        (lambda saved: torch.zeros(3), "it holds a Tensor, not a dict"),
        (lambda saved: {k: v for k, v in saved.items() if k != "module"}, "it has no 'module'"),
        (lambda saved: {**saved, "module": [1]}, "it has a list where the model's state dict"),
        (lambda saved: {**saved, "optimizer": [1]}, "its 'optimizer' is a list, not a state dict"),
        (
            lambda saved: {**saved, "optimizer": {"state": {}}},
            "its optimizer state has no 'param_groups'",
        ),
        (
            lambda saved: {**saved, "optimizer": {"state": {}, "param_groups": [3]}},
            "its optimizer's 'param_groups' are not a list of dicts with 'params'",
        ),
    ],
)
def test_an_unexpected_structure_says_what_is_missing(change, missing, tmp_path, capsys):
    save_dir = _save_dir(tmp_path)
    path = _model_states(save_dir)
    torch.save(change(torch.load(path, weights_only=True)), path)
    assert main(["from-deepspeed", str(save_dir), str(tmp_path / "fn.pt")]) == 1
    err = capsys.readouterr().err
    expected = f"error: {path} is not a DeepSpeed model-states file of a 1-bit optimizer: "
    assert err.startswith(expected + missing), err
    with pytest.raises(ValueError, match="is not a DeepSpeed model-states file"):
        fn.optim.convert_checkpoint(save_dir)


@pytest.mark.parametrize("out", [".", "", "folder", "folder/"])
def test_an_out_that_is_a_directory_is_refused(out, tmp_path, monkeypatch, capsys):
    save_dir = _save_dir(tmp_path)
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert main(["from-deepspeed", str(save_dir), out]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {Path(out)}: it is a directory; OUT is the file")
    assert err.endswith("; nothing was written\n")
    assert sorted(os.listdir(tmp_path)) == before and not os.listdir(tmp_path / "folder")


def test_an_out_symlink_writes_the_file_it_points_to(tmp_path, capsys):
    save_dir = _save_dir(tmp_path)
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "fn.pt"
    target.write_text("an earlier file")
    link = tmp_path / "link.pt"
    link.symlink_to(Path("real") / "fn.pt")
    assert main(["from-deepspeed", str(save_dir), str(link)]) == 0
    assert f"wrote {link} (the file its link points to: {target})" in capsys.readouterr().out
    assert link.is_symlink() and os.readlink(link) == str(Path("real") / "fn.pt")
    assert torch.load(target, weights_only=True)["step"] == 9
    assert sorted(os.listdir(tmp_path / "real")) == ["fn.pt"]  # no .partial left


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
@pytest.mark.parametrize("through_link", [False, True])
def test_an_out_that_is_not_a_regular_file_is_left_as_it_is(through_link, tmp_path, capsys):
    save_dir = _save_dir(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = fifo
    if through_link:
        out = tmp_path / "link.pt"
        out.symlink_to(fifo)
    before = sorted(os.listdir(tmp_path))
    assert main(["from-deepspeed", str(save_dir), str(out)]) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: cannot write {out}: it is a FIFO, not a regular file; it is left as it is; "
        "nothing was written\n"
    )
    assert stat.S_ISFIFO(fifo.stat().st_mode) and sorted(os.listdir(tmp_path)) == before
    assert out.is_symlink() == through_link


@pytest.mark.parametrize("which", ["model states", "hard link", "symlink", "latest", "config"])
def test_an_out_that_the_conversion_reads_is_refused(which, tmp_path, capsys):
    save_dir = _save_dir(tmp_path)
    states = _model_states(save_dir)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**RUN["config"], "train_batch_size": 8}))
    out = {"model states": states, "latest": save_dir / "latest", "config": config}.get(which)
    read = out
    if which in ("hard link", "symlink"):
        out, read = tmp_path / "other.pt", states
        (out.hardlink_to if which == "hard link" else out.symlink_to)(states)
    kept = read.read_bytes()
    flags = ["--config", str(config)] if which == "config" else []
    assert main(["from-deepspeed", str(save_dir), str(out), *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {out}: it is a file the conversion reads (")
    assert read.read_bytes() == kept


def test_checkpoint_files_are_the_files_the_conversion_reads(tmp_path):
    save_dir = _save_dir(tmp_path)
    tag = save_dir / "global_step10"
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**RUN["config"], "train_batch_size": 8}))
    latest, states = str(save_dir / "latest"), str(tag / "mp_rank_00_model_states.pt")
    assert fn.optim.checkpoint_files(save_dir) == [latest, states]
    assert fn.optim.checkpoint_files(tag, config) == [states, str(config)]
    assert fn.optim.checkpoint_files(save_dir, RUN["config"]) == [latest, states]  # a dict
    (save_dir / "latest").write_text("global_step99")  # a tag that is not there
    assert fn.optim.checkpoint_files(save_dir) == [latest]
    with pytest.raises(FileNotFoundError):
        fn.optim.convert_checkpoint(save_dir)
    assert fn.optim.checkpoint_files(tmp_path / "nowhere") == []
