"""Disks that fail writes, for the tests of what fn does then.

``file_size_limit(size)``: this process cannot write a file past ``size`` bytes (``RLIMIT_FSIZE``,
``EFBIG``; torch's zip writer then reports "unexpected pos"), no root needed. ``small_tmpfs(folder,
size)``: a real filesystem of ``size`` mounted on ``folder`` (it needs root: the test skips
without), which ``filled(folder)`` fills (``ENOSPC``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def file_size_limit(size: int) -> Iterator[None]:
    """Within: this process's writes past ``size`` bytes of a file fail with ``EFBIG`` (the
    ``SIGXFSZ`` that would kill it ignored); after, the limit and the signal's handler as
    before."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """Within: a tmpfs of ``size`` (``"1m"``) mounted on the new folder ``folder``; the test
    skips where it cannot be mounted (no root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        # lazy: a file that a failed write left open (torch's writer) does not keep it mounted
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


@contextlib.contextmanager
def filled(folder: str | os.PathLike) -> Iterator[None]:
    """Within: the filesystem mounted on ``folder`` (a small tmpfs) full, up to
    ``folder/filler``; after, that file deleted."""
    assert os.path.ismount(folder), folder  # never fill another filesystem
    filler = Path(folder) / "filler"
    with open(filler, "wb", buffering=0) as file:
        for _ in range(1 << 14):  # at most 64 MiB
            try:
                file.write(bytes(4096))
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
                break
        else:
            raise AssertionError(f"{folder} did not fill up")
    try:
        yield
    finally:
        filler.unlink()
