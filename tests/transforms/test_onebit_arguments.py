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
