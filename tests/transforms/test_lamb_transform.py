"""LAMB and the trust ratio against the update rule written out as a plain loop."""

from __future__ import annotations

import pytest
import torch

import fn
from tests.transforms._problem import grads_of, make_data, make_mlp, max_abs_diff, params_of


def reference_lamb(model, params, xs, ys, steps, lr, b1, b2, eps, wd, min_c=None, max_c=None):
    """You et al. 2020, Algorithm 2, one tensor (layer) at a time."""
    params = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    for t in range(1, steps + 1):
        grads = grads_of(model, params, xs[t - 1], ys[t - 1])
        for k in params:
            g = grads[k]
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            m_hat = m[k] / (1 - b1**t)
            v_hat = v[k] / (1 - b2**t)
            r = m_hat / (v_hat.sqrt() + eps) + wd * params[k]
            p_norm = params[k].norm().item()
            r_norm = r.norm().item()
            ratio = p_norm / r_norm if p_norm > 0 and r_norm > 0 else 1.0
            if min_c is not None:
                ratio = max(ratio, min_c)
            if max_c is not None:
                ratio = min(ratio, max_c)
            params[k] = params[k] - lr * ratio * r
    return params


@pytest.mark.parametrize(
    "wd,clamp", [(0.0, (None, None)), (0.01, (None, None)), (0.01, (0.01, 0.5))]
)
def test_lamb_matches_reference(wd, clamp):
    steps, lr = 60, 2.0**-7  # lr exactly representable in the fp32 state
    model = make_mlp().double()
    xs, ys = make_data(steps)
    xs, ys = xs.double(), ys.double()
    params = params_of(model)
    params["0.bias"] = torch.zeros_like(params["0.bias"])  # a zero-norm layer: ratio 1 at t=1
    tx = fn.lamb(
        lr=lr, betas=(0.9, 0.99), eps=1e-6, weight_decay=wd, min_coeff=clamp[0], max_coeff=clamp[1]
    )
    ours = dict(params)
    state = tx.init(ours)
    for t in range(steps):
        updates, state = tx.update(grads_of(model, ours, xs[t], ys[t]), state, ours)
        ours = fn.apply_updates(ours, updates)
    ref = reference_lamb(model, params, xs, ys, steps, lr, 0.9, 0.99, 1e-6, wd, *clamp)
    assert max_abs_diff(ours, params) > 1e-2
    assert max_abs_diff(ours, ref) <= 1e-7


def test_trust_ratio_per_leaf():
    params = {"a": torch.tensor([3.0, 4.0]), "b": torch.zeros(3), "c": torch.ones(2)}
    updates = {"a": torch.tensor([0.0, 0.5]), "b": torch.ones(3), "c": torch.zeros(2)}
    tx = fn.scale_by_trust_ratio()
    out, state = tx.update(updates, tx.init(params), params)
    assert state == fn.EmptyState()
    torch.testing.assert_close(out["a"], torch.tensor([0.0, 5.0]))  # ratio 5 / 0.5 = 10
    torch.testing.assert_close(out["b"], torch.ones(3))  # ||p|| = 0: ratio 1
    torch.testing.assert_close(out["c"], torch.zeros(2))  # ||u|| = 0: ratio 1
    clamped, _ = fn.scale_by_trust_ratio(min_coeff=0.1, max_coeff=2.0).update(
        updates, state, params
    )
    torch.testing.assert_close(clamped["a"], torch.tensor([0.0, 1.0]))


def test_trust_ratio_min_norm_and_coefficient():
    params = {"w": torch.tensor([0.0, 0.1])}
    updates = {"w": torch.tensor([0.0, 2.0])}
    tx = fn.scale_by_trust_ratio(min_norm=1.0, trust_coefficient=0.5)
    out, _ = tx.update(updates, tx.init(params), params)
    # ||p|| -> max(0.1, 1) = 1, ||u|| = 2: ratio 0.5 * 1 / 2.
    torch.testing.assert_close(out["w"], updates["w"] * 0.25)


def test_trust_ratio_needs_params():
    tx = fn.scale_by_trust_ratio()
    with pytest.raises(ValueError, match="params"):
        tx.update({"w": torch.ones(2)}, tx.init(None))
    with pytest.raises(ValueError, match="min_coeff"):
        fn.scale_by_trust_ratio(min_coeff=2.0, max_coeff=1.0)
