"""The state is the whole truth: saved with torch.save mid-run (in every phase) and loaded into a
fresh optimizer, it continues bit for bit."""

from __future__ import annotations

import io

import pytest
import torch

import fn
from fn.collectives import Simulated, simulate
from tests.transforms._onebit_harness import make_grads, make_params, run_fn

WORLD = 2
OPTIMIZERS = {
    "onebit_adam": lambda c: fn.onebit_adam(1e-2, 6, comm=c),
    "zero_one_adam": lambda c: fn.zero_one_adam(
        1e-2,
        var_freeze_step=8,
        var_update_scaler=2,
        local_step_scaler=2,
        local_step_clipper=4,
        comm=c,
    ),
    "onebit_lamb": lambda c: fn.onebit_lamb(1e-2, 6, comm=c),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("split", [4, 13])  # warmup; compressed (0/1 Adam: frozen, local steps)
def test_save_load_continues_bit_for_bit(name, split):
    make = OPTIMIZERS[name]
    params = make_params()
    grads = make_grads(params, WORLD, 20)
    full, _ = run_fn(make, params, grads, WORLD)
    first, state = run_fn(make, params, grads[:split], WORLD)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    comm = Simulated(WORLD)
    update = simulate(make(comm).update, comm)
    p = {k: torch.stack([first[-1][r][k] for r in range(WORLD)]) for k in params}
    for t in range(split + 1, 21):
        g = {k: torch.stack([grads[t - 1][r][k] for r in range(WORLD)]) for k in params}
        updates, state = update(g, state, p, step=t)
        p = fn.apply_updates(p, updates)
    for k in params:
        for r in range(WORLD):
            assert torch.equal(p[k][r], full[-1][r][k]), (k, r)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_gradient_shape_mismatch_raises(name):
    opt = OPTIMIZERS[name](fn.collectives.Local())
    params = make_params()
    grads = {k: torch.zeros(p.shape) for k, p in params.items()}
    grads["b"] = torch.zeros(7, 1)  # would broadcast against the [7] state
    with pytest.raises(ValueError, match="shape"):
        opt.update(grads, opt.init(params), params, step=1)
