"""The forms of the 1-bit family's state, and the functions that read and check them.

1-bit Adam and 1-bit LAMB change the form of their state with the phase: the error feedback is
``None`` until the first compressed update allocates it (``_leafwise.error_feedback``), and
from then on the momentum is kept as the 1-bit allreduce returned it, a
:class:`~fn.collectives.PackedSigns` (per leaf for 1-bit Adam, one for all leaves fused for
1-bit LAMB). Any form is a valid state at any update count: the updates read either.

- :func:`momentum`, :func:`fused_momentum`, :func:`momentum_of`: the fp32 momentum of a leaf,
  of a fused slice, of a whole state, read back exactly;
- :func:`kept_momentum`: the form a compressed mean is kept in;
- :func:`checked_state` and :func:`full_state`: the optimizers' ``check_state`` (a state from a
  checkpoint) and ``full_state`` (one layout at every count, for DCP), which read the level and
  the storage of the error feedback in the family's :class:`OnebitSettings`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fn import collectives, kernels
from fn.collectives import PackedSigns
from fn.tree import PyTree, live_leaves


class OnebitSettings(NamedTuple):
    """The hyperparameters that the 1-bit family's rules and fast steps share."""

    comm: Any  # the fn.collectives Comm
    b1: float  # the momentum's beta
    b2: float  # the variance's beta
    eps: float  # added to sqrt(v)
    clip: float | None  # the safeguard's bound on m / (sqrt(v) + eps); None: safeguard off
    weight_decay: float  # L2, added to the direction
    local_world_size: int | None = None  # ranks per node of the 1-bit allreduce; None: flat
    error_dtype: torch.dtype = torch.float32  # the storage of the error feedback

    def zero_errors(self, numel: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The worker and server errors, zero, of a 1-bit allreduce of ``numel`` elements at
        this level, in ``error_dtype`` (``fn.collectives.init_error_feedback``)."""
        level = dict(comm=self.comm, local_world_size=self.local_world_size, dtype=self.error_dtype)
        return collectives.init_error_feedback(numel, **level, device=device)


def momentum(
    kept: torch.Tensor | PackedSigns, like: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 momentum of a leaf as the state keeps it: a tensor is the momentum itself; a
    :class:`~fn.collectives.PackedSigns` (the 1-bit allreduce's result) is unpacked into
    ``like``'s shape and multiplied by ``mask`` (``exp_avg_mask``) where given, the bits the
    momentum had when the allreduce returned it."""
    if not isinstance(kept, PackedSigns):
        return kept
    m = kept.unpacked(like)
    return m if mask is None else m * mask


def masks_of(exp_avg_mask: Any, state: Any) -> PyTree | None:
    """The optimizer's masks: ``exp_avg_mask`` itself, or for ``"auto"`` the masks of the
    record in ``state.auto`` (fp32, like the variance: 0 where the averaged gradient was exactly
    0 at every warmup update, 1 elsewhere; the record is complete at the freeze)."""
    if not isinstance(exp_avg_mask, str):
        return exp_avg_mask
    walk = live_leaves(state.exp_avg_sq, state.auto.always_zero)
    masks = [
        (kernels.unpackbits(record, v.numel()) < 0).to(torch.float32).view_as(v)
        for v, record in zip(walk.at_live(0), walk.at_live(1), strict=True)
    ]
    return walk.rebuild(masks)


def fused_momentum(
    mean: torch.Tensor, scaling: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """A leaf's momentum from its slice of a fused 1-bit allreduce of scaled momenta (1-bit
    LAMB): divided by its scaling coefficient, times its mask."""
    m = mean / scaling
    return m if mask is None else m * mask


def momentum_of(state: Any, exp_avg_mask: PyTree | None = None) -> PyTree:
    """Every leaf's fp32 momentum ``m`` in a state of the 1-bit family, a tree like the params.

    ``state.exp_avg`` where it holds tensors; where it holds the packed signs of a 1-bit
    allreduce (``fn.collectives.PackedSigns``), read back exactly: per leaf (1-bit Adam:
    signs times scales times ``exp_avg_mask``), or one for all leaves fused (1-bit LAMB: each
    leaf's slice divided by its ``scaling_coeff``, times its mask).

    Args:
        state: a state of ``fn.onebit_adam``, ``fn.zero_one_adam`` or ``fn.onebit_lamb``.
        exp_avg_mask: the optimizer's ``exp_avg_mask`` (``None``: none; ``"auto"``: the mask
            recorded in the state).

    Returns:
        A tree like the params of fp32 tensors (``None`` where a param is ``None``).

    Example:
        >>> from fn.collectives import Simulated, replicate, simulate
        >>> comm = Simulated(2)
        >>> opt = fn.onebit_adam(lr=0.1, freeze_step=2, comm=comm)
        >>> state = replicate(opt.init({"w": torch.zeros(3)}), comm)
        >>> update = simulate(opt.update, comm)
        >>> grads = {"w": torch.tensor([[1.0, -2.0, 3.0], [3.0, -2.0, 1.0]])}
        >>> for t in (1, 2):
        ...     _, state = update(grads, state, step=t)
        >>> type(state.exp_avg["w"]).__name__
        'PackedSigns'
        >>> simulate(fn.transforms.momentum_of, comm)(state)["w"][0]
        tensor([ 0.1683, -0.1683,  0.1683])
    """
    exp_avg_mask = masks_of(exp_avg_mask, state)
    if isinstance(state.exp_avg, PackedSigns) and hasattr(state, "scaling_coeff"):  # fused
        walk = live_leaves(state.exp_avg_sq, state.scaling_coeff, exp_avg_mask)
        sizes = [v.numel() for v in walk.at_live(0)]
        pieces = state.exp_avg.values(sum(sizes)).split(sizes)
        columns = zip(pieces, *(walk.at_live(k) for k in range(3)), strict=True)
        return walk.rebuild([fused_momentum(x.view_as(v), s, mask) for x, v, s, mask in columns])
    walk = live_leaves(state.exp_avg_sq, state.exp_avg, exp_avg_mask)
    columns = zip(*(walk.at_live(k) for k in range(3)), strict=True)
    momenta = [momentum(m, v, mask) for v, m, mask in columns]
    return walk.rebuild(momenta)


def checked_state(name: str, h: OnebitSettings, state: Any) -> Any:
    """``CompressedOptimizer.check_state`` of the 1-bit family: checks the forms of a state
    from a checkpoint against its variance (the params' shapes) and ``h``'s level, and
    returns it with the error feedback in ``h.error_dtype``.

    Per leaf: the momentum ``exp_avg`` is an fp32 tensor of the param's shape or a
    :class:`~fn.collectives.PackedSigns` (uint8 rows, one fp32 scale each) holding at least its
    elements (1-bit LAMB: one for all leaves); the fresh variance (1-bit LAMB) ``None`` or fp32
    of the param's shape; the errors ``None`` (allocated when needed) or of the shapes
    ``fn.collectives.init_error_feedback`` gives, per leaf or, where the error field is one
    tensor, for all leaves.

    Raises:
        ValueError: naming the field and what it holds.
    """
    fused_signs = isinstance(state.exp_avg, PackedSigns)
    momenta = None if fused_signs else state.exp_avg
    walk = live_leaves(state.exp_avg_sq, momenta, getattr(state, "exp_avg_sq_fresh", None))
    variances = walk.at_live(0)
    total = sum(v.numel() for v in variances)
    if fused_signs:
        _check_packed(name, "exp_avg", state.exp_avg, total)
    else:
        for v, m in zip(variances, walk.at_live(1), strict=True):
            if isinstance(m, PackedSigns):
                _check_packed(name, "exp_avg", m, v.numel())
            else:
                _check_like(name, "exp_avg", m, v)
    if hasattr(state, "exp_avg_sq_fresh"):
        for v, fresh in zip(variances, walk.at_live(2), strict=True):
            if fresh is not None:
                _check_like(name, "exp_avg_sq_fresh", fresh, v)
    fused = state.worker_error is None or isinstance(state.worker_error, torch.Tensor)
    if fused:
        errors = _checked_errors(name, h, state.worker_error, state.server_error, total)
        return state._replace(worker_error=errors[0], server_error=errors[1])
    errors = _per_leaf_errors(state, lambda v, ew, es: _checked_errors(name, h, ew, es, v.numel()))
    return state._replace(**errors)


def full_state(
    h: OnebitSettings,
    exp_avg_mask: PyTree | None,
    state: Any,
    never_compressed: PyTree | None = None,
) -> Any:
    """``CompressedOptimizer.full_state`` of the 1-bit family: the momentum as fp32 tensors
    (:func:`momentum_of`), the error feedback allocated (zeros where ``None``, per leaf or for
    all leaves as :func:`checked_state` reads it) except at the leaves ``never_compressed``
    marks (1-bit Adam's ``non_freeze``: fixed when the optimizer is built, so the layout is
    too), and the fresh variance of 1-bit LAMB a copy of the variance where it is ``None``
    (unused until the last warmup update sets it)."""
    walk = live_leaves(state.exp_avg_sq, never_compressed)
    variances = walk.at_live(0)
    skipped = [bool(s) for s in walk.at_live(1)]
    total = sum(v.numel() for v in variances)
    fields = {"exp_avg": momentum_of(state, exp_avg_mask)}
    if hasattr(state, "exp_avg_sq_fresh"):
        fresh = live_leaves(state.exp_avg_sq, state.exp_avg_sq_fresh)
        copies = [
            v.clone() if f is None else f
            for v, f in zip(*(fresh.at_live(k) for k in (0, 1)), strict=True)
        ]
        fields["exp_avg_sq_fresh"] = fresh.rebuild(copies, fill=1)
    if state.worker_error is None and not (skipped and all(skipped)):
        errors = h.zero_errors(total, variances[0].device if variances else None)
        fields.update(worker_error=errors[0], server_error=errors[1])
    elif state.worker_error is not None and not isinstance(state.worker_error, torch.Tensor):

        def allocated(v, ew, es, skip):
            return h.zero_errors(v.numel(), v.device) if ew is None and not skip else (ew, es)

        fields.update(_per_leaf_errors(state, allocated, skipped))
    return state._replace(**fields)


def _per_leaf_errors(state: Any, pair_of: Callable[..., tuple], *columns: list) -> dict[str, Any]:
    """The error fields of ``state``, kept per leaf: ``pair_of(v, worker, server, *column_j)``
    at each leaf ``j`` with a variance ``v`` (``columns``: one entry per such leaf)."""
    walk = live_leaves(state.exp_avg_sq, state.worker_error, state.server_error)
    leaves = zip(*(walk.at_live(k) for k in range(3)), *columns, strict=True)
    pairs = [pair_of(*leaf) for leaf in leaves]
    return {
        "worker_error": walk.rebuild([pair[0] for pair in pairs], fill=1),
        "server_error": walk.rebuild([pair[1] for pair in pairs], fill=2),
    }


def _check_like(name: str, field: str, x: Any, like: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.shape != like.shape or x.dtype != torch.float32:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: {field} holds {got}, not fp32 of shape {tuple(like.shape)}")


def _check_packed(name: str, field: str, x: PackedSigns, numel: int) -> None:
    packed, scales = x
    if (
        not isinstance(packed, torch.Tensor)
        or not isinstance(scales, torch.Tensor)
        or packed.dtype != torch.uint8
        or packed.dim() != 2
        or scales.dtype != torch.float32
        or tuple(scales.shape) != (packed.shape[0],)
        or packed.numel() * 8 < numel
    ):
        raise ValueError(
            f"{name}: {field} holds packed signs that are not uint8 rows [R, chunk / 8] with "
            f"fp32 scales [R] for at least {numel} elements"
        )


def _checked_errors(
    name: str, h: OnebitSettings, worker: Any, server: Any, numel: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A leaf's error pair in ``h.error_dtype``, checked to be ``None`` or of its shapes."""
    if worker is None and server is None:
        return None, None
    want = h.zero_errors(numel, "meta")  # their shapes
    for field, x, like in (("worker_error", worker, want[0]), ("server_error", server, want[1])):
        if not isinstance(x, torch.Tensor) or x.shape != like.shape or not x.is_floating_point():
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else "None"
            raise ValueError(
                f"{name}: {field} has {got}, the error feedback of {numel} elements here has "
                f"shape {tuple(like.shape)}"
            )
    return worker.to(h.error_dtype), server.to(h.error_dtype)


def kept_momentum(
    mean: torch.Tensor | PackedSigns, like: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor | PackedSigns, torch.Tensor]:
    """The momentum that a compressed mean gives (:func:`compressed_mean` with ``packed``),
    as the state keeps it and as an fp32 tensor: packed signs are kept as they arrive (the
    mask applies when they are read, :func:`momentum`); a tensor (nothing was compressed) is
    kept with the mask applied."""
    if isinstance(mean, PackedSigns):
        return mean, momentum(mean, like, mask)
    m = mean if mask is None else mean * mask
    return m, m
