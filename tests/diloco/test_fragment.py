"""fn.diloco.fragment: parameters that join a fragment take their place in index order, and the
outer state moves with its parameter (a layer unfrozen between two others, issue 60)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_map

from fn.collectives import Local
from fn.diloco.fragment import Fragment
from fn.diloco.rules import outer_rule

# each rule's per-parameter list of its state, and its step count
CASES = {
    "nesterov fp32": (("nesterov", "fp32", {}), lambda s: s[1][1].trace, lambda s: s[1][1].count),
    "nesterov loco4": (("nesterov", "loco4", {}), lambda s: s[0].errors, lambda s: s[0].count),
    "nesterov onebit": (
        ("nesterov", "onebit", {}),
        lambda s: s[1][1].trace,
        lambda s: s[1][1].count,
    ),
    "sparseloco": (
        ("sparseloco", None, {"k": 1, "chunk_size": 2}),
        lambda s: s[0].error,
        lambda s: s[1].count,
    ),
}


def _flat(x) -> list[torch.Tensor]:
    return list(x) if isinstance(x, tuple) else [x]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_parameter_that_joins_between_two_takes_its_place_and_the_state_moves(case):
    (outer, compression, options), per_parameter, count = CASES[case]
    rule = outer_rule(outer, {}, compression, options, Local())
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (4, 3, 2))
    anchor = [torch.zeros(4), torch.zeros(2)]
    fragment = Fragment(0, [0, 2], [a, c], anchor, rule)
    g = torch.Generator().manual_seed(0)
    fragment.state = tree_map(  # a state whose every value can be told apart
        lambda x: torch.randn(x.shape, generator=g) if x.is_floating_point() else x + 5,
        fragment.state,
    )
    before = [_flat(x) for x in per_parameter(fragment.state)]

    fragment.extend([1], [b], [torch.ones(3)], rule)

    assert fragment.indices == [0, 1, 2]
    assert [q is p for q, p in zip(fragment.params, [a, b, c], strict=True)] == [True] * 3
    assert [x.tolist() for x in fragment.anchor] == [[0.0] * 4, [1.0] * 3, [0.0] * 2]
    after = [_flat(x) for x in per_parameter(fragment.state)]
    fresh = [_flat(x) for x in per_parameter(rule.init(fragment.anchor))]
    for moved, kept in ((after[0], before[0]), (after[1], fresh[1]), (after[2], before[1])):
        assert all(torch.equal(x, y) for x, y in zip(moved, kept, strict=True))
    assert int(count(fragment.state)) == 5  # the step count kept
    rule.update([torch.ones(4), torch.ones(3), torch.ones(2)], fragment.state)  # it steps on
