"""One fragment of Streaming DiLoCo's parameters: its parameters, its slice of the anchor, its
outer state and its exchange in flight (docs/algorithms.md, "Streaming fragments and delay")."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from fn.base import GradientTransformation, OptState
from fn.collectives import Comm, local_shard
from fn.diloco.exchange import BackgroundExchange, Exchanger
from fn.diloco.step import OuterStep, outer_update, pseudo_gradient

__all__ = ["Flight", "Fragment", "anchor_on"]


class Flight(NamedTuple):
    """A fragment's exchange, started and not yet applied.

    Attributes:
        started_at: the inner step it started after.
        delta: this rank's pseudo-gradient of the fragment (fp32 local tensors).
        exchange: the exchange, whose result is an :class:`~fn.diloco.OuterStep` and what the
            exchange's ``then`` returned.
        takes_part: ``[]`` bool, whether this rank takes part, as decided when it started.
        buffers: the model's buffer values the exchange sends (``[]``: none).
        trainable: the positions in ``model.parameters()`` of the parameters that required
            grad when it started.
    """

    started_at: int
    delta: list[torch.Tensor]
    exchange: BackgroundExchange[tuple[OuterStep, Any]]
    takes_part: torch.Tensor
    buffers: list[torch.Tensor]
    trainable: tuple[int, ...] = ()


def anchor_on(anchor: Sequence[torch.Tensor], shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The anchor on its parameters' devices, where the outer step runs (the anchor may live on
    another device, e.g. in CPU memory).

    Args:
        anchor: one tensor per parameter shard.
        shards: this rank's parameter shards.

    Returns:
        Each anchor tensor on its shard's device (itself where it is there already).

    Example:
        >>> anchor_on([torch.zeros(2)], [torch.ones(2)])
        [tensor([0., 0.])]
    """
    return [a.to(q.device) for a, q in zip(anchor, shards, strict=True)]


class Fragment:
    """Fragment ``index`` of the parameters.

    Args:
        index: ``p``, its place in the schedule.
        indices: its parameters' indices into the synced parameters (sorted).
        params: its parameters (``DTensor`` s where the workers are sharded).
        anchor: its slice of the anchor, one local tensor per parameter (the anchor list's own
            tensors: written in place).
        rule: its outer rule, whose initial state it starts from (:meth:`fresh_state`).

    Attributes:
        index, indices, params, anchor: as given.
        state: its outer rule's state (replaced at every step).
        flight: its exchange in flight, or ``None``.
        steps: its outer steps so far.

    Example:
        >>> from fn.collectives import Local
        >>> from fn.diloco.fragment import Fragment
        >>> rule = fn.diloco.nesterov(fn.diloco.compression("fp32", comm=Local()))
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> fragment = Fragment(0, [0], [w], [torch.zeros(2)], rule)
        >>> fragment.size(), fragment.pseudo_gradient()
        (2, [tensor([-1., -1.])])
    """

    def __init__(
        self,
        index: int,
        indices: list[int],
        params: list[torch.Tensor],
        anchor: list[torch.Tensor],
        rule: GradientTransformation,
    ) -> None:
        self.index = index
        self.indices = indices
        self.params = params
        self.anchor = anchor
        self.state = self.fresh_state(rule)
        self.flight: Flight | None = None
        self.steps = 0

    def shards(self) -> list[torch.Tensor]:
        """This rank's part of the parameters (views: writing them writes the parameters)."""
        return [local_shard(q.detach()) for q in self.params]

    def size(self) -> int:
        """The elements of this rank's part of the fragment."""
        return sum(x.numel() for x in self.shards())

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """``anchor - params`` of this rank's part, fp32, on the parameters' devices."""
        shards = self.shards()
        return pseudo_gradient(anchor_on(self.anchor, shards), shards)

    def fresh_state(self, rule: GradientTransformation) -> OptState:
        """``rule``'s initial state for this fragment, on the parameters' devices, where the
        outer step runs (also where the anchor lives on another device)."""
        return rule.init(anchor_on(self.anchor, self.shards()))

    def start(
        self,
        exchanger: Exchanger,
        rule: GradientTransformation,
        *,
        started_at: int,
        takes_part: torch.Tensor,
        header: Mapping[str, int],
        delta: list[torch.Tensor] | None = None,
        background: bool | None = None,
        then: Callable[[OuterStep, Comm, Sequence[Comm]], Any] | None = None,
        buffers: Sequence[torch.Tensor] = (),
        trainable: Sequence[int] = (),
    ) -> None:
        """Takes the pseudo-gradient (or resumes with ``delta``) and starts the exchange
        (:func:`fn.diloco.outer_update`) through ``exchanger``; ``then(result, comm, within)``
        runs after it, on its thread (further collectives of the same step). ``takes_part``,
        ``buffers`` (the buffer values ``then`` sends) and ``trainable`` (the positions of the
        parameters that required grad) are kept with the flight for a checkpoint."""
        shards = self.shards()
        anchor = anchor_on(self.anchor, shards)
        delta = pseudo_gradient(anchor, shards) if delta is None else delta
        state = self.state

        def run(comm, within):
            result = outer_update(
                rule, anchor, delta, state, comm=comm, within=within, takes_part=takes_part,
                header=header,
            )  # fmt: skip
            return result, None if then is None else then(result, comm, within)

        what = f"DiLoCo: the outer exchange of fragment {self.index} (started after inner step "
        exchange = exchanger.start(
            run, background=background, device=shards[0].device, what=f"{what}{started_at})"
        )
        self.flight = Flight(
            started_at, delta, exchange, takes_part, list(buffers), tuple(trainable)
        )

    def finish(self) -> tuple[OuterStep, Any, int]:
        """Waits for the exchange in flight; returns its result, what its ``then`` returned
        and the inner step it started after. The fragment has no exchange in flight
        afterwards, also where it raised."""
        flight, self.flight = self.flight, None
        return (*flight.exchange.result(), flight.started_at)

    def extend(
        self,
        indices: list[int],
        params: list[torch.Tensor],
        anchor: list[torch.Tensor],
        rule: GradientTransformation,
    ) -> None:
        """Adds parameters, each at its place by ``indices`` (into the synced parameters, as
        this fragment's own ``indices``, which stay sorted): their anchor, and their part of
        the outer state fresh; the rest of the state moves with its parameter (leaf by leaf)."""
        before = len(self.params)
        joined = (self.indices + indices, self.params + params, self.anchor + anchor)
        order = sorted(range(len(joined[0])), key=joined[0].__getitem__)
        self.indices, self.params, self.anchor = ([xs[k] for k in order] for xs in joined)
        sources = [k if k < before else None for k in order]
        self.state = _moved(self.state, self.fresh_state(rule), sources)

    @torch.no_grad()
    def commit(self, result: OuterStep, *, mix: float, takes_part: bool) -> None:
        """Applies ``result``: the new anchor and outer state, and the parameters: a
        participant's ``(1 - mix) anchor + mix params`` in fp32 (the anchor where ``mix`` is
        0), a sitter's the anchor."""
        for anchor, param, new in zip(self.anchor, self.shards(), result.anchor, strict=True):
            anchor.copy_(new)
            if takes_part and mix > 0:
                param.copy_(new.float() * (1.0 - mix) + param.float() * mix)
            else:
                param.copy_(new)
        self.state = result.state
        self.steps += 1

    @torch.no_grad()
    def reset(self) -> None:
        """Sets this rank's parameters to the anchor."""
        for anchor, param in zip(self.anchor, self.shards(), strict=True):
            param.copy_(anchor)


def _moved(old: OptState, fresh: OptState, sources: list[int | None]) -> OptState:
    """``fresh``, a rule's state of the parameters after :meth:`Fragment.extend`, with each leaf
    that ``old`` holds taken from it: the new parameter ``j``'s leaves from the old parameter
    ``sources[j]`` (none where ``sources[j]`` is ``None``: a parameter that joined), the
    others (step counts) from the same path."""
    kept = dict(pytree.tree_flatten_with_path(old)[0])
    leaves, spec = pytree.tree_flatten_with_path(fresh)
    return pytree.tree_unflatten(
        [kept.get(_old_path(path, fresh, sources), leaf) for path, leaf in leaves], spec
    )


def _old_path(path: tuple, fresh: OptState, sources: list[int | None]) -> tuple | None:
    """Where the leaf at ``path`` in ``fresh`` sits in the old state: a rule keeps a per
    parameter leaf in a list with one entry per parameter (``tree_map`` over the anchor list),
    whose entry ``j`` was entry ``sources[j]``; ``None`` where it is a joined parameter's."""
    out, node = [], fresh
    for key in path:
        per_parameter = type(node) is list and len(node) == len(sources)
        node = key.get(node)
        if per_parameter:
            if sources[key.idx] is None:
                return None
            key = pytree.SequenceKey(sources[key.idx])
        out.append(key)
    return tuple(out)
