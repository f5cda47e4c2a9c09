"""Argument validation of the 1-bit family: bad hyperparameters raise a ValueError naming them."""

from __future__ import annotations

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local

FREEZING = {"onebit_adam": fn.onebit_adam, "onebit_lamb": fn.onebit_lamb}
ADAPTERS = {"onebit_adam": fn.optim.OnebitAdam, "onebit_lamb": fn.optim.OnebitLamb}


@pytest.mark.parametrize("name", FREEZING)
@pytest.mark.parametrize("freeze_step", [-1, 0, 1])
def test_freeze_step_below_two_is_rejected_with_the_reason(name, freeze_step):
    # no warmup update would estimate the variance (and LAMB's trust ratio) the compressed
    # phase divides by
    with pytest.raises(ValueError, match=r"freeze_step must be an int >= 2.*warmup"):
        FREEZING[name](freeze_step=freeze_step, comm=Local())
    params = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match=r"freeze_step must be an int >= 2.*warmup"):
        ADAPTERS[name](params, freeze_step=freeze_step, comm=Local())


@pytest.mark.parametrize("name", FREEZING)
def test_freeze_step_two_warms_up_once_then_compresses(name):
    opt = FREEZING[name](lr=1e-2, freeze_step=2, comm=Local())
    p = {"w": torch.randn(4, 3)}
    state = opt.init(p)
    assert [opt.is_compressed(t) for t in (1, 2, 3)] == [False, True, True]
    for t in (1, 2, 3):
        u, state = opt.update({"w": torch.randn(4, 3)}, state, p, step=t)
        assert torch.isfinite(u["w"]).all() and u["w"].abs().max() > 0
        p = fn.apply_updates(p, u)


ALL = {**FREEZING, "zero_one_adam": fn.zero_one_adam}
LAMB = ["onebit_lamb"]
# (optimizers, bad arguments, a pattern of the message, which names the argument)
BAD = [
    (ALL, dict(eps=-1e-8), "eps must be >= 0"),
    (ALL, dict(lr=-1e-3), "lr must be >= 0"),
    (ALL, dict(lr=float("nan")), "lr must be >= 0"),
    (ALL, dict(weight_decay=-0.01), "weight_decay must be >= 0"),
    (ALL, dict(betas=(0.9, 1.0)), "betas"),
    (LAMB, dict(min_coeff=5.0, max_coeff=1.0), r"min_coeff \(5.0\) must be <= max_coeff"),
    (LAMB, dict(min_coeff=-0.1), "min_coeff must be >= 0"),
    (LAMB, dict(factor_min=4.0, factor_max=0.5), r"factor_min \(4.0\) must be <="),
    (LAMB, dict(factor_min=-1.0), "factor_min must be >= 0"),
    (LAMB, dict(factor_threshold=-0.1), "factor_threshold must be >= 0"),
    (LAMB, dict(coeff_beta=1.0), r"coeff_beta must be in \[0, 1\)"),
    (LAMB, dict(coeff_beta=-0.1), r"coeff_beta must be in \[0, 1\)"),
]
CASES = [(name, kw, msg) for names, kw, msg in BAD for name in names]


@pytest.mark.parametrize("name, kwargs, message", CASES, ids=str)
def test_bad_hyperparameters_are_rejected_by_name(name, kwargs, message):
    kwargs = {"freeze_step": 10, **kwargs} if name in FREEZING else kwargs
    with pytest.raises(ValueError, match=message):
        ALL[name](comm=Local(), **kwargs)


@pytest.mark.parametrize("name", ALL)
def test_boundary_hyperparameters_are_accepted(name):
    # zeros, an lr schedule (not range-checked: only read at update time) and equal bounds
    kwargs = dict(lr=lambda count: 1e-3 / (1 + count), eps=0.0, weight_decay=0.0, betas=(0, 0))
    if name == "onebit_lamb":
        kwargs.update(min_coeff=1.0, max_coeff=1.0, factor_min=2.0, factor_max=2.0)
        kwargs.update(factor_threshold=0.0, coeff_beta=0.0)
    opt = ALL[name](comm=Local(), **kwargs)
    assert opt.init({"w": torch.ones(2)}).lr == pytest.approx(1e-3)
