"""scale_by_adam stays differentiable and vmappable (its update works in place on temporaries)."""

import pytest
import torch

import fn


def _reference_update(g, m, v, count, b1=0.9, b2=0.999, eps=1e-8):
    """Adam's bias-corrected step for update number ``count + 1``, written out."""
    t = count + 1
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return (m / (1 - b1**t)) / (torch.sqrt(v) / (1 - b2**t) ** 0.5 + eps)


def _state_after_steps(tx, params, steps):
    state = tx.init(params)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = {k: torch.randn(p.shape, generator=gen, dtype=p.dtype) for k, p in params.items()}
        _, state = tx.update(grads, state)
    return state


def test_grad_through_the_update_matches_the_formula():
    params = {"w": torch.zeros(4, 3, dtype=torch.float64), "b": torch.zeros(5, dtype=torch.float64)}
    tx = fn.scale_by_adam()
    state = _state_after_steps(tx, params, 3)
    grads = {k: torch.randn(p.shape, dtype=torch.float64) for k, p in params.items()}
    weights = {k: torch.randn(p.shape, dtype=torch.float64) for k, p in params.items()}

    def loss(g):
        updates, _ = tx.update(g, state)
        return sum((updates[k] * weights[k]).sum() for k in g)

    def reference_loss(g):
        return sum(
            (_reference_update(g[k], state.mu[k], state.nu[k], 3) * weights[k]).sum() for k in g
        )

    got = torch.func.grad(loss)(grads)
    want = torch.func.grad(reference_loss)(grads)
    for k in grads:
        # rtol: fn computes the bias corrections in fp32
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=0)


@pytest.mark.parametrize("batched", ["grads", "state"])
def test_vmap_with_only_one_side_batched(batched):
    params = {"w": torch.zeros(6, 2)}
    tx = fn.scale_by_adam()
    state = _state_after_steps(tx, params, 2)
    grads = torch.randn(3, 6, 2)
    if batched == "grads":
        out, _ = torch.func.vmap(lambda g: tx.update({"w": g}, state))(grads)
        singles = [tx.update({"w": grads[i]}, state)[0]["w"] for i in range(3)]
    else:
        states = fn.tree.tree_map(lambda x: torch.stack([x] * 3), state)
        out, _ = torch.func.vmap(lambda s: tx.update({"w": grads[0]}, s))(states)
        singles = [tx.update({"w": grads[0]}, state)[0]["w"]] * 3
    for i in range(3):
        assert torch.equal(out["w"][i], singles[i])
