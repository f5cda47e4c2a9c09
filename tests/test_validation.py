"""fn._validation: the finiteness test and the check that raises under vmap/compile."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fn._validation import all_finite, finite_or_raise

FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(FLOATS, max_size=40))
def test_all_finite_is_the_elementwise_test(values):
    x = torch.tensor(values, dtype=torch.float32)
    assert all_finite(x) == bool(torch.isfinite(x).all())


@pytest.mark.parametrize(
    "values,expected",
    [
        ([3e38, 3e38], True),  # the sum overflows; every element is finite
        ([-3e38, -3e38, 1.0], True),
        ([float("inf"), float("-inf")], False),  # the sum is NaN
        ([1.0, float("nan")], False),
        ([], True),
    ],
)
def test_all_finite_edge_cases(values, expected):
    assert all_finite(torch.tensor(values, dtype=torch.float32)) is expected


def test_eager_check_returns_the_input_itself():
    x = torch.randn(5)
    assert finite_or_raise(x, "bad") is x
    x[2] = float("nan")
    with pytest.raises(ValueError, match="bad"):
        finite_or_raise(x, "bad")


def test_vmap_checks_every_rank_and_returns_a_copy():
    x = torch.randn(4, 6)
    out = torch.func.vmap(lambda r: finite_or_raise(r, "bad") * 1)(x)
    assert torch.equal(out, x)
    x[3, 0] = float("inf")
    with pytest.raises(ValueError, match="bad"):
        torch.func.vmap(lambda r: finite_or_raise(r, "bad"))(x)
