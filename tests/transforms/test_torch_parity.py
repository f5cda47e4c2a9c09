"""fn's Adam, AdamW and SGD against torch.optim (single-tensor path) over 200 steps."""

from __future__ import annotations

import pytest
import torch

import fn
from tests.transforms._problem import grads_of, make_data, make_mlp, max_abs_diff, params_of

STEPS = 200


def run_fn(tx, model, xs, ys):
    params = params_of(model)
    state = tx.init(params)
    for t in range(STEPS):
        updates, state = tx.update(grads_of(model, params, xs[t], ys[t]), state, params)
        params = fn.apply_updates(params, updates)
    return params


def run_torch(opt_cls, model, xs, ys, **kwargs):
    params = {k: v.clone().requires_grad_() for k, v in params_of(model).items()}
    opt = opt_cls(list(params.values()), foreach=False, **kwargs)
    for t in range(STEPS):
        grads = grads_of(model, {k: v.detach() for k, v in params.items()}, xs[t], ys[t])
        for k, p in params.items():
            p.grad = grads[k]
        opt.step()
    return {k: v.detach() for k, v in params.items()}


CASES = [
    ("adam", fn.adam, torch.optim.Adam, dict(lr=1e-3)),
    ("adam-lr1e-2", fn.adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6)),
    ("adam-l2", fn.adam, torch.optim.Adam, dict(lr=1e-3, weight_decay=0.1)),
    ("adamw", fn.adamw, torch.optim.AdamW, dict(lr=1e-3)),
    ("adamw-wd", fn.adamw, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    ("sgd", fn.sgd, torch.optim.SGD, dict(lr=0.05)),
    ("sgd-momentum", fn.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    ("sgd-nesterov", fn.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("sgd-wd", fn.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-2)),
    ("sgd-dampening", fn.sgd, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3)),
]


@pytest.mark.parametrize("name,fn_opt,torch_opt,kwargs", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_optim(name, fn_opt, torch_opt, kwargs):
    model = make_mlp()
    xs, ys = make_data(STEPS)
    ours = run_fn(fn_opt(**kwargs), model, xs, ys)
    ref = run_torch(torch_opt, model, xs, ys, **kwargs)
    assert max_abs_diff(ours, params_of(model)) > 1e-3  # the params did move
    assert max_abs_diff(ours, ref) <= 1e-6
