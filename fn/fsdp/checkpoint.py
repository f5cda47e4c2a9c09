"""``TrainingCheckpoint``: model, optimizer, step and error feedback in one DCP checkpoint.

FSDP2's checkpoints are ``torch.distributed.checkpoint`` (DCP) checkpoints of sharded state
dicts (``torch.distributed.checkpoint.state_dict.get_state_dict``): every rank writes its own
shards. fn's error feedback is per rank too; a :class:`~fn.fsdp.LocoReduceScatterHandle` keys it
by rank, so the same ``dcp.save`` / ``dcp.load`` carries it. Resuming needs the same world size
and model: the error feedback of one rank means nothing to another. An
:class:`~fn.fsdp.OnebitAdam` (or :class:`~fn.fsdp.OnebitLamb`) saves its own state dict (its
shards, its packed momentum once, each rank's errors under that rank's name); its checkpoints
load at any update, and at another world size with the error feedback reset. Further DCP
Statefuls (``extra=``, such as a :class:`fn.diloco.DiLoCo`) are saved beside them, and ranks
whose model state differs (DiLoCo's workers) save under names of their own (``key=``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from fn.collectives import ProcessGroup
from fn.collectives.agreement import gather_texts, shared
from fn.collectives.dcp import PER_RANK
from fn.errors import RecordingFile
from fn.fsdp.loco import LocoReduceScatterHandle
from fn.fsdp.onebit import ShardedOnebitOptimizer
from fn.tree import tree_map

__all__ = ["CheckpointWriteError", "TrainingCheckpoint", "read_onebit_state"]

T = TypeVar("T")


class CheckpointWriteError(OSError):
    """A checkpoint's files could not be written on some rank (a full disk, say): raised by
    :meth:`TrainingCheckpoint.save` on every rank with the same message, which names each
    failing rank and its ``OSError`` (errno, reason, file). Its ``errno``, ``strerror`` and
    ``filename`` are the first failing rank's (``errno.ENOSPC``, ``"No space left on device"``
    for a full disk). An ``OSError``: code that catches ``OSError`` (or ``Exception``) catches it,
    unlike DCP's own ``CheckpointException``, a ``BaseException``.

    Args:
        message: the whole message, what ``str()`` gives.
        errno: the underlying error's number, or ``None``.
        strerror: its reason, or ``None``.
        filename: the file it concerns, or ``None``.

    Example:
        >>> import errno
        >>> from fn.fsdp import CheckpointWriteError
        >>> err = CheckpointWriteError("could not write", errno.ENOSPC, "No space left on device")
        >>> isinstance(err, OSError), err.errno == errno.ENOSPC, err.strerror, str(err)
        (True, True, 'No space left on device', 'could not write')
    """

    def __init__(
        self,
        message: str,
        errno: int | None = None,
        strerror: str | None = None,
        filename: str | None = None,
    ) -> None:
        super().__init__(errno, strerror, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return type(self), (self.message, self.errno, self.strerror, self.filename)


class TrainingCheckpoint:
    """A DCP ``Stateful`` of an FSDP2 model, its optimizer, a step count and fn's handle.

    Args:
        model: the FSDP2 model.
        optimizer: its ``torch.optim`` optimizer.
        handle: the :func:`~fn.fsdp.loco_reduce_scatter` handle, or ``None``.
        step: the training loop's step count, kept in ``self.step``: the loop sets it as it
            trains (the optimizer's steps do not change it), :meth:`save` writes it and
            :meth:`load` restores it, so that a resumed loop starts at ``self.step``.
        extra: further DCP ``Stateful`` s by name (e.g. ``{"diloco": fn.diloco.DiLoCo(...)}``),
            saved under their names. :meth:`load` reads everything, then restores them first,
            so that one that refuses its state (raising in ``load_state_dict`` before it
            changes anything) leaves everything as it was. The entries of a Stateful's
            ``state_dict()["per_rank"]`` (fn's convention, fn/collectives/dcp.py: one per rank,
            named by the rank) that the checkpoint lacks (it was saved on fewer ranks) are left
            out of its read, for it to restart.
        key: the name of this state in the checkpoint. DCP keeps one copy of a name for all
            ranks, so ranks whose model or optimizer state differ, as DiLoCo's workers' do,
            save under names of their own (e.g. ``f"worker{w}"``) into one checkpoint.
        group: the ranks that save and load the checkpoint together (a process group;
            ``None``: every rank), its rank 0 the one that puts it in place: e.g. each DiLoCo
            worker into a checkpoint of its own, over its shard mesh's group.

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> from fn.fsdp import TrainingCheckpoint
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(2, 2), mesh=init_device_mesh("cpu", (1,)))
        >>> ckpt = TrainingCheckpoint(model, torch.optim.AdamW(model.parameters()), step=3)
        >>> path = tempfile.mkdtemp()
        >>> ckpt.save(path)
        >>> ckpt.step = 0
        >>> ckpt.load(path)
        >>> ckpt.step
        3
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        handle: LocoReduceScatterHandle | None = None,
        *,
        step: int = 0,
        extra: Mapping[str, Stateful] | None = None,
        key: str = "training",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.handle = handle
        self.step = step
        self.extra = dict(extra or {})
        self.key = key
        self.group = group
        taken = {"model", "optim", "step", "loco"} & set(self.extra)
        if taken:
            raise ValueError(f"TrainingCheckpoint: extra names {sorted(taken)} are taken")

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optim", "step"[, "loco"], *extra}``: sharded model and optimizer state
        dicts (a :class:`~fn.fsdp.ShardedOnebitOptimizer`'s own ``state_dict()``), and each
        extra Stateful's ``state_dict()`` under its name."""
        state = self._own_state_dict()
        state.update((name, x.state_dict()) for name, x in self.extra.items())
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output: the extra Statefuls first, then the model,
        optimizer and handle."""
        for name, x in self.extra.items():
            x.load_state_dict(state_dict[name])
        self._load_own(state_dict)

    def _own_state_dict(self, optim: bool = True) -> dict[str, Any]:
        """The model's, the optimizer's (``optim=False``: left out, for a 1-bit optimizer only),
        the step's and the handle's state."""
        if isinstance(self.optimizer, ShardedOnebitOptimizer):
            state = {"model": get_model_state_dict(self.model)}
            if optim:
                state["optim"] = self.optimizer.state_dict()
        else:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optim": optim_state}
        state["step"] = torch.tensor(self.step, dtype=torch.int64)
        if self.handle is not None:
            state["loco"] = self.handle.state_dict()
        return state

    def _load_own(self, state_dict: dict[str, Any]) -> None:
        if isinstance(self.optimizer, ShardedOnebitOptimizer):
            self.optimizer.load_state_dict(state_dict["optim"])  # checks before it changes
            set_model_state_dict(self.model, state_dict["model"])
        else:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optim"],
            )
        if self.handle is not None:
            self.handle.load_state_dict(state_dict["loco"])
        self.step = int(state_dict["step"])

    def save(self, path: str | os.PathLike) -> None:
        """Writes this rank's part of the checkpoint to the directory ``path`` (collective).

        Every rank (of ``group``) writes into ``<path>.partial``; once the whole checkpoint is
        there, rank 0 (of ``group``) puts it in place of ``path``. A save that fails therefore
        leaves a checkpoint already at ``path`` as it was, and no ``<path>.partial`` (the
        rename needs the ranks to share
        the filesystem of ``path``, as loading it does; were the process killed between the
        two renames, the previous checkpoint is at ``<path>.old``, and a killed save's
        ``<path>.partial`` is cleared by the next). A local ``path`` may be relative, end in a
        separator (``"ckpt/"``) or start with ``~``: it is taken as the absolute path it
        names, whose siblings ``<path>.partial`` and ``<path>.old`` are. A URL
        (``scheme://...``) is written in place by DCP's own storage.

        Args:
            path: the checkpoint directory (a ``str`` or ``os.PathLike``), or a URL DCP's
                storage writes.

        Raises:
            OSError: on rank 0, it could not clear an old ``<path>.partial`` or rename the new
                checkpoint into place (the previous one, if any, is put back).
            RuntimeError: on every other rank, when rank 0 failed so: at once (the collective
                that ends that step carries each rank's status and message), not at the
                process group's timeout. Its message holds rank 0's error and says whether a
                previous checkpoint at ``path`` is intact or none was there.
            CheckpointWriteError: on every rank, the same: a rank could not write its files (a
                full disk: ``errno.ENOSPC``), once rank 0 has removed ``<path>.partial``. The
                message names each failing rank and its ``OSError`` with the file, and says
                whether a previous checkpoint at ``path`` is intact or none was there.
            RuntimeError: on every rank, the same: DCP's save failed otherwise (no rank's
                ``OSError``), with each failing rank's error, ``<path>.partial`` removed.
        """
        path = _normalised(path)
        group = self.group
        if "://" in path:
            self._write(path, None, "")
            return
        partial = f"{path}.partial"
        first = not dist.is_initialized() or dist.get_rank(group) == 0
        device = _device(self.model)
        # before any rank's step: rank 0 moves a checkpoint at path only after DCP's collectives
        before = (
            f"the previous checkpoint at {path} is intact"
            if os.path.isdir(path)
            else f"no checkpoint was at {path} before"
        )
        what = "TrainingCheckpoint.save"
        clear = (lambda: _clear(partial)) if first else None  # of a save that did not finish
        outcome = f"nothing was saved; {before}"
        _each_rank(device, clear, RuntimeError, what, f"could not clear {partial}", outcome, group)
        self._write(partial, _RecordingWriter(partial), outcome, first)
        put = (lambda: _put_in_place(partial, path)) if first else None
        failed = f"could not move the new checkpoint {partial} to {path}"
        _each_rank(device, put, RuntimeError, what, failed, outcome, group)

    def _write(
        self, target: str, writer: _RecordingWriter | None, outcome: str, first: bool = False
    ) -> None:
        """``dcp.save`` of this state into ``target``: a directory through ``writer``, or a URL
        through DCP's own storage (``writer`` ``None``). When it fails, rank 0 (``first``)
        deletes the directory, and DCP's failure, which every rank holds, is raised as
        :func:`_write_error`'s, the same on every rank (``outcome``: what that left)."""
        group, what = self.group, f"TrainingCheckpoint.save: could not write {target}"
        remove = (lambda: shutil.rmtree(target, ignore_errors=True)) if first else None
        try:
            if writer is None:
                dcp.save({self.key: self}, checkpoint_id=target, process_group=group)
            else:
                dcp.save({self.key: self}, storage_writer=writer, process_group=group)
        except CheckpointException as error:  # a BaseException, which every rank holds alike
            device = _device(self.model)
            raise _write_error(error, writer, remove, what, outcome, device, group) from None
        except Exception as error:  # before DCP's collectives: this rank's own
            if remove is not None:
                remove()
            if outcome:
                error.add_note(f"TrainingCheckpoint.save: {outcome}")
            raise

    def load(self, path: str | os.PathLike) -> None:
        """Restores everything from the checkpoint directory ``path`` (collective).

        Every rank first reads the checkpoint's metadata; when one cannot (no checkpoint at
        ``path`` on its filesystem, say), every rank raises before anything is read or changed.
        For a :class:`~fn.fsdp.ShardedOnebitOptimizer` it reads the optimizer's header first
        and the rest into new tensors laid out as saved, then restores them: a checkpoint of
        another model or other settings, or one that cannot be read, raises on every rank with
        nothing changed. Everything is read into copies (memory for a second copy of this rank's
        model, optimizer and extra states while it loads), then restored: a read that fails on
        any rank, with any optimizer, changes nothing on any rank.

        Args:
            path: the checkpoint directory, in any form :meth:`save` takes, or a URL DCP's
                storage reads.

        Raises:
            OSError: on a rank that cannot read the checkpoint's metadata, its own error (such as
                ``FileNotFoundError``); nothing was changed.
            ValueError: on every other rank then; and on every rank, when the checkpoint does
                not match the model or optimizer or cannot be read (a file cut short, say), or
                an extra Stateful's state cannot be read or is refused by it (nothing changed).
        """
        path, group = _normalised(path), self.group
        onebit = isinstance(self.optimizer, ShardedOnebitOptimizer)
        optim, keys = None, None
        if onebit:  # its header, checked against the optimizer, then its state
            optim = read_onebit_state(self.optimizer, path, f"{self.key}.optim", group)
        if (self.extra or not onebit) and "://" not in path:  # a URL: DCP's storage reads it
            keys = _read_metadata(path, _device(self.model), group).state_dict_metadata
        extra = self._read_extra(path, keys)
        # the state dicts share the live tensors: a failed read changes none
        state = _copies(self._own_state_dict(optim=not onebit))
        _read(path, {self.key: state}, group)
        for name, x in self.extra.items():
            x.load_state_dict(extra[name])
        self._load_own(dict(state, optim=optim) if onebit else state)

    def _read_extra(self, path: str, keys: Any) -> dict[str, Any]:
        """The extra Statefuls' states, read into copies (``keys``: the checkpoint's, to leave
        out the per-rank entries it lacks; ``None``: all)."""
        if not self.extra:
            return {}
        states = _copies({name: x.state_dict() for name, x in self.extra.items()})
        for name, state in states.items():
            per_rank = state.get(PER_RANK) if isinstance(state, dict) else None
            if keys is not None and isinstance(per_rank, dict):
                prefix = f"{self.key}.{name}.{PER_RANK}."
                state[PER_RANK] = {
                    k: v
                    for k, v in per_rank.items()
                    if any(key.startswith(f"{prefix}{k}.") for key in keys)
                }
        _read(path, {self.key: states}, self.group)
        return states


def read_onebit_state(
    optimizer: ShardedOnebitOptimizer,
    path: str | os.PathLike,
    key: str,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """The state of ``optimizer`` saved under ``key`` in the DCP checkpoint directory ``path``,
    read into new tensors laid out as saved. ``key`` is dotted (``"training.optim"``); the
    header is checked against ``optimizer`` first (collective). ``optimizer.load_state_dict``
    then restores it.

    Args:
        optimizer: the :class:`~fn.fsdp.ShardedOnebitOptimizer` to read for.
        path: the checkpoint directory, in any form :meth:`TrainingCheckpoint.save` takes.
        key: where the optimizer's ``state_dict()`` was saved in the checkpoint's state dict.
        group: the ranks that read the checkpoint together (``None``: every rank), as
            :class:`TrainingCheckpoint`'s ``group``.

    Returns:
        The state, of the form of ``optimizer.state_dict()``.

    Raises:
        OSError: on a rank that cannot read the checkpoint's metadata, its own error (such as
            ``FileNotFoundError``), and a ``ValueError`` on every other rank; nothing was
            changed.
        ValueError: on every rank: no state under ``key``, a state of another model or other
            settings, or an unreadable checkpoint; nothing was changed.

    Example:
        One rank here (under ``torchrun`` every rank runs this):

        >>> import tempfile, torch.distributed as dist, torch.distributed.checkpoint as dcp
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> path = tempfile.mkdtemp()
        >>> model = fully_shard(torch.nn.Linear(2, 1), mesh=init_device_mesh("cpu", (1,)))
        >>> opt = fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=2)
        >>> _ = dcp.save({"training": {"optim": opt.state_dict()}}, checkpoint_id=path)
        >>> opt.load_state_dict(fn.fsdp.read_onebit_state(opt, path, "training.optim"))
        >>> dist.destroy_process_group()
    """
    path = _normalised(path)
    prefix = f"{key}."
    device = optimizer.param_groups[0]["params"][0].device
    metadata = _read_metadata(path, device, group).state_dict_metadata
    saved = {
        name[len(prefix) :]: getattr(meta, "size", None)
        for name, meta in metadata.items()
        if name.startswith(prefix)
    }
    if "header" not in saved:
        raise ValueError(
            f"{path} holds no {optimizer.name} state under {key!r} (saved with "
            "another optimizer?); nothing was loaded"
        )
    header = torch.zeros(saved["header"], dtype=torch.int64)
    _read(path, _nested(key, {"header": header}), group)
    state = optimizer.checkpoint_template(header, saved)
    _read(path, _nested(key, state), group)
    return state


def _copies(state: Any) -> Any:
    """``state`` with each tensor (a ``DTensor`` too) replaced by a copy of it."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, state)


def _nested(key: str, value: Any) -> dict[str, Any]:
    """``{"a": {"b": value}}`` for the key ``"a.b"``."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _read(path: str, state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """``dcp.load`` into new tensors over ``group``, its failure on any rank a ``ValueError`` on
    every rank (DCP raises a ``BaseException``)."""
    try:
        dcp.load(state, checkpoint_id=path, process_group=group)
    except CheckpointException as error:
        rank, (cause, _) = next(iter(error.failures.items()))
        raise ValueError(
            f"cannot read the checkpoint {path} (corrupt, or not of this model): "
            f"rank {rank}: {type(cause).__name__}: {cause}; nothing was loaded"
        ) from None


def _read_metadata(path: str, device: torch.device, group: dist.ProcessGroup | None) -> Any:
    """The DCP metadata of the checkpoint directory ``path``, read on every rank of ``group``, or
    an error on every rank when one cannot read it (before any rank enters DCP's collective
    reads)."""
    what = f"cannot read the checkpoint {path}"
    failed, outcome = "cannot read its metadata", "nothing was loaded (no checkpoint there?)"
    return _each_rank(
        device,
        lambda: dcp.FileSystemReader(path).read_metadata(),
        ValueError,
        what,
        failed,
        outcome,
        group,
    )


def _each_rank(
    device: torch.device,
    step: Callable[[], T] | None,
    error: type[Exception],
    what: str,
    failed: str,
    outcome: str,
    group: dist.ProcessGroup | None = None,
) -> T | None:
    """Runs ``step`` on this rank (``None``: nothing), then waits for every rank of ``group``
    (``None``: the world), which learns there which ranks' steps raised and their errors (an
    all-gather of each rank's message length on ``device``, which any backend runs, then one of
    the messages when some step raised; no collective without a process group).

    Args:
        device: the device of the all-gathers (the model's).
        step: this rank's part.
        error: what a rank whose step succeeded raises when another's failed, with the
            message ``"<what>: rank(s) [<r>, ...] <failed>: <their error>; <outcome>"``.
        what: the start of that message.
        failed: what those ranks could not do.
        outcome: what that left.
        group: the ranks.

    Returns:
        What ``step`` returned (``None`` without a step).

    Raises:
        Exception: a rank whose step raised re-raises that; every other rank raises ``error``.
    """
    result, failure, text = None, None, ""
    if step is not None:
        try:
            result = step()
        except Exception as caught:  # noqa: BLE001 (every rank learns of it, then it is raised)
            failure, text = caught, f"{type(caught).__name__}: {caught}"
    texts = _every_rank_text(text, device, group)
    if failure is not None:
        raise failure
    if any(texts):
        raise error(f"{what}: {shared(texts, failed, _ranks(group))}; {outcome}")
    return result


def _every_rank_text(text: str, device: torch.device, group: dist.ProcessGroup | None) -> list[str]:
    """Every rank's ``text`` (of ``group``, ``None``: the world), in rank order; ``""`` where
    none has one (an all-gather of the lengths, then one of the texts when some rank has one;
    without a process group, ``[text]``)."""
    if not dist.is_initialized():
        return [text]
    comm = ProcessGroup(group)
    size = torch.tensor([len(text.encode())], dtype=torch.int64, device=device)
    sizes = comm.all_gather(size).view(-1).tolist()
    return gather_texts(comm, text, sizes, device) if any(sizes) else [""] * len(sizes)


def _ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    """The world ranks of ``group``'s ranks (``None`` for the world: the same)."""
    return None if group is None else dist.get_process_group_ranks(group)


def _write_error(
    error: CheckpointException,
    writer: _RecordingWriter | None,
    clear: Callable[[], None] | None,
    what: str,
    outcome: str,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> Exception:
    """The error that every rank of ``group`` raises when DCP's save failed (``error``, which
    every rank holds alike): after ``clear`` (rank 0: the partial checkpoint's removal), the
    ranks' errors are gathered, each rank's first ``OSError`` of a file (``writer`` kept it:
    torch's zip writer reports a failed write as ``unexpected pos ...``) or else its own in
    ``error``, into one :class:`CheckpointWriteError` when some is an ``OSError``, else one
    ``RuntimeError``."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    kept = writer.fs.failures if writer is not None else []
    own = kept[0] if kept else error.failures.get(rank, (None,))[0]
    if clear is not None:
        clear()
    found = {"text": f"{type(own).__name__}: {own}"} if own is not None else None
    if isinstance(own, OSError):
        found |= {"errno": own.errno, "strerror": own.strerror, "filename": own.filename}
    texts = _every_rank_text(json.dumps(found) if found else "", device, group)
    everyone = [json.loads(text) if text else None for text in texts]
    reasons = [x["text"] if x else "" for x in everyone]
    if not any(reasons):  # no rank's own (DCP's coordinator failed for a rank, say)
        reasons = [f"{type(e).__name__}: {e}" for e, _ in error.failures.values()][:1]
    message = f"{what}: {shared(reasons, 'failed', _ranks(group))}"
    message += f"; {outcome}" if outcome else ""
    first = next((x for x in everyone if x and "errno" in x), None)
    if first is None:
        return RuntimeError(message)
    filename = None if first["filename"] is None else str(first["filename"])
    return CheckpointWriteError(message, first["errno"], first["strerror"], filename)


class _RecordingFileSystem(FileSystem):
    """DCP's local file system, keeping this rank's ``OSError`` s of creating and writing files
    in ``failures`` (through :class:`fn.errors.RecordingFile`)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with io.BufferedWriter(RecordingFile(path, mode, self.failures)) as stream:
            yield stream


class _RecordingWriter(dcp.FileSystemWriter):
    """DCP's ``FileSystemWriter`` (its defaults) into ``path``, through a
    :class:`_RecordingFileSystem` (``self.fs``)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.fs = _RecordingFileSystem()


def _device(model: nn.Module) -> torch.device:
    """The device of the model's params (where its collectives run)."""
    return next(model.parameters()).device


def _normalised(path: str | os.PathLike) -> str:
    """``path`` as a string: a URL (``scheme://...``) as given; a local path absolute, with
    ``~`` expanded and no trailing separator (``"ckpt/"`` is ``"<cwd>/ckpt"``), so that
    ``<path>.partial`` and ``<path>.old`` are its siblings."""
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))


def _clear(directory: str) -> None:
    """Deletes ``directory`` (a save's that did not finish) if it exists."""
    if os.path.lexists(directory):
        shutil.rmtree(directory)


def _put_in_place(new: str, path: str) -> None:
    """Renames the directory ``new`` to ``path``, replacing (and then deleting) what was
    there; when the rename fails, what was there is put back and ``new`` is deleted."""
    old = f"{path}.old"
    shutil.rmtree(old, ignore_errors=True)
    replaced = os.path.exists(path)
    try:
        if replaced:
            os.rename(path, old)
        try:
            os.rename(new, path)
        except OSError:
            if replaced:
                os.rename(old, path)
            raise
    except OSError:
        shutil.rmtree(new, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
