"""fn.fsdp.TrainingCheckpoint on 2 gloo ranks: every form of a path (a trailing separator,
``pathlib.Path``, relative, absolute, ``~``) saves, overwrites and loads, with torch's AdamW and
with fn.fsdp.OnebitAdam. When one rank fails: rank 0 cannot move the new checkpoint into place
(a mount point, or the second rename; on a first save too) or clear an old ``.partial``, DCP's
write fails on a rank (an ``OSError``, or a file over the size limit, which torch's zip writer
reports as "unexpected pos"; a real full disk as root), and a rank cannot read the checkpoint it
loads. A failed write raises the same ``CheckpointWriteError`` on every rank, naming the
``OSError``. Every rank raises at once
(not at the process group's timeout), the failing rank its own error and the others one that
names it and holds that error, saying whether a previous checkpoint is intact or none was there;
no ``.partial`` is left, the previous checkpoint stays intact and loadable, nothing is loaded,
and the next save and load work. ``step`` is the count the training loop sets (the optimizer's
steps leave it), saved and restored."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

import fn.diloco
import fn.fsdp
from fn.fsdp import TrainingCheckpoint
from tests._distributed import run_distributed, run_together
from tests.fsdp import test_fsdp, test_onebit

FAST_S = 30.0  # a rank learns of another's failure well within this (the gloo timeout: 600 s)


def _outcome(call) -> tuple[str, str, float]:
    """``call()``'s exception (type name, message) and the seconds it took (``"ok"``: none)."""
    started = time.monotonic()
    try:
        call()
        kind, message = "ok", ""
    except Exception as error:  # noqa: BLE001 -- the test reports which one
        kind, message = type(error).__name__, str(error)
    return kind, message, time.monotonic() - started


def _failing_rename(rank: int, src_of: str):
    """On rank 0: ``os.rename`` raising ``EBUSY`` for the source ``src_of`` (as for a mount
    point); elsewhere nothing patched."""
    real = os.rename

    def rename(src, dst, *args, **kwargs):
        if os.fspath(src) == src_of:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), src_of)
        return real(src, dst, *args, **kwargs)

    return mock.patch("os.rename", rename) if rank == 0 else contextlib.nullcontext()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The full params and the optimizer's state tensors (copies)."""
    state = {f"param.{k}": v.clone() for k, v in test_fsdp.full_params(model).items()}
    for i, s in enumerate(optimizer.state.values()):
        state.update(
            {f"optim.{i}.{k}": v.full_tensor().clone() for k, v in s.items() if k != "step"}
        )
    return state


def _worker_save(rank: int, world_size: int, root: str) -> dict:
    path = os.path.join(root, "ckpt")
    model = test_fsdp.build(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    test_fsdp.train(model, optimizer, rank, range(2))
    TrainingCheckpoint(model, optimizer, step=2).save(path)
    saved = test_fsdp.full_params(model)
    test_fsdp.train(model, optimizer, rank, range(2, 4))
    out = {}
    with _failing_rename(rank, path):  # the mount point: the old checkpoint cannot move away
        out["mount"] = _outcome(lambda: TrainingCheckpoint(model, optimizer, step=4).save(path))
    with _failing_rename(rank, f"{path}.partial"):  # the new one cannot move in: the old back
        out["rename"] = _outcome(lambda: TrainingCheckpoint(model, optimizer, step=4).save(path))
    dist.barrier()
    out["listing"] = sorted(os.listdir(root))
    dist.barrier()
    if rank == 0:  # an old .partial that rank 0 cannot delete
        os.symlink(root, f"{path}.partial")
    dist.barrier()
    out["clear"] = _outcome(lambda: TrainingCheckpoint(model, optimizer, step=4).save(path))
    dist.barrier()
    if rank == 0:
        os.remove(f"{path}.partial")
    dist.barrier()
    after = test_fsdp.full_params(model)
    checkpoint = TrainingCheckpoint(model, optimizer)
    checkpoint.load(path)  # the previous checkpoint, intact
    out["kept"] = checkpoint.step, _same(saved, test_fsdp.full_params(model))
    out["moved"] = not _same(saved, after)
    test_fsdp.train(model, optimizer, rank, range(2, 4))
    TrainingCheckpoint(model, optimizer, step=4).save(path)  # a later save works
    final = test_fsdp.full_params(model)
    test_fsdp.train(model, optimizer, rank, range(4, 5))
    checkpoint.load(path)
    out["later"] = checkpoint.step, _same(final, test_fsdp.full_params(model))
    out["final_listing"] = sorted(os.listdir(root))
    return out


def _worker_load(rank: int, world_size: int, root: str) -> dict:
    """Rank 1 loads from a directory missing on its filesystem (here: another path)."""
    out = {}
    model = test_fsdp.build(world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    test_fsdp.train(model, optimizer, rank, range(2))
    path = os.path.join(root, "adamw")
    TrainingCheckpoint(model, optimizer, step=2).save(path)
    test_fsdp.train(model, optimizer, rank, range(2, 3))
    before = _state(model, optimizer)
    checkpoint = TrainingCheckpoint(model, optimizer, step=3)
    where = path if rank == 0 else os.path.join(root, "missing")
    out["adamw"] = _outcome(lambda: checkpoint.load(where))
    after = _state(model, optimizer)
    out["adamw_unchanged"] = checkpoint.step == 3 and _same(before, after)
    checkpoint.load(path)
    out["adamw_loaded"] = checkpoint.step

    model = test_onebit.build()
    opt = fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=2)
    unset = TrainingCheckpoint(model, opt)  # its step is the loop's to set
    for t in range(1, 4):  # into the compressed phase
        opt.zero_grad()
        x, y = test_onebit.batch(rank, t)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    out["onebit_unset_step"] = unset.step
    path = os.path.join(root, "onebit")
    TrainingCheckpoint(model, opt, step=3).save(path)
    opt.zero_grad()
    x, y = test_onebit.batch(rank, 4)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    before = test_onebit.full_params(model)
    checkpoint = TrainingCheckpoint(model, opt, step=4)
    where = path if rank == 0 else os.path.join(root, "missing")
    out["onebit"] = _outcome(lambda: checkpoint.load(where))
    after = test_onebit.full_params(model)
    out["onebit_unchanged"] = checkpoint.step == 4 and _same(before, after)
    out["onebit_count"] = opt.count
    checkpoint.load(path)
    out["onebit_loaded"] = checkpoint.step, opt.count
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, tuple[list, Path]]:
    """Every worker of this file on the same 2 ranks, in one launch, each in a folder of its
    own: ``{name: (results by rank, folder)}``. The workers that change the working directory
    (and ``HOME``) come last."""
    workers = {
        "save": _worker_save,
        "load": _worker_load,
        "first save": _worker_first_save,
        "forms": _worker_forms,
    }
    folders = {name: tmp_path_factory.mktemp(name.replace(" ", "_")) for name in workers}
    parts = {name: (worker, (str(folders[name]),)) for name, worker in workers.items()}
    results = run_together(parts, 2, timeout=600)
    return {name: (results[name], folders[name]) for name in workers}


@pytest.mark.timeout(700)
def test_a_failed_save_raises_on_every_rank_at_once_and_keeps_the_checkpoint(two_ranks):
    results, tmp_path = two_ranks["save"]
    path = str(tmp_path / "ckpt")
    for case, words in (
        ("mount", f"could not move the new checkpoint {path}.partial to {path}: "),
        ("rename", f"could not move the new checkpoint {path}.partial to {path}: "),
        ("clear", f"could not clear {path}.partial: "),
    ):
        kind0, mine, seconds = results[0][case]
        assert kind0 in ("OSError", "IsADirectoryError", "NotADirectoryError"), (case, mine)
        assert seconds < FAST_S, case
        kind, message, seconds = results[1][case]
        assert kind == "RuntimeError" and seconds < FAST_S, (case, kind, message, seconds)
        assert message == (
            f"TrainingCheckpoint.save: rank(s) [0] {words}{kind0}: {mine}; nothing was saved; "
            f"the previous checkpoint at {path} is intact"
        ), message
    assert "Device or resource busy" in results[0]["mount"][1]
    for result in results:
        # the new checkpoint deleted after a failed rename
        assert result["listing"] == ["ckpt"]
        assert result["kept"] == (2, True) and result["moved"]
        assert result["later"] == (4, True)
        assert result["final_listing"] == ["ckpt"]


@pytest.mark.timeout(700)
def test_a_rank_that_cannot_read_the_checkpoint_stops_every_rank_with_nothing_loaded(two_ranks):
    results, tmp_path = two_ranks["load"]
    for key in ("adamw", "onebit"):
        kind, message, seconds = results[1][key]
        assert kind == "FileNotFoundError" and seconds < FAST_S, (key, kind, message)
        kind, message, seconds = results[0][key]
        assert kind == "ValueError" and seconds < FAST_S, (key, kind, message)
        assert message.startswith(f"cannot read the checkpoint {tmp_path / key}: rank(s) [1] ")
        assert "nothing was loaded" in message
        for result in results:
            assert result[f"{key}_unchanged"], key
    for result in results:
        assert result["adamw_loaded"] == 2
        assert result["onebit_count"] == 4 and result["onebit_loaded"] == (3, 3)
        assert result["onebit_unset_step"] == 0  # the optimizer's steps leave it (the guides)


# ------------------------------------------------------------------ path forms, first saves


def _build(kind: str, world_size: int):
    if kind == "adamw":
        model = test_fsdp.build(world_size)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    model = test_onebit.build()
    return model, fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=2)


def _train(kind: str, model: nn.Module, optimizer, rank: int, steps: range) -> None:
    if kind == "adamw":
        test_fsdp.train(model, optimizer, rank, steps)
        return
    for t in steps:
        optimizer.zero_grad()
        x, y = test_onebit.batch(rank, t)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _leaves(tree, prefix: str = ""):
    """``(key, local tensor copy)`` of every tensor in a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if isinstance(value, DTensor) else value
            yield f"{prefix}{key}", local.detach().clone()


def _everything(model: nn.Module, optimizer) -> dict:
    """The full params and every tensor of the optimizer's state (copies)."""
    state = {f"param.{k}": v.clone() for k, v in test_fsdp.full_params(model).items()}
    if isinstance(optimizer, fn.fsdp.ShardedOnebitOptimizer):
        state.update(_leaves(optimizer.state_dict(), "optim."))
    else:
        for i, s in enumerate(optimizer.state.values()):
            state.update(_leaves(s, f"optim.{i}."))
    return state


def _forms(root: str, home: str) -> dict:
    """By name: the path as passed, and the directory it names (relative: from ``root``; ``~``:
    ``home``)."""
    return {
        "relative/": ("slash/", os.path.join(root, "slash")),
        "relative": ("plain", os.path.join(root, "plain")),
        "./a/../dots": ("./a/../dots", os.path.join(root, "dots")),
        "Path": (Path("path"), os.path.join(root, "path")),
        "absolute/": (os.path.join(root, "absolute") + os.sep, os.path.join(root, "absolute")),
        "Path absolute": (Path(root) / "pabs", os.path.join(root, "pabs")),
        "~/": ("~/home/", os.path.join(home, "home")),
    }


def _worker_forms(rank: int, world_size: int, root: str) -> dict:
    """Each form: a first save, an overwrite, then a load (and, for fn.fsdp.OnebitAdam,
    read_onebit_state) after more updates; relative paths from the working directory, ``~``
    from ``HOME``."""
    out = {}
    for kind in ("adamw", "onebit"):
        here = os.path.join(root, kind)
        os.makedirs(here, exist_ok=True)
        dist.barrier()
        os.chdir(here)
        os.environ["HOME"] = home = os.path.join(root, f"{kind}-home")
        model, optimizer = _build(kind, world_size)
        t = 0
        for name, (path, directory) in _forms(here, home).items():
            _train(kind, model, optimizer, rank, range(t, t + 2))
            TrainingCheckpoint(model, optimizer, step=t + 2).save(path)  # first save
            first = os.path.isdir(directory)
            _train(kind, model, optimizer, rank, range(t + 2, t + 3))
            TrainingCheckpoint(model, optimizer, step=t + 3).save(path)  # overwrite
            saved = _everything(model, optimizer)
            _train(kind, model, optimizer, rank, range(t + 3, t + 4))
            moved = not _same(saved, _everything(model, optimizer))
            checkpoint = TrainingCheckpoint(model, optimizer)
            checkpoint.load(path)
            loaded = checkpoint.step == t + 3 and _same(saved, _everything(model, optimizer))
            if kind == "onebit":
                _train(kind, model, optimizer, rank, range(t + 3, t + 4))
                state = fn.fsdp.read_onebit_state(optimizer, path, "training.optim")
                optimizer.load_state_dict(state)
                loaded = loaded and _same(
                    {k: v for k, v in saved.items() if k.startswith("optim.")},
                    {
                        k: v
                        for k, v in _everything(model, optimizer).items()
                        if k.startswith("optim.")
                    },
                )
                checkpoint.load(path)
            out[kind, name] = first, moved, loaded
            t += 3
        dist.barrier()
        out[kind, "listing"] = sorted(os.listdir(here)), sorted(os.listdir(home))
        dist.barrier()
    return out


@pytest.mark.timeout(700)
def test_every_form_of_a_path_saves_overwrites_and_loads(two_ranks):
    results, tmp_path = two_ranks["forms"]
    for result in results:
        for kind in ("adamw", "onebit"):
            here, home = str(tmp_path / kind), str(tmp_path / f"{kind}-home")
            forms = _forms(here, home)
            for name in forms:
                assert result[kind, name] == (True, True, True), (kind, name)
            listing, home_listing = result[kind, "listing"]
            made = sorted(os.path.basename(d) for n, (_, d) in forms.items() if n != "~/")
            assert listing == made, (kind, listing)  # no .partial, no .old
            assert "home" in home_listing and not any(
                n.startswith("home.") for n in home_listing
            ), (kind, home_listing)


def _write_fails(rank: int):
    """On rank 1: DCP's file writes raising ``OSError(ENOSPC)``; elsewhere nothing patched."""

    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rank != 1:
        return contextlib.nullcontext()
    return mock.patch.object(dcp.FileSystemWriter, "write_data", write_data)


@contextlib.contextmanager
def _file_size_limit(rank: int, size: int):
    """On rank 1: files past ``size`` bytes cannot be written (``RLIMIT_FSIZE``: ``EFBIG``, the
    signal ignored); elsewhere nothing changed."""
    if rank != 1:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _write_outcome(call) -> tuple:
    """``call()``'s exception: whether an ``Exception``, its type name, message, errno and file
    (``"ok"``: none)."""
    try:
        call()
    except BaseException as error:  # noqa: BLE001 -- DCP's own is a BaseException
        kind = type(error).__name__
        where = getattr(error, "errno", None), getattr(error, "filename", None)
        return (isinstance(error, Exception), kind, str(error), *where)
    return (True, "ok", "", None, None)


def _failed_save(
    failing, outcome, checkpoint: TrainingCheckpoint, path: str, folder: str
) -> tuple[tuple, list[str]]:
    """``outcome`` of ``checkpoint.save(path)`` made to fail by the context ``failing``, and the
    names in ``folder`` after it, once every rank is past it."""
    with failing:
        result = outcome(functools.partial(checkpoint.save, path))
    dist.barrier()
    listing = sorted(os.listdir(folder))
    dist.barrier()
    return result, listing


def _worker_first_save(rank: int, world_size: int, root: str) -> dict:
    """A first save whose rename fails, a first save whose DCP write fails, and an overwrite
    whose DCP write fails (relative paths with a trailing separator)."""
    out = {}
    for kind in ("adamw", "onebit"):
        here = os.path.join(root, kind)
        os.makedirs(here, exist_ok=True)
        dist.barrier()
        os.chdir(here)
        model, optimizer = _build(kind, world_size)
        _train(kind, model, optimizer, rank, range(3))
        first_saves = {  # each fails on one rank
            "rename": (_failing_rename(rank, os.path.join(here, "new.partial")), _outcome),
            "write": (_write_fails(rank), _write_outcome),
            # rank 1's file stops inside torch.save
            "too large": (_file_size_limit(rank, 20_000), _write_outcome),
        }
        for case, (failing, outcome) in first_saves.items():
            out[kind, case], out[kind, f"{case} listing"] = _failed_save(
                failing, outcome, TrainingCheckpoint(model, optimizer), "new/", here
            )
        TrainingCheckpoint(model, optimizer, step=3).save("old/")
        saved = _everything(model, optimizer)
        _train(kind, model, optimizer, rank, range(3, 4))
        out[kind, "overwrite"], out[kind, "overwrite listing"] = _failed_save(
            _write_fails(rank), _write_outcome, TrainingCheckpoint(model, optimizer), "old/", here
        )
        checkpoint = TrainingCheckpoint(model, optimizer)
        checkpoint.load("old")
        out[kind, "kept"] = checkpoint.step == 3 and _same(saved, _everything(model, optimizer))
    return out


@pytest.mark.timeout(700)
def test_a_failed_first_save_says_so_and_leaves_nothing(two_ranks):
    results, tmp_path = two_ranks["first save"]
    for kind in ("adamw", "onebit"):
        new, old = (str(tmp_path / kind / name) for name in ("new", "old"))
        kind0, mine, seconds = results[0][kind, "rename"]
        assert kind0 == "OSError" and "Device or resource busy" in mine and seconds < FAST_S
        kind1, message, seconds = results[1][kind, "rename"]
        assert kind1 == "RuntimeError" and seconds < FAST_S, (kind1, message)
        assert message == (
            f"TrainingCheckpoint.save: rank(s) [0] could not move the new checkpoint "
            f"{new}.partial to {new}: {kind0}: {mine}; nothing was saved; no checkpoint was at "
            f"{new} before"
        ), message
        for result in results:
            assert result[kind, "rename listing"] == [], kind
            full = "OSError: [Errno 28] No space left on device"
            assert result[kind, "write"] == (
                True,
                "CheckpointWriteError",
                f"TrainingCheckpoint.save: could not write {new}.partial: rank(s) [1] failed: "
                f"{full}; nothing was saved; no checkpoint was at {new} before",
                errno.ENOSPC,
                None,
            )
            assert result[kind, "write listing"] == [], kind
            file = f"{new}.partial/__1_0.distcp"
            assert result[kind, "too large"] == (
                True,
                "CheckpointWriteError",
                f"TrainingCheckpoint.save: could not write {new}.partial: rank(s) [1] failed: "
                f"OSError: [Errno 27] File too large: {file!r}; nothing was saved; no "
                f"checkpoint was at {new} before",
                errno.EFBIG,
                file,
            )
            assert result[kind, "too large listing"] == [], kind
            assert result[kind, "overwrite"] == (
                True,
                "CheckpointWriteError",
                f"TrainingCheckpoint.save: could not write {old}.partial: rank(s) [1] failed: "
                f"{full}; nothing was saved; the previous checkpoint at {old} is intact",
                errno.ENOSPC,
                None,
            )
            assert result[kind, "overwrite listing"] == ["old"], kind
            assert result[kind, "kept"], kind


# ------------------------------------------------------------------------ a real full disk


def _fill(folder: str) -> None:
    """Writes ``folder/filler`` until the filesystem of ``folder`` (a small tmpfs) is full."""
    assert os.path.ismount(folder), folder  # never fill another filesystem
    with open(os.path.join(folder, "filler"), "wb", buffering=0) as filler:
        for _ in range(1 << 14):  # at most 64 MiB
            try:
                filler.write(bytes(4096))
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
                return
    raise AssertionError(f"{folder} did not fill up")


def _full_disk_case(kind: str, rank: int, world_size: int):
    """``(model, optimizer, checkpoint_of, train)`` of one kind: FSDP2 with AdamW, FSDP2 with
    fn.fsdp.OnebitAdam, or a DiLoCo worker (its state saved as ``extra=``, a name per worker)."""
    if kind != "diloco":
        model, optimizer = _build(kind, world_size)
        return (
            model,
            optimizer,
            functools.partial(TrainingCheckpoint, model, optimizer),
            functools.partial(_train, kind, model, optimizer, rank),
        )
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=2)

    def train(steps: range) -> None:
        for t in steps:
            g = torch.Generator().manual_seed(1000 * rank + t)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
            nn.functional.mse_loss(model(x), y).backward()
            inner.step()
            inner.zero_grad()

    extra = {"diloco": diloco}
    checkpoint = functools.partial(TrainingCheckpoint, model, inner, extra=extra, key=f"w{rank}")
    return model, inner, checkpoint, train


def _snapshot(kind: str, model: nn.Module, optimizer) -> dict:
    if kind != "diloco":
        return _everything(model, optimizer)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worker_full_disk(rank: int, world_size: int, full: str, good: str) -> dict:
    """Per kind: a checkpoint saved on the tmpfs ``full``, which rank 0 then fills; an overwrite
    and a first save there fail (each rank lists ``full`` as soon as it has the error); the
    previous checkpoint loads; a save to ``good`` then works; with the space back, so does one
    to ``full``."""
    out = {}
    for kind in ("adamw", "onebit", "diloco"):
        model, optimizer, checkpoint_of, train = _full_disk_case(kind, rank, world_size)
        train(range(3))
        checkpoint_of(step=3).save(f"{full}/{kind}")
        saved = _snapshot(kind, model, optimizer)
        if rank == 0:
            _fill(full)
        dist.barrier()
        train(range(3, 4))
        for name in ("overwrite", "first"):
            where = f"{full}/{kind}" if name == "overwrite" else f"{full}/new"
            out[kind, name] = _write_outcome(functools.partial(checkpoint_of(step=4).save, where))
            out[kind, name, "listing"] = sorted(os.listdir(full))
        checkpoint = checkpoint_of()
        checkpoint.load(f"{full}/{kind}")
        out[kind, "kept"] = checkpoint.step == 3 and _same(saved, _snapshot(kind, model, optimizer))
        train(range(3, 4))
        checkpoint_of(step=4).save(f"{good}/{kind}")
        later = _snapshot(kind, model, optimizer)
        train(range(4, 5))
        checkpoint.load(f"{good}/{kind}")
        out[kind, "good"] = checkpoint.step == 4 and _same(later, _snapshot(kind, model, optimizer))
        dist.barrier()
        if rank == 0:
            os.remove(f"{full}/filler")
        dist.barrier()
        checkpoint_of(step=4).save(f"{full}/{kind}")
        checkpoint.load(f"{full}/{kind}")
        out[kind, "space back"] = _same(later, _snapshot(kind, model, optimizer))
        dist.barrier()
    return out


@pytest.mark.timeout(300)
def test_a_save_on_a_full_disk_raises_the_same_oserror_on_every_rank_and_leaves_nothing(tmp_path):
    """A real full filesystem: a 1 MiB tmpfs that rank 0 fills (mounting one needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    full, good = tmp_path / "full", tmp_path / "good"
    full.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        results = run_distributed(_worker_full_disk, 2, str(full), str(good), timeout=240)
    finally:
        subprocess.run(["umount", str(full)], check=True)
        shutil.rmtree(full, ignore_errors=True)
    for kind in ("adamw", "onebit", "diloco"):
        for name, target in (("overwrite", full / kind), ("first", full / "new")):
            outcome = results[0][kind, name]
            assert all(result[kind, name] == outcome for result in results), (kind, name)
            is_exception, error, message, number, file = outcome
            assert is_exception and error == "CheckpointWriteError", (kind, name, outcome)
            assert number == errno.ENOSPC and file.startswith(f"{target}.partial/"), outcome
            assert message.startswith(
                f"TrainingCheckpoint.save: could not write {target}.partial: rank(s) "
            ), message
            assert "OSError: [Errno 28] No space left on device: " in message, message
            before = (
                f"the previous checkpoint at {target} is intact"
                if name == "overwrite"
                else f"no checkpoint was at {target} before"
            )
            assert message.endswith(f"; nothing was saved; {before}"), message
            for result in results:  # no .partial, even on the rank that raised first
                assert result[kind, name, "listing"] == sorted(["filler", *_saved(kind)])
        for result in results:
            assert result[kind, "kept"] and result[kind, "good"], kind
            assert result[kind, "space back"], kind


def _saved(kind: str) -> list[str]:
    """The checkpoints on the tmpfs when ``kind``'s saves fail: each kind's so far."""
    kinds = ["adamw", "onebit", "diloco"]
    return kinds[: kinds.index(kind) + 1]
