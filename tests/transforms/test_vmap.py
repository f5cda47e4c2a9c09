"""A batch of independent models under torch.func.vmap equals separate runs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

import fn
from tests.transforms._problem import make_mlp, max_abs_diff, params_of

N_MODELS, STEPS = 4, 15


def loss(model, params, x, y):
    return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: fn.adam(lr=1e-2, weight_decay=0.01),
        lambda: fn.lamb(lr=1e-2, weight_decay=0.01, min_coeff=0.01, max_coeff=10.0),
    ],
    ids=["adam", "lamb"],
)
def test_vmap_over_models_equals_separate_runs(make_tx):
    tx = make_tx()
    models = [make_mlp(seed) for seed in range(N_MODELS)]
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(N_MODELS, STEPS, 16, 6, generator=gen)
    ys = torch.randn(N_MODELS, STEPS, 16, 3, generator=gen)
    base = copy.deepcopy(models[0]).to("meta")

    def step(params, state, x, y):
        grads = grad(lambda p: loss(base, p, x, y))(params)
        updates, state = tx.update(grads, state, params)
        return fn.apply_updates(params, updates), state

    stacked, _ = stack_module_state(models)
    stacked = {k: v.detach() for k, v in stacked.items()}
    state = vmap(tx.init)(stacked)
    assert fn.get_hyperparam(state, "lr").shape == (N_MODELS,)
    for t in range(STEPS):
        stacked, state = vmap(step)(stacked, state, xs[:, t], ys[:, t])

    for i, model in enumerate(models):
        params = params_of(model)
        single_state = tx.init(params)
        for t in range(STEPS):
            grads = grad(loss, argnums=1)(model, params, xs[i, t], ys[i, t])
            updates, single_state = tx.update(grads, single_state, params)
            params = fn.apply_updates(params, updates)
        assert max_abs_diff(params, params_of(model)) > 1e-3
        assert max_abs_diff({k: v[i] for k, v in stacked.items()}, params) <= 1e-6
