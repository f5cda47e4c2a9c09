"""The demo's data: Python source text from the standard library, as character ids.

The text is read from a fixed list of the standard library's own ``.py`` files (found with
``sysconfig``, so no network and no download), which makes the data real, offline and the same
on every machine with the same Python version. The vocabulary is the ``VOCAB_CHARS`` most frequent
characters of the training text plus one id for all others: rarer symbols would leave rows of the
embedding without gradient for many updates, and a 1-bit optimizer's frozen variance of such a row
is zero, so its compression error would become a huge step. The training modules are
concatenated and cut into one contiguous shard per worker; the held-out modules are never trained
on.
"""

from __future__ import annotations

import sysconfig
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = [
    "TRAIN_MODULES",
    "HELDOUT_MODULES",
    "VOCAB_CHARS",
    "VOCAB_SIZE",
    "Corpus",
    "load_corpus",
    "encode",
    "shard",
    "windows",
    "batch_starts",
    "heldout_starts",
]

TRAIN_MODULES = (
    "functools",
    "collections/__init__",
    "dataclasses",
    "statistics",
    "heapq",
    "textwrap",
    "string",
    "shlex",
    "queue",
    "graphlib",
    "contextlib",
    "random",
)
HELDOUT_MODULES = ("fractions",)

VOCAB_CHARS = 47
VOCAB_SIZE = VOCAB_CHARS + 1  # id VOCAB_CHARS stands for every other character


class Corpus(NamedTuple):
    train: torch.Tensor  # [n_train] int64 character ids of the training modules
    heldout: torch.Tensor  # [n_heldout] int64 character ids of the held-out modules
    files: tuple[str, ...]  # the paths read, training modules first
    vocab: str  # the VOCAB_CHARS characters with their own id, most frequent first


def encode(text: str, vocab: str) -> torch.Tensor:
    """Character ids of ``text`` (``[len(text)]`` int64): the index in ``vocab``, or
    ``len(vocab)`` for a character not in it."""
    table = {ch: i for i, ch in enumerate(vocab)}
    return torch.tensor([table.get(ch, len(vocab)) for ch in text], dtype=torch.int64)


def _read(names: tuple[str, ...]) -> tuple[str, list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, paths = [], []
    for name in names:
        path = root / f"{name}.py"
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except OSError as err:
            raise RuntimeError(
                f"the demo reads the standard library's source files, but {path} cannot be "
                f"read ({err.strerror}); this Python may ship without its .py sources"
            ) from err
        paths.append(str(path))
    return "\n".join(texts), paths


def load_corpus() -> Corpus:
    """Reads and encodes the training and held-out modules.

    Returns:
        A :class:`Corpus`.

    Raises:
        RuntimeError: a source file is missing (a Python installed without its ``.py`` files).
    """
    train_text, train_paths = _read(TRAIN_MODULES)
    heldout_text, heldout_paths = _read(HELDOUT_MODULES)
    counts = Counter(train_text)
    vocab = "".join(sorted(counts, key=lambda ch: (-counts[ch], ch))[:VOCAB_CHARS])
    return Corpus(
        encode(train_text, vocab),
        encode(heldout_text, vocab),
        tuple(train_paths + heldout_paths),
        vocab,
    )


def shard(ids: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous ``1 / world_size`` slice of ``ids``."""
    size = ids.numel() // world_size
    return ids[rank * size : (rank + 1) * size]


def windows(ids: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, ...]:
    """Inputs ``[B, context]`` (the characters from each start) and targets ``[B]`` (the next one).

    Args:
        ids: ``[n]`` character ids.
        starts: ``[B]`` int64 start positions, each ``<= n - context - 1``.
        context: the window length.
    """
    idx = starts[:, None] + torch.arange(context + 1)
    chunk = ids[idx]
    return chunk[:, :context], chunk[:, context]


def batch_starts(n: int, context: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch_size]`` random window starts in ``[0, n - context - 1]``."""
    return torch.randint(0, n - context, (batch_size,), generator=generator)


def heldout_starts(n: int, context: int, count: int) -> torch.Tensor:
    """``[count]`` evenly spaced window starts over a held-out text of ``n`` characters."""
    return torch.linspace(0, n - context - 1, count).long()
