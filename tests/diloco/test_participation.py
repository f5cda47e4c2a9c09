"""Participation in the outer step, on ``Simulated`` ranks: every compressor of
``fn.diloco.COMPRESSIONS`` and both outer rules average over the workers that take part, against
the loop over workers of _reference.py, bit for bit (their error feedback too: a sitter's as it
was), for one sitter, all but one and none; with every worker taking part, the bits of the call
without participation. Gloo ranks and the wrapper: test_participation_gloo.py."""

from __future__ import annotations

import pytest
import torch

import fn.diloco
from fn.collectives import Participation, Simulated, replicate, simulate
from fn.tree import tree_leaves
from tests.diloco import _reference
from tests.diloco._cases import KINDS, OPTIONS, outer_rule

W = 3
SHAPE = (3, 7)
NAN = float("nan")
# who takes part at each step: all, one sitter, all but one, none, all
MASKS = [[True] * W, [True, False, True], [False, True, False], [False] * W, [True] * W]


class Reference:
    """The compressor ``kind`` over a loop of workers, with its error feedback per worker."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.count = 0
        n = SHAPE[0] * SHAPE[1]
        if kind == "loco4":
            size = fn.collectives.quantized_padded_numel(n, W, OPTIONS["loco4"]["group_size"])
            self.errors = [(torch.zeros(size), torch.zeros(size // W)) for _ in range(W)]
        elif kind == "onebit":
            size = fn.collectives.padded_numel(n, W)
            self.errors = [(torch.zeros(size), torch.zeros(size // W)) for _ in range(W)]
        else:
            self.errors = [torch.zeros(SHAPE) for _ in range(W)]

    def mean(self, xs: list[torch.Tensor], taking: list[bool]) -> torch.Tensor:
        """One call: the mean over the participants; the errors move on."""
        kind, options = self.kind, OPTIONS.get(self.kind, {})
        if kind in ("fp32", "bf16"):
            dtype = torch.float32 if kind == "fp32" else torch.bfloat16
            return _reference.cast_mean(xs, dtype, taking)
        if kind == "int8":
            return _reference.quantized_allreduce(xs, 8, options["group_size"], taking)[0]
        if kind == "loco4":
            reset = self.count % options["reset_T"] == 0
            self.count += 1
            mean, self.errors = _reference.quantized_allreduce(
                xs, 4, options["group_size"], taking, self.errors, options["err_beta"], reset
            )
            return mean
        if kind == "onebit":
            mean, self.errors = _reference.onebit_allreduce(xs, self.errors, taking)
            return mean
        decay = 1.0 if kind == "topk" else 0.95  # SparseLoCo's accumulator
        k, chunk = (options["k"], options["chunk_size"])
        mean, self.errors = _reference.topk_allreduce(xs, self.errors, k, chunk, decay, taking)
        return mean

    def feedback(self) -> list[torch.Tensor]:
        """Every worker's error feedback, as fn's state leaves lay it out (``[W, ...]`` each)."""
        if self.kind in ("fp32", "bf16", "int8"):
            return []
        if isinstance(self.errors[0], tuple):
            return [torch.stack([pair[i] for pair in self.errors]) for i in range(2)]
        return [torch.stack(self.errors)]


def _inputs(steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(W, *SHAPE, generator=g) for _ in range(steps)]


def _feedback_of(state) -> list[torch.Tensor]:
    flags = fn.collectives.error_feedback_leaves(state)
    return [x for x, f in zip(tree_leaves(state), flags, strict=True) if f]


@pytest.mark.parametrize("kind", fn.diloco.COMPRESSIONS)
def test_every_compressor_averages_over_the_participants(kind):
    comm = Simulated(W)
    tx = fn.diloco.compression(kind, comm=comm, **OPTIONS.get(kind, {}))
    reference = Reference(kind)

    def call(x, state, takes, count):
        return tx.update({"w": x}, state, participation=Participation(takes, count))

    step = simulate(call, comm)
    state = simulate(tx.init, comm)({"w": torch.zeros(W, *SHAPE)})
    for mask, x in zip(MASKS[:3] * 2, _inputs(6, seed=1), strict=True):
        x = x.clone()
        x[[r for r in range(W) if not mask[r]]] = NAN  # a sitter's input is not read
        takes = torch.tensor(mask)
        out, state = step(x, state, takes, torch.full((W,), sum(mask)))
        expected = reference.mean(list(x), mask)
        for r in range(W):
            assert torch.equal(out["w"][r], expected), (kind, mask, r)
        for a, b in zip(_feedback_of(state), reference.feedback(), strict=True):
            assert torch.equal(a, b), (kind, mask)


@pytest.mark.parametrize("kind", fn.diloco.COMPRESSIONS)
def test_every_worker_taking_part_is_the_call_without_participation(kind):
    comm = Simulated(W)
    tx = fn.diloco.compression(kind, comm=comm, **OPTIONS.get(kind, {}))
    xs = _inputs(2, seed=2)
    every = Participation(torch.ones(W, dtype=torch.bool), torch.full((W,), W))
    states = [simulate(tx.init, comm)({"w": xs[0]})] * 2
    for x in xs:
        plain = simulate(lambda x, s: tx.update({"w": x}, s), comm)(x, states[0])
        taking = simulate(lambda x, s, p: tx.update({"w": x}, s, participation=p), comm)(
            x, states[1], every
        )
        assert torch.equal(plain[0]["w"], taking[0]["w"]), kind
        old, new = tree_leaves(plain[1]), tree_leaves(taking[1])
        assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True)), kind
        states = [plain[1], taking[1]]


@pytest.mark.parametrize("kind", KINDS)
def test_the_outer_rules_step_over_the_participants(kind):
    """outer_step with NaN pseudo-gradients and ``takes_part=False`` against Nesterov (or
    SparseLoCo) on the reference compressor: the anchor, the momentum, the error feedback."""
    comm = Simulated(W)
    outer = outer_rule(kind, comm)
    reference = Reference("sparseloco" if kind == "sparseloco" else kind)
    anchor = torch.randn(*SHAPE, generator=torch.Generator().manual_seed(3))
    momentum = torch.zeros(SHAPE)
    anchors = replicate({"w": anchor}, comm)
    state = simulate(outer.init, comm)(anchors)
    step = simulate(
        lambda a, p, s, t: fn.diloco.outer_step(outer, a, p, s, comm=comm, takes_part=t), comm
    )
    for s, (mask, drift) in enumerate(zip(MASKS, _inputs(len(MASKS), seed=4), strict=True)):
        params = anchors["w"] + drift
        nan = [r for r in range(W) if not mask[r] and (r + s) % 2]  # NaN, or takes_part=False
        params[nan, 0, 1] = NAN
        offered = torch.tensor([mask[r] or r in nan for r in range(W)])
        result = step(anchors, {"w": params}, state, offered)
        assert result.participants.tolist() == [mask] * W, (kind, s)
        assert result.applied.tolist() == [any(mask)] * W
        if any(mask):
            deltas = [anchor - params[r] for r in range(W)]
            mean = reference.mean(deltas, mask)
            if kind == "sparseloco":  # its default lr 2: twice the mean
                anchor = anchor + mean * torch.tensor(-2.0)
            else:
                momentum = momentum * 0.9 + mean
                anchor = anchor + torch.add(mean, momentum, alpha=0.9) * torch.tensor(-0.7)
        anchors, state = result.anchor, result.state
        for r in range(W):
            assert torch.equal(anchors["w"][r], anchor), (kind, s, r)
        if kind != "sparseloco":
            assert all(torch.equal(state[1][1].trace["w"][r], momentum) for r in range(W))
        for a, b in zip(_feedback_of(state), reference.feedback(), strict=True):
            assert torch.equal(a, b), (kind, s)


@pytest.mark.parametrize(
    "kind, exchange",
    [(kind, "gather") for kind in KINDS] + [("topk", "owner"), ("sparseloco", "owner")],
)
def test_an_overflowing_mean_or_update_is_no_workers_step(kind, exchange):
    """Finite pseudo-gradients near fp32's largest value, whose mean or outer update (an outer
    learning rate of 10) overflows: no worker took part, and the anchor and the state come back
    unchanged (every compressor, the top-k ones in both forms, as an owner's non-finite result
    already did)."""
    comm = Simulated(W)
    options = {**OPTIONS.get(kind, {})}
    if kind in ("topk", "sparseloco"):
        options["exchange"] = exchange
    if kind == "sparseloco":
        outer = fn.diloco.sparseloco(10.0, comm=comm, **options)
    else:
        outer = fn.diloco.nesterov(fn.diloco.compression(kind, comm=comm, **options), 10.0)
    anchors = replicate({"w": torch.zeros(SHAPE)}, comm)
    state = simulate(outer.init, comm)(anchors)
    params = {"w": torch.full((W, *SHAPE), -3.0e38)}
    step = simulate(lambda a, p, s: fn.diloco.outer_step(outer, a, p, s, comm=comm), comm)
    result = step(anchors, params, state)
    assert result.participants.tolist() == [[False] * W] * W
    assert result.applied.tolist() == [False] * W
    assert torch.equal(result.anchor["w"], anchors["w"])
    for a, b in zip(tree_leaves(result.state), tree_leaves(state), strict=True):
        assert torch.equal(a, b)


def test_the_agreement_sends_its_formula_bytes():
    """One all-gather of ``1 + h`` int64 per worker (docs/algorithms.md's table)."""
    comm = Simulated(W)
    outer = outer_rule("fp32", comm)
    anchors = replicate({"w": torch.zeros(SHAPE)}, comm)
    state = simulate(outer.init, comm)(anchors)
    header = {"inner step": 4, "fragment": 0}
    simulate(lambda a, s: outer.update(a, s), comm)(anchors, state)
    rule_bytes = comm.reset_bytes_sent()
    step = simulate(
        lambda a, s: fn.diloco.outer_step(outer, a, a, s, comm=comm, header=header), comm
    )
    step(anchors, state)
    assert comm.bytes_sent - rule_bytes == 8 * (1 + len(header)) * (W - 1)
