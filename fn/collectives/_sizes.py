"""Element counts sent next to the scales of the compressed collectives.

Every rank must pass a tensor of the same size; one that does not would get results of another
shape or mix unrelated chunks. So each rank appends its element count ``n`` to the fp32 scales it
already sends, as two exact fp32 digits ``(n // 2^24, n % 2^24)`` (exact up to ``2^48``), and
every receiver checks the counts before it uses anything: a mismatch is a ``ValueError`` on every
rank, at no extra collective. A rank that saw a mismatch in an earlier exchange sends ``-1``
digits onwards, so that ranks it exchanges with later raise too.

The check reads tensor values, so under vmap (``Simulated``) and ``torch.compile`` it runs as a
custom op (as ``fn._validation.finite_or_raise``) that returns the scales without the digits.
"""

from __future__ import annotations

import torch

_DIGIT = 2**24  # every integer below 2^24 is exact in fp32
POISON = -1.0


def with_count(scales: torch.Tensor, n: int) -> torch.Tensor:
    """``scales`` (``[rows, k]``) with the two count digits of ``n`` appended to every row."""
    digits = torch.tensor([n // _DIGIT, n % _DIGIT], dtype=torch.float32, device=scales.device)
    return torch.cat([scales, digits.expand(*scales.shape[:-1], 2)], dim=-1)


def poisoned(sent: torch.Tensor, consistent: torch.Tensor) -> torch.Tensor:
    """``sent`` (from :func:`with_count`) with the digits replaced by ``-1`` unless
    ``consistent`` (a bool tensor: this rank has seen only matching counts so far)."""
    scales, digits = sent[..., :-2], sent[..., -2:]
    return torch.cat([scales, torch.where(consistent, digits, POISON)], dim=-1)


def counts_match(received: torch.Tensor, n: int) -> torch.Tensor:
    """A bool tensor: every row of ``received`` carries the count ``n``."""
    return (_counts(received) == n).all()


def checked_scales(received: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """The scales of ``received`` (``[rows, k + 2]``, row ``i`` from the ``i``-th rank of the
    exchange) without the count digits; raises ``ValueError`` unless every row carries ``n``."""
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(received):
        return _checked_scales_op(received, n, what)
    _raise_on_mismatch(received, n, what)
    return received[..., :-2]


def _counts(received: torch.Tensor) -> torch.Tensor:
    digits = received[..., -2:].double()
    return digits[..., 0] * _DIGIT + digits[..., 1]


def _raise_on_mismatch(received: torch.Tensor, n: int, what: str) -> None:
    if bool(counts_match(received, n)):
        return
    counts = _counts(received).reshape(-1, received.shape[-2]).tolist()
    shown = ", ".join(
        f"rank {i}: {'a mismatch seen earlier' if c < 0 else f'{int(c)} elements'}"
        for i, c in enumerate(counts[0])
    )
    raise ValueError(
        f"{what}: the ranks passed tensors of different sizes ({n} elements here; by rank of "
        f"the exchange: {shown}); every rank must pass the same number of elements. Nothing "
        "was changed."
    )


@torch.library.custom_op("fn::checked_scales", mutates_args=())
def _checked_scales_op(received: torch.Tensor, n: int, what: str) -> torch.Tensor:
    _raise_on_mismatch(received, n, what)
    return received[..., :-2].clone()


@_checked_scales_op.register_fake
def _(received, n, what):
    return received.new_empty(*received.shape[:-1], received.shape[-1] - 2)


@_checked_scales_op.register_vmap
def _(info, in_dims, received, n, what):
    del info
    if in_dims[0] is None:
        return _checked_scales_op(received, n, what), None
    return _checked_scales_op(received.movedim(in_dims[0], 0), n, what), 0
