"""A communicator of two ranks that hold the same tensors, in one process, with an injected
failure: the compressed (fused, donated) paths run as on two ranks, without starting any."""

from __future__ import annotations

import torch

from fn.collectives import Local


class Mirror(Local):
    """Rank 0 of two ranks whose tensors equal this process's; the collective call number
    ``fail_at`` (counted in ``calls``) raises ``ConnectionError`` instead."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.fail_at: int | None = None

    @property
    def world_size(self) -> int:
        return 2

    @property
    def rank(self) -> int:
        return 0

    def _call(self) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError(f"injected failure of collective call {self.calls}")

    def all_reduce(self, x: torch.Tensor, op: str = "mean") -> torch.Tensor:
        self._call()
        return x.clone() if op == "mean" else x * 2

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._call()
        return torch.stack([x, x])

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        self._call()
        return torch.stack([x[0], x[0]])

    def reduce_scatter(self, x: torch.Tensor, op: str = "mean") -> torch.Tensor:
        self._call()
        return x[0].clone() if op == "mean" else x[0] * 2


def bits(tree: object) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` as integers of their bits (NaNs compare equal)."""
    out = []
    for x in torch.utils._pytree.tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            x = x.detach().clone()
            if x.is_floating_point():
                x = x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
            out.append(x)
    return out


def same_bits(a: object, b: object) -> bool:
    xs, ys = bits(a), bits(b)
    return len(xs) == len(ys) and all(
        x.shape == y.shape and torch.equal(x, y) for x, y in zip(xs, ys, strict=True)
    )
