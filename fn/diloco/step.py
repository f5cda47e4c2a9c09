"""One outer step on one rank: the pseudo-gradient, the workers' agreement on who takes part,
the outer rule over the participants, and the new anchor.

The interface (``outer_update``'s ``takes_part`` and ``header``, ``OuterStep.participants``) is
stable: ``fn.diloco``'s elastic and sparse exchanges build on it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from fn.base import GradientTransformation, OptState, Params, apply_updates
from fn.collectives import Comm, Compressor, Participation
from fn.collectives.participation import sent
from fn.diloco.participation import agree_on_participation, check_headers
from fn.tree import eager, tree_all_finite, tree_leaves, tree_map

__all__ = ["OuterStep", "pseudo_gradient", "outer_step", "outer_update", "trainable_params"]


class OuterStep(NamedTuple):
    """What :func:`outer_step` returns.

    Attributes:
        anchor: the new anchor (the params every rank continues from), each leaf in its
            param's dtype.
        state: the outer rule's new state.
        applied: ``[]`` bool tensor, ``False`` where no worker took part and the step was
            skipped (the anchor and the state then come back unchanged); the same on every
            rank.
        participants: ``[W]`` bool tensor, the workers that took part (a worker sits out where
            its pseudo-gradient was not finite or it said it does not take part; none did where
            the participants' mean or the rule's update overflowed, so that the new anchor was
            not finite); the same on every rank.

    Example:
        >>> from fn.collectives import Local
        >>> outer = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=Local()))
        >>> anchor, params = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
        >>> step = fn.diloco.outer_step(outer, anchor, params, outer.init(anchor), comm=Local())
        >>> step.anchor["w"], bool(step.applied)  # 0 - 0.7 (d + 0.9 d) with d = 0 - 1
        (tensor([1.3300, 1.3300]), True)
        >>> step.participants
        tensor([True])
    """

    anchor: Params
    state: OptState
    applied: torch.Tensor
    participants: torch.Tensor


def pseudo_gradient(anchor: Params, params: Params) -> Params:
    """``anchor - params`` per leaf, in fp32: how far this rank moved, as a gradient.

    Args:
        anchor: the params at the last outer step.
        params: this rank's params now (``None`` leaves stay ``None``).

    Returns:
        The pseudo-gradient, fp32 leaves.

    Raises:
        TypeError: a leaf is not a real floating-point tensor (fp32 would drop a complex
            one's imaginary part).

    Example:
        >>> fn.diloco.pseudo_gradient({"w": torch.ones(2)}, {"w": torch.tensor([0.5, 2.0])})
        {'w': tensor([ 0.5000, -1.0000])}
    """
    for leaf in tree_leaves(params):
        if leaf is not None:
            _check_real(leaf.dtype, "pseudo_gradient: a leaf")
    return tree_map(lambda p, a: a.float() - p.float(), params, anchor)


def trainable_params(model: torch.nn.Module, who: str) -> list[torch.Tensor]:
    """The parameters of ``model`` that require grad, in ``model.parameters()`` order: those
    an outer step syncs.

    Args:
        model: the worker's model.
        who: the caller's name, which starts the error's message.

    Returns:
        The trainable parameters.

    Raises:
        TypeError: one is not real floating-point (a complex parameter: register it as
            ``torch.view_as_real`` of itself).

    Example:
        >>> len(fn.diloco.trainable_params(torch.nn.Linear(2, 2), "example"))
        2
    """
    params = [p for p in model.parameters() if p.requires_grad]
    for i, p in enumerate(params):
        _check_real(p.dtype, f"{who}: trainable parameter {i}")
    return params


def _check_real(dtype: torch.dtype, what: str) -> None:
    if not dtype.is_floating_point:
        raise TypeError(
            f"{what} is {dtype}: the outer step averages real floating-point values (a complex "
            "parameter can be registered as torch.view_as_real of itself)"
        )


def outer_step(
    outer: GradientTransformation,
    anchor: Params,
    params: Params,
    state: OptState,
    *,
    comm: Comm,
    within: Sequence[Comm] = (),
    takes_part: bool | torch.Tensor = True,
    header: Mapping[str, int] | None = None,
) -> OuterStep:
    """One outer step of DiLoCo on this rank: the new anchor from the pseudo-gradients of the
    workers that take part.

    1. ``delta = anchor - params`` in fp32 (:func:`pseudo_gradient`).
    2. Participation: this rank takes part where ``takes_part`` and every value of ``delta``
       is finite; a worker takes part where all its ranks do (summed over ``within``). Where
       ``outer`` is a ``fn.collectives.Compressor`` (every compressor of
       ``fn.diloco.compression``), the worker's flag and ``header``'s values
       ride in the header of the compressor's first message, and every rank reads the mask
       ``m`` there (fn/collectives/header.py: no collective of its own); else the workers agree
       on it first, in one all-gather over ``comm`` (``agree_on_participation`` of
       fn/diloco/participation.py). Either way, with ``header``, every rank checks that every
       worker is at the same exchange. ``n = sum(m)``.
    3. ``updates, state = outer.update(delta', state, anchor, participation=...)``: the outer
       rule, whose compressor averages over the ``n`` participants (``delta' = delta`` where
       this worker takes part, zeros where it sits out: a sitter's message is zero, its error
       feedback kept; ``fn.collectives.Participation``); ``updates`` are the same on every
       rank.
    4. ``anchor + updates`` (``fn.apply_updates``), each leaf rounded to its dtype. Where a
       value of it is not finite (finite pseudo-gradients whose mean or update overflows; a
       sharded worker's ranks agree over ``within``), no worker took part: ``m = 0``.

    Where ``n = 0`` every rank skips the step: the rule runs on zeros (every rank sends the
    same messages) and its results are dropped, so the anchor and the state come back
    unchanged, bit for bit, and ``applied`` is ``False``. Where every worker takes part the
    bits are those of the plain mean over ``W``. The caller then continues every rank from the
    returned anchor (``params <- anchor``; a sitter's own progress is lost). Pure; runs under
    ``Simulated`` (``simulate``) as on ``Local`` and ``ProcessGroup``.

    Args:
        outer: the outer rule (``fn.diloco.nesterov``, ``fn.diloco.sparseloco``), whose input is
            this rank's pseudo-gradient.
        anchor: the anchor, the same on every rank.
        params: this rank's params after its inner steps (the anchor's structure).
        state: ``outer``'s state.
        comm: the group of workers (the one ``outer``'s compressor uses).
        within: where each worker is sharded over several ranks, the groups inside a worker
            (one per dimension of its device mesh): the flag is agreed over them too, so that
            every rank of every worker, at every shard position, sees the same participants.
            Empty: one rank per worker.
        takes_part: whether this rank offers its pseudo-gradient (a bool, or a ``[]`` bool
            tensor: per rank under ``Simulated``); ``False`` makes its worker sit out whatever
            its values (e.g. a worker that is recovering).
        header: what every worker must agree on about this exchange (name -> int, e.g. the
            inner step and the fragment), checked in the participation's all-gather.

    Returns:
        An :class:`OuterStep`, with the new anchor, the new state, whether the step was
        applied and the participants.

    Raises:
        ValueError: (on every rank) the workers' headers differ; nothing was changed.

    Example:
        >>> from fn.collectives import Simulated, replicate, simulate
        >>> comm = Simulated(2)
        >>> outer = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=comm), 1.0, 0.0)
        >>> anchor = replicate({"w": torch.zeros(2)}, comm)
        >>> params = {"w": torch.tensor([[1.0, 2.0], [3.0, float("nan")]])}  # rank 1 diverged
        >>> state = simulate(outer.init, comm)(anchor)
        >>> step = simulate(lambda *a: fn.diloco.outer_step(outer, *a, comm=comm), comm)
        >>> result = step(anchor, params, state)  # rank 1 sits out: the mean of rank 0's
        >>> result.anchor["w"], result.participants[0]
        (tensor([[1., 2.],
                [1., 2.]]), tensor([ True, False]))
        >>> params["w"][1, 1] = 4.0
        >>> step(anchor, params, state).anchor["w"]  # lr 1, no momentum: the mean
        tensor([[2., 3.],
                [2., 3.]])
    """
    delta = pseudo_gradient(anchor, params)
    return outer_update(
        outer, anchor, delta, state, comm=comm, within=within, takes_part=takes_part, header=header
    )


def outer_update(
    outer: GradientTransformation,
    anchor: Params,
    delta: Params,
    state: OptState,
    *,
    comm: Comm,
    within: Sequence[Comm] = (),
    takes_part: bool | torch.Tensor = True,
    header: Mapping[str, int] | None = None,
) -> OuterStep:
    """Steps 2 to 4 of :func:`outer_step` on a pseudo-gradient taken earlier: the workers'
    agreement on who takes part, the outer rule over the participants and the new anchor.

    .. math::
        m_r = [t_r \\wedge \\delta_r \\text{ finite}], \\quad
        n = \\textstyle\\sum_r m_r, \\quad
        \\bar\\theta' = \\bar\\theta
            + U\\big(\\tfrac{1}{n} \\textstyle\\sum_{r: m_r} \\delta_r\\big)
        \\text{ if } n > 0 \\text{ else } \\bar\\theta

    (``t_r``: rank ``r``'s ``takes_part``; ``U`` the rule after its compressor; where that
    :math:`\\bar\\theta'` is not finite, an overflow, no worker took part: ``m = 0``),
    the mean taken by the rule's compressor (each sitter's message zero, its error
    feedback kept; docs/algorithms.md, "DiLoCo: local steps and a compressed outer step").
    Streaming DiLoCo takes a fragment's ``delta`` after one inner step and runs this exchange
    while later inner steps go on (``DiLoCo(..., delay=tau)``). ``outer_step(outer, anchor,
    params, state, comm=comm)`` is ``outer_update(outer, anchor, pseudo_gradient(anchor,
    params), state, comm=comm)``.

    Args:
        outer: the outer rule.
        anchor: the anchor, the same on every rank.
        delta: this rank's pseudo-gradient (:func:`pseudo_gradient`), fp32.
        state: ``outer``'s state.
        comm: the group of workers.
        within: the groups inside a sharded worker (:func:`outer_step`).
        takes_part: whether this rank offers its pseudo-gradient (:func:`outer_step`).
        header: what every worker must agree on about this exchange (:func:`outer_step`).

    Returns:
        An :class:`OuterStep`.

    Raises:
        ValueError: (on every rank) the workers' headers differ; nothing was changed.

    Example:
        >>> from fn.collectives import Local
        >>> outer = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=Local()), 1.0, 0.0)
        >>> anchor = {"w": torch.zeros(2)}
        >>> delta = fn.diloco.pseudo_gradient(anchor, {"w": torch.tensor([1.0, 2.0])})
        >>> fn.diloco.outer_update(outer, anchor, delta, outer.init(anchor), comm=Local()).anchor
        {'w': tensor([1., 2.])}
    """
    leaves = tree_leaves(delta)
    device = leaves[0].device if leaves else None
    offered = torch.as_tensor(takes_part, dtype=torch.bool, device=device) & tree_all_finite(delta)
    if isinstance(outer, Compressor):  # the agreement rides in the messages' headers
        updates, new_state, participants = _exchanged(
            outer, anchor, delta, state, offered, within, header
        )
    else:  # a rule without headers: the agreement is a collective of its own, first
        participants, mine = agree_on_participation(comm, offered, within=within, header=header)
        participation = Participation(mine, participants.sum())
        safe = sent(delta, participation)
        updates, new_state = outer.update(safe, state, anchor, participation=participation)
    new_anchor = apply_updates(anchor, updates)
    # finite pseudo-gradients whose mean or update overflows: no worker's step can be taken
    participants = participants & tree_all_finite(new_anchor)
    for group in within:  # each rank of a sharded worker checked its own shard
        participants = group.all_reduce((~participants).to(torch.float32), op="sum") == 0
    applied = participants.any()
    return OuterStep(
        _kept(applied, new_anchor, anchor), _kept(applied, new_state, state), applied, participants
    )


def _exchanged(
    outer: Compressor,
    anchor: Params,
    delta: Params,
    state: OptState,
    offered: torch.Tensor,
    within: Sequence[Comm],
    header: Mapping[str, int] | None,
) -> tuple[Params, OptState, torch.Tensor]:
    """The rule's exchange with this worker's flag and ``header``'s values in its messages'
    headers (summed over a sharded worker's ranks first, so that every shard position sends the
    same flag); returns the updates, the new state and the participants, the same at every
    shard position once :func:`outer_update` agrees them over ``within``)."""
    sitting = (~offered).to(torch.float32).reshape(1)
    for group in within:
        sitting = group.all_reduce(sitting, op="sum")
    mine = sitting[0] == 0
    values = list((header or {}).values())
    safe = tree_map(lambda d: torch.where(mine, d, 0.0), delta)
    updates, new_state, participants, extra = outer.exchange(
        safe, state, mine, anchor, extra=values
    )
    if values and eager(extra):
        check_headers(list(header), extra.tolist())
    return updates, new_state, participants


def _kept(applied: torch.Tensor, new: object, old: object) -> object:
    """``new`` where ``applied``, else ``old``, leaf by leaf (the bits of the one chosen)."""
    return tree_map(
        lambda a, b: torch.where(applied, a, b) if isinstance(a, torch.Tensor) else a, new, old
    )
