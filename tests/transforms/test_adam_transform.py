"""scale_by_adam against the Adam formula written out in float64."""

from __future__ import annotations

import pytest
import torch

import fn


def reference_adam(grads, b1, b2, eps, bias_correction):
    """The Adam direction for a sequence of gradients of one tensor, in float64."""
    m = torch.zeros_like(grads[0], dtype=torch.float64)
    v = torch.zeros_like(grads[0], dtype=torch.float64)
    out = []
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        if bias_correction:
            m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        else:
            m_hat, v_hat = m, v
        out.append(m_hat / (v_hat.sqrt() + eps))
    return out, m, v


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize(
    "betas,eps", [((0.9, 0.999), 1e-8), ((0.5, 0.9), 1e-3), ((0.0, 0.99), 0.1)]
)
def test_scale_by_adam_matches_formula(bias_correction, betas, eps):
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 7, generator=gen) * 10 ** (t % 3 - 1) for t in range(30)]
    tx = fn.scale_by_adam(*betas, eps, bias_correction=bias_correction)
    params = {"w": torch.zeros(5, 7)}
    state = tx.init(params)
    expected, m, v = reference_adam(grads, *betas, eps, bias_correction)
    for g, want in zip(grads, expected, strict=True):
        updates, state = tx.update({"w": g}, state, params)
        torch.testing.assert_close(updates["w"].double(), want, rtol=2e-5, atol=1e-7)
    assert int(state.count) == len(grads)
    torch.testing.assert_close(state.mu["w"].double(), m, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(state.nu["w"].double(), v, rtol=1e-5, atol=1e-9)


def test_first_step_is_unit_sign_with_bias_correction():
    # With bias correction the first update is g / (|g| + eps'): an exact check of the corrections
    # (in fp32, 1 - 0.999 would lose 4 digits).
    g = torch.tensor([3.0, -0.5, 1e-3])
    tx = fn.scale_by_adam(0.9, 0.999, 0.0)
    updates, _ = tx.update(g, tx.init(g))
    torch.testing.assert_close(updates, torch.sign(g), rtol=1e-6, atol=0)


def test_bias_correction_long_run_is_accurate():
    # After many steps with a constant gradient g, the bias-corrected direction is exactly sign(g).
    g = {"w": torch.full((3,), 0.25)}
    tx = fn.scale_by_adam(0.9, 0.999, 0.0)
    state = tx.init(g)
    for _ in range(50):
        updates, state = tx.update(g, state)
    # m_hat = g and v_hat = g^2 exactly, so the direction is g / |g| = 1.
    torch.testing.assert_close(updates["w"], torch.ones(3), rtol=1e-5, atol=0)


def test_state_shapes_and_dtypes():
    params = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.float64)}
    state = fn.scale_by_adam().init(params)
    assert isinstance(state, fn.ScaleByAdamState)
    assert state.count.shape == () and state.count.dtype == torch.int64
    for tree in (state.mu, state.nu):
        assert tree["a"].shape == (2, 3) and tree["a"].dtype == torch.float32
        assert tree["b"].dtype == torch.float64


def test_does_not_modify_inputs():
    g = {"w": torch.randn(4)}
    tx = fn.adam(lr=0.1, weight_decay=0.1)
    p = {"w": torch.randn(4)}
    state = tx.init(p)
    g_copy, p_copy = g["w"].clone(), p["w"].clone()
    mu_before = state[1].mu["w"].clone()
    tx.update(g, state, p)
    assert torch.equal(g["w"], g_copy) and torch.equal(p["w"], p_copy)
    assert torch.equal(state[1].mu["w"], mu_before)


def test_shape_mismatch_is_an_error():
    tx = fn.scale_by_adam()
    state = tx.init({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="shape"):
        tx.update({"w": torch.zeros(1)}, state)


@pytest.mark.parametrize(
    "kwargs", [dict(b1=1.0), dict(b2=-0.1), dict(eps=-1.0), dict(b1=float("nan"))]
)
def test_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError):
        fn.scale_by_adam(**kwargs)
