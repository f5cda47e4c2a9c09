"""compressed_allreduce and onebit_allreduce against a loop-over-ranks numpy reference, on the
three backends (Local, Simulated, ProcessGroup over real gloo processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fn
from fn.collectives import (
    Local,
    Simulated,
    compressed_allreduce,
    init_error_feedback,
    onebit_allreduce,
    padded_numel,
    replicate,
    simulate,
)
from tests.collectives import _reference as ref

WORLD_SIZES = (2, 3, 4, 8)
SIZES = (0, 1, 7, 8, 1000, 4099)
STEPS = 3
# numpy and torch accumulate fp32 norms in different orders: the scales differ in the last bits.
REF_TOL = dict(atol=1e-5, rtol=1e-5)


def make_inputs(w: int, n: int, steps: int, seed: int = 0) -> torch.Tensor:
    """[steps, W, n] fp32 with some exact zeros and negative zeros."""
    g = torch.Generator().manual_seed(seed + 1000 * w + n)
    x = torch.randn(steps, w, n, generator=g)
    if n >= 8:
        x[:, :, 0] = 0.0
        x[:, :, 1] = -0.0
    return x


def reference_run(x: torch.Tensor):
    steps, w, n = x.shape
    big_n = ref.onebit_padded(n, w)
    we = [np.zeros(big_n, np.float32) for _ in range(w)]
    se = [np.zeros(big_n // w, np.float32) for _ in range(w)]
    ys = []
    for t in range(steps):
        y, we, se = ref.onebit_step([x[t, i].numpy() for i in range(w)], we, se)
        ys.append(y[0])
    return np.stack(ys), np.stack(we), np.stack(se)


def simulated_run(x: torch.Tensor):
    steps, w, n = x.shape
    comm = Simulated(w)
    we, se = replicate(init_error_feedback(n, comm=comm), comm)
    step = simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm)
    ys = []
    for t in range(steps):
        y, we, se = step(x[t], we, se)
        ys.append(y)
    return torch.stack(ys), we, se, comm.bytes_sent


# ----------------------------------------------------------------------------- tests
def test_padding_and_init():
    for w in WORLD_SIZES:
        comm = Simulated(w)
        for n in SIZES:
            we, se = init_error_feedback(n, comm=comm)
            assert we.shape == (ref.onebit_padded(n, w),) and se.shape == (
                ref.onebit_padded(n, w) // w,
            )
            assert we.dtype == se.dtype == torch.float32
            assert not we.any() and not se.any()


@pytest.mark.parametrize(
    ("numel", "world_size", "message"),
    [(5, -1, "world_size"), (5, 0, "world_size"), (-5, 2, "numel"), (5.0, 2, "numel")],
)
def test_padded_numel_refuses_impossible_sizes(numel, world_size, message):
    """A negative count or world gave 0, below ``numel``; a world of 0 ZeroDivisionError."""
    with pytest.raises(ValueError, match=f"{message} must be an int"):
        padded_numel(numel, world_size)


@pytest.mark.parametrize("w", WORLD_SIZES)
def test_simulated_matches_reference(w):
    for n in SIZES:
        x = make_inputs(w, n, STEPS)
        ys, we, se, _ = simulated_run(x)
        ref_y, ref_we, ref_se = reference_run(x)
        for r in range(w):  # every rank got the same y, bit for bit
            assert torch.equal(ys[:, r], ys[:, 0])
        np.testing.assert_allclose(ys[:, 0].numpy(), ref_y, **REF_TOL)
        np.testing.assert_allclose(we.numpy(), ref_we, **REF_TOL)
        np.testing.assert_allclose(se.numpy(), ref_se, **REF_TOL)


def test_local_is_identity():
    comm = Local()
    x = torch.randn(5, 3)
    we, se = init_error_feedback(x.numel(), comm=comm)
    y, we2, se2 = compressed_allreduce(x, we, se, comm=comm)
    assert y is x and we2 is we and se2 is se
    assert comm.bytes_sent == 0


def test_zero_size_no_communication():
    comm = Simulated(4)
    x = torch.zeros(4, 0, 3)
    we, se = replicate(init_error_feedback(0, comm=comm), comm)
    y, we2, se2 = simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm)(
        x, we, se
    )
    assert y.shape == x.shape and we2.shape == we.shape and se2.shape == se.shape
    assert comm.bytes_sent == 0


def test_zeros_and_negative_zeros_map_to_plus_one():
    comm = Simulated(2)
    x = torch.tensor([[0.0, -0.0, 0.0, -0.0] * 4, [-0.0, 0.0, -0.0, 0.0] * 4])
    x[:, -1] = torch.tensor([1.0, 1.0])  # a non-zero scale makes the +1 visible in y
    we, se = replicate(init_error_feedback(16, comm=comm), comm)
    y, _, _ = simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm)(x, we, se)
    assert (y > 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_raises_and_state_unchanged(bad):
    comm = Simulated(3)
    x = torch.randn(3, 100)
    we, se = replicate(init_error_feedback(100, comm=comm), comm)
    step = simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm)
    _, we, se = step(x, we, se)
    we_before, se_before = we.clone(), se.clone()
    x_bad = x.clone()
    x_bad[1, 17] = bad
    with pytest.raises(ValueError, match="non-finite"):
        step(x_bad, we, se)
    assert torch.equal(we, we_before) and torch.equal(se, se_before)
    assert torch.equal(x_bad[0], x[0])


def test_error_shape_mismatch_raises():
    comm = Simulated(2)
    we, se = replicate(init_error_feedback(10, comm=comm), comm)
    with pytest.raises(ValueError, match="init_error_feedback"):
        simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm)(
            torch.randn(2, 100), we, se
        )


def test_simulated_outside_simulate_raises():
    comm = Simulated(2)
    we, se = init_error_feedback(10, comm=comm)
    with pytest.raises(RuntimeError, match="outside fn.collectives.simulate"):
        compressed_allreduce(torch.randn(10), we, se, comm=comm)


@pytest.mark.parametrize("w", (2, 3))
def test_error_feedback_telescopes(w):
    """sum_t y_t = sum_t mean_i x_i,t + mean_i (e_w,i,0 - e_w,i,T)[:n] + (E_s,0 - E_s,T)[:n]
    with E_s the concatenation over ranks of the server errors (rank r holds chunk r)."""
    steps, n = 20, 333
    comm = Simulated(w)
    g = torch.Generator().manual_seed(7)
    we0 = torch.randn(w, ref.onebit_padded(n, w), generator=g) * 0.1
    se0 = torch.randn(w, ref.onebit_padded(n, w) // w, generator=g) * 0.1
    x = torch.randn(steps, w, n, generator=g, dtype=torch.float64).float()
    step = simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm)
    we, se, total_y = we0, se0, torch.zeros(n, dtype=torch.float64)
    for t in range(steps):
        y, we, se = step(x[t], we, se)
        total_y += y[0].double()
    expected = (
        x.double().mean(1).sum(0)
        + (we0.double() - we.double()).mean(0)[:n]
        + (se0.double() - se.double()).reshape(-1)[:n]
    )
    torch.testing.assert_close(total_y, expected, atol=1e-4, rtol=0)


def test_onebit_allreduce_transform_and_none_leaves():
    w = 3
    comm = Simulated(w)
    params = {"a": torch.zeros(4, 5), "b": torch.zeros(7), "frozen": torch.zeros(2)}
    tx = onebit_allreduce(comm=comm)
    state = replicate(tx.init(params), comm)
    g = torch.Generator().manual_seed(3)
    grads = {"a": torch.randn(w, 4, 5, generator=g), "b": torch.randn(w, 7, generator=g)}
    grads["frozen"] = None
    updates, new_state = simulate(tx.update, comm)(grads, state)
    assert updates["frozen"] is None
    assert torch.equal(new_state.worker_error["frozen"], state.worker_error["frozen"])
    for k in ("a", "b"):
        x = grads[k].reshape(w, -1).unsqueeze(0)
        ref_y, ref_we, _ = reference_run(x)
        np.testing.assert_allclose(updates[k][0].reshape(-1).numpy(), ref_y[0], **REF_TOL)
        np.testing.assert_allclose(new_state.worker_error[k].numpy(), ref_we, **REF_TOL)


def test_onebit_sgd_chain_reduces_loss():
    """chain(momentum, onebit_allreduce, -lr) on a quadratic: 1-bit SGD with error feedback."""
    w, steps = 4, 60
    comm = Simulated(w)
    target = torch.linspace(-1, 1, 50)

    def momentum(beta):
        def init_fn(params):
            return fn.tree.tree_zeros_like(params)

        def update_fn(updates, state, params=None, **extra):
            new = fn.tree.tree_map(lambda g, m: beta * m + g, updates, state)
            return new, new

        return fn.GradientTransformation(init_fn, update_fn)

    def neg_lr(lr):
        return fn.GradientTransformation(
            lambda p: fn.EmptyState(),
            lambda u, s, p=None, **e: (fn.tree.tree_scale(u, -lr), s),
        )

    tx = fn.chain(momentum(0.9), onebit_allreduce(comm=comm), neg_lr(0.02))
    params = replicate({"p": torch.zeros(50)}, comm)
    state = replicate(tx.init({"p": torch.zeros(50)}), comm)
    g = torch.Generator().manual_seed(0)

    def train_step(params, state, noise):
        grads = {"p": params["p"] - target + noise}
        updates, state = tx.update(grads, state, params)
        return fn.apply_updates(params, updates), state

    step = simulate(train_step, comm)
    for _ in range(steps):
        params, state = step(params, state, 0.1 * torch.randn(w, 50, generator=g))
    assert torch.equal(params["p"][0], params["p"][w - 1])
    assert (params["p"][0] - target).norm() < 0.1 * target.norm()
