"""dense_allreduce: the fp32 data-parallel baseline transform."""

from __future__ import annotations

import math

import torch

import fn
from fn.collectives import Local, Simulated, dense_allreduce, replicate, simulate


def test_dense_allreduce_is_the_mean_over_ranks_and_passes_none_through():
    comm = Simulated(3)
    g = torch.Generator().manual_seed(0)
    updates = {"w": torch.randn(3, 4, 2, generator=g), "unused": None, "b": torch.randn(3, 5)}
    tx = dense_allreduce(comm=comm)
    state = tx.init({"w": torch.zeros(4, 2), "unused": torch.zeros(1), "b": torch.zeros(5)})

    out, new_state = simulate(lambda u, s: tx.update(u, s), comm)(updates, state)

    assert out["unused"] is None
    assert new_state == fn.EmptyState()
    for name in ("w", "b"):
        per_rank = [updates[name][r] for r in range(3)]
        expected = sum(per_rank) / 3  # the written-out mean, one rank after the other
        for r in range(3):
            torch.testing.assert_close(out[name][r], expected, rtol=1e-6, atol=1e-7)
            assert torch.equal(out[name][r], out[name][0])
    # ring allreduce: each rank sends 2 (W-1)/W of the fp32 payload of each leaf, rounded up
    assert comm.bytes_sent == sum(math.ceil(2 * 2 * (n * 4) / 3) for n in (8, 5))


def test_dense_allreduce_then_adam_on_one_rank_is_adam():
    params = {"w": torch.randn(6)}
    grads = {"w": torch.randn(6)}
    chained = fn.chain(dense_allreduce(comm=Local()), fn.adam(lr=0.1))
    plain = fn.adam(lr=0.1)
    u1, _ = chained.update(grads, chained.init(params), params)
    u2, _ = plain.update(grads, plain.init(params), params)
    assert torch.equal(u1["w"], u2["w"])


def test_dense_allreduce_under_simulate_keeps_replicated_params_identical():
    comm = Simulated(4)
    tx = fn.chain(dense_allreduce(comm=comm), fn.sgd(lr=0.5))
    params = replicate({"w": torch.ones(3)}, comm)
    state = simulate(tx.init, comm)(params)
    grads = {"w": torch.arange(12.0).view(4, 3)}
    updates, _ = simulate(lambda g, s, p: tx.update(g, s, p), comm)(grads, state, params)
    new = fn.apply_updates(params, updates)
    assert all(torch.equal(new["w"][r], new["w"][0]) for r in range(4))
    torch.testing.assert_close(new["w"][0], 1 - 0.5 * grads["w"].mean(0))
