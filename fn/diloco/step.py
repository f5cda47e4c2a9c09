"""One outer step on one rank: the pseudo-gradient, the ranks' agreement that it is finite, the
outer rule, and the new anchor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from fn.base import GradientTransformation, OptState, Params, apply_updates
from fn.collectives import Comm, Compressor
from fn.tree import tree_leaves, tree_map

__all__ = ["OuterStep", "pseudo_gradient", "outer_step", "outer_update"]


class OuterStep(NamedTuple):
    """What :func:`outer_step` returns.

    Attributes:
        anchor: the new anchor (the params every rank continues from), each leaf in its
            param's dtype.
        state: the outer rule's new state.
        applied: ``[]`` bool tensor, ``False`` where some rank's pseudo-gradient was not finite
            and the step was skipped (the anchor and the state then come back unchanged); the
            same on every rank.

    Example:
        >>> from fn.collectives import Local
        >>> outer = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=Local()))
        >>> anchor, params = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
        >>> step = fn.diloco.outer_step(outer, anchor, params, outer.init(anchor), comm=Local())
        >>> step.anchor["w"], bool(step.applied)  # 0 - 0.7 (d + 0.9 d) with d = 0 - 1
        (tensor([1.3300, 1.3300]), True)
    """

    anchor: Params
    state: OptState
    applied: torch.Tensor


def pseudo_gradient(anchor: Params, params: Params) -> Params:
    """``anchor - params`` per leaf, in fp32: how far this rank moved, as a gradient.

    Args:
        anchor: the params at the last outer step.
        params: this rank's params now (``None`` leaves stay ``None``).

    Returns:
        The pseudo-gradient, fp32 leaves.

    Example:
        >>> fn.diloco.pseudo_gradient({"w": torch.ones(2)}, {"w": torch.tensor([0.5, 2.0])})
        {'w': tensor([ 0.5000, -1.0000])}
    """
    return tree_map(lambda p, a: a.float() - p.float(), params, anchor)


def outer_step(
    outer: GradientTransformation,
    anchor: Params,
    params: Params,
    state: OptState,
    *,
    comm: Comm,
    within: Sequence[Comm] = (),
) -> OuterStep:
    """One outer step of DiLoCo on this rank: the new anchor from every rank's pseudo-gradient.

    1. ``delta = anchor - params`` in fp32 (:func:`pseudo_gradient`).
    2. The ranks agree on whether every ``delta`` is finite: an allreduce of this rank's count
       of non-finite values (one fp32 value) over ``comm``, then over each group of ``within``.
    3. ``updates, state = outer.update(delta, state, anchor)``: the outer rule, which
       communicates through its compressor; ``updates`` are the same on every rank.
    4. ``anchor + updates`` (``fn.apply_updates``), each leaf rounded to its dtype.

    Where some rank's ``delta`` is not finite, every rank skips the step: the rule runs on zeros
    (every rank sends the same messages) and its results are dropped, so the anchor and the
    state come back unchanged, bit for bit, and ``applied`` is ``False``. The caller then
    continues every rank from the returned anchor (``params <- anchor``). Pure; runs under
    ``Simulated`` (``simulate``) as on ``Local`` and ``ProcessGroup``.

    Args:
        outer: the outer rule (``fn.diloco.nesterov``, ``fn.diloco.sparseloco``), whose input is
            this rank's pseudo-gradient.
        anchor: the anchor, the same on every rank.
        params: this rank's params after its inner steps (the anchor's structure).
        state: ``outer``'s state.
        comm: the group of workers (the one ``outer``'s compressor uses).
        within: where each worker is sharded over several ranks, the groups inside a worker
            (one per dimension of its device mesh): the count of non-finite values is summed
            over them too, so that every rank of every worker, at every shard position, applies
            or skips the step together. Empty: one rank per worker.

    Returns:
        An :class:`OuterStep`, with the new anchor, the new state and whether the step was
        applied.

    Example:
        >>> from fn.collectives import Simulated, replicate, simulate
        >>> comm = Simulated(2)
        >>> outer = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=comm), 1.0, 0.0)
        >>> anchor = replicate({"w": torch.zeros(2)}, comm)
        >>> params = {"w": torch.tensor([[1.0, 2.0], [3.0, float("nan")]])}  # rank 1 diverged
        >>> state = simulate(outer.init, comm)(anchor)
        >>> step = simulate(lambda *a: fn.diloco.outer_step(outer, *a, comm=comm), comm)
        >>> skipped = step(anchor, params, state)
        >>> skipped.anchor["w"], skipped.applied
        (tensor([[0., 0.],
                [0., 0.]]), tensor([False, False]))
        >>> params["w"][1, 1] = 4.0
        >>> step(anchor, params, state).anchor["w"]  # lr 1, no momentum: the mean
        tensor([[2., 3.],
                [2., 3.]])
    """
    delta = pseudo_gradient(anchor, params)
    return outer_update(outer, anchor, delta, state, comm=comm, within=within)


def outer_update(
    outer: GradientTransformation,
    anchor: Params,
    delta: Params,
    state: OptState,
    *,
    comm: Comm,
    within: Sequence[Comm] = (),
) -> OuterStep:
    """Steps 2 to 4 of :func:`outer_step` on a pseudo-gradient taken earlier: the ranks'
    agreement that it is finite, the outer rule and the new anchor.

    Streaming DiLoCo takes a fragment's ``delta`` after one inner step and runs this exchange
    while later inner steps go on (``DiLoCo(..., delay=tau)``).
    ``outer_step(outer, anchor, params, state, comm=comm, within=within)`` is
    ``outer_update(outer, anchor, pseudo_gradient(anchor, params), state, comm=comm,
    within=within)``.

    Args:
        outer: the outer rule.
        anchor: the anchor, the same on every rank.
        delta: this rank's pseudo-gradient (:func:`pseudo_gradient`), fp32.
        state: ``outer``'s state.
        comm: the group of workers.
        within: the groups inside a sharded worker (:func:`outer_step`).

    Returns:
        An :class:`OuterStep`.

    Example:
        >>> from fn.collectives import Local
        >>> outer = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=Local()), 1.0, 0.0)
        >>> anchor = {"w": torch.zeros(2)}
        >>> delta = fn.diloco.pseudo_gradient(anchor, {"w": torch.tensor([1.0, 2.0])})
        >>> fn.diloco.outer_update(outer, anchor, delta, outer.init(anchor), comm=Local()).anchor
        {'w': tensor([1., 2.])}
    """
    counts = [(~torch.isfinite(d)).sum() for d in tree_leaves(delta)]
    count = torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
    count = count.float().reshape(1)
    if isinstance(outer, Compressor):  # the agreement rides in the messages' headers
        for group in within:  # the worker's ranks first: its flag is the same at every shard
            count = group.all_reduce(count, op="sum")
        flag = count[0] == 0
        safe = tree_map(lambda d: torch.where(flag, d, 0.0), delta)
        updates, new_state, flags = outer.exchange(safe, state, flag, anchor)
        applied = flags.all()
        for group in within:  # a step applied at one shard position is applied at all
            applied = group.all_reduce((~applied).float().reshape(1), op="sum")[0] == 0
    else:
        for group in (comm, *within):
            count = group.all_reduce(count, op="sum")
        applied = count[0] == 0
        safe = tree_map(lambda d: torch.where(applied, d, 0.0), delta)
        updates, new_state = outer.update(safe, state, anchor)
    new_anchor = apply_updates(anchor, updates)
    return OuterStep(_kept(applied, new_anchor, anchor), _kept(applied, new_state, state), applied)


def _kept(applied: torch.Tensor, new: object, old: object) -> object:
    """``new`` where ``applied``, else ``old``, leaf by leaf (the bits of the one chosen)."""
    return tree_map(
        lambda a, b: torch.where(applied, a, b) if isinstance(a, torch.Tensor) else a, new, old
    )
