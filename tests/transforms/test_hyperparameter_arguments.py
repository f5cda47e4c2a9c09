"""Malformed ``betas``, ``lr`` and ``eps`` in every factory that takes them (fn.adam, fn.adamw,
fn.lamb, fn.sgd, the 1-bit family and its sharded rules, which fn.fsdp builds): a ValueError
naming the setting, whatever the form (wrong length, a string, None, not a number, NaN,
negative, infinite); the forms accepted before (numbers, numpy scalars, one-element tensors, any
pair, schedules) are still accepted."""

from __future__ import annotations

import numpy
import pytest
import torch

import fn
from fn.collectives import Local

NAN, INF = float("nan"), float("inf")

FACTORIES = {
    "adam": fn.adam,
    "adamw": fn.adamw,
    "lamb": fn.lamb,
    "onebit_adam": lambda **kw: fn.onebit_adam(comm=Local(), **kw),
    "onebit_lamb": lambda **kw: fn.onebit_lamb(comm=Local(), **kw),
    "zero_one_adam": lambda **kw: fn.zero_one_adam(comm=Local(), **kw),
    "onebit_adam_sharded": fn.transforms.onebit_adam_sharded,
    "onebit_lamb_sharded": lambda **kw: fn.transforms.onebit_lamb_sharded(comm=Local(), **kw),
}
# only some of the settings
LR_ONLY = {
    "sgd": lambda **kw: fn.sgd(**{"lr": 0.1, **kw}),
    "scale_by_learning_rate": lambda **kw: fn.scale_by_learning_rate(**{"lr": 0.1, **kw}),
}
EPS_ONLY = {"scale_by_adam": fn.scale_by_adam}

BAD_BETAS = [(0.9,), (0.9, 0.99, 0.5), (), "ab", None, 0.9, ("a", 0.9), (0.9, None)]
BAD_BETAS += [(NAN, 0.9), (0.9, 1.0), (-0.1, 0.9), (True, 0.9), (0.9, 0.99 + 1j)]
BAD_NUMBERS = ["0.1", None, NAN, -1e-3, INF, -INF, True, [0.1], 1 + 2j, torch.tensor([0.1, 0.2])]

CASES = (
    [(name, "betas", v) for name in FACTORIES for v in BAD_BETAS]
    + [(name, key, v) for name in FACTORIES for key in ("lr", "eps") for v in BAD_NUMBERS]
    + [(name, "lr", v) for name in LR_ONLY for v in BAD_NUMBERS]
    + [(name, "eps", v) for name in EPS_ONLY for v in BAD_NUMBERS]
)
ALL = {**FACTORIES, **LR_ONLY, **EPS_ONLY}

# the other settings of the dense factories: weight decay and LAMB's trust-ratio bounds (a
# max_coeff may be infinite: no upper bound)
OTHER_SETTINGS = {
    "adam": {"weight_decay": BAD_NUMBERS},
    "adamw": {"weight_decay": BAD_NUMBERS},
    "sgd": {"weight_decay": BAD_NUMBERS},
    "lamb": {
        "weight_decay": BAD_NUMBERS,
        "min_coeff": [NAN, -1.0, "0.1", INF],
        "max_coeff": [NAN, -1.0, "10"],
    },
    "scale_by_trust_ratio": {
        key: [NAN, INF, -1.0] for key in ("min_norm", "trust_coefficient", "eps")
    },
}
OTHER_FACTORIES = {
    "adam": fn.adam,
    "adamw": fn.adamw,
    "sgd": lambda **kw: fn.sgd(0.1, **kw),
    "lamb": fn.lamb,
    "scale_by_trust_ratio": fn.scale_by_trust_ratio,
}


@pytest.mark.parametrize(
    "name, key, value",
    [(n, k, v) for n, keys in OTHER_SETTINGS.items() for k, vs in keys.items() for v in vs],
    ids=repr,
)
def test_malformed_other_setting_is_a_value_error(name, key, value):
    """An infinite weight decay or trust coefficient, a NaN or negative bound, made every param
    NaN or infinite at the first update."""
    with pytest.raises(ValueError) as caught:
        OTHER_FACTORIES[name](**{key: value})
    message = str(caught.value)
    assert "must be" in message and (key in message or "decay" in message), message


@pytest.mark.parametrize("name, key, value", CASES, ids=repr)
def test_malformed_setting_is_a_value_error_naming_it(name, key, value):
    with pytest.raises(ValueError) as caught:
        ALL[name](**{key: value})
    message = str(caught.value)
    assert f"{key} must be" in message or f"{key}[" in message, message
    assert "unpack" not in message and "not supported between" not in message


@pytest.mark.parametrize("name", FACTORIES)
def test_short_betas_say_what_a_pair_is(name):
    with pytest.raises(ValueError, match=r"betas must be a pair \(b1, b2\).*got \(0\.9,\)"):
        FACTORIES[name](betas=(0.9,))
    # out of range: the existing message, naming the beta
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0, 1\), got 1\.0"):
        FACTORIES[name](betas=(0.9, 1.0))


GOOD = [
    dict(betas=[0.8, 0.9]),
    dict(betas=torch.tensor([0.8, 0.9])),
    dict(betas=(torch.tensor(0.8), numpy.float32(0.9))),
    dict(betas=(0, 0)),
    dict(lr=0),
    dict(lr=torch.tensor(0.02)),
    dict(lr=numpy.float64(0.02)),
    dict(lr=lambda count: 0.02),  # a schedule
    dict(eps=0.0),
    dict(eps=numpy.float32(1e-6)),
    dict(eps=torch.tensor(1e-6)),
]


def _id(kwargs: dict) -> str:
    """The case's id, the same in every process (pytest-xdist's workers compare their ids): a
    schedule by its name, not its address."""
    words = (f"{k}={v.__name__ if callable(v) else repr(v)}" for k, v in kwargs.items())
    return ", ".join(words)


@pytest.mark.parametrize("kwargs", GOOD, ids=_id)
@pytest.mark.parametrize("name", FACTORIES)
def test_well_formed_settings_are_still_accepted(name, kwargs):
    tx = FACTORIES[name](**kwargs)
    state = tx.init({"w": torch.ones(3)})
    if "lr" in kwargs and not callable(kwargs["lr"]):
        assert fn.get_hyperparam(state, "lr").item() == pytest.approx(float(kwargs["lr"]))


def test_betas_of_a_pair_reach_the_rule():
    # the checked betas are the ones the rule uses: b1 = 0 makes Adam's first update g / |g|
    params = {"w": torch.tensor([1.0, 1.0])}
    for betas in ((0.0, 0.5), [0.0, 0.5], torch.tensor([0.0, 0.5])):
        tx = fn.adam(lr=1.0, betas=betas, eps=0.0)
        updates, _ = tx.update({"w": torch.tensor([2.0, -4.0])}, tx.init(params), params)
        assert torch.equal(updates["w"], torch.tensor([-1.0, 1.0]))
