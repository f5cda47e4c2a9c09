"""Simulated collectives under torch.compile: same results as eager, bytes counted on every call,
the non-finite check kept in the compiled graph."""

from __future__ import annotations

import pytest
import torch

from fn.collectives import (
    Simulated,
    compressed_allreduce,
    init_error_feedback,
    loco_allreduce,
    replicate,
    simulate,
)


@pytest.mark.timeout(300)
def test_compiled_simulate_matches_eager():
    w, n = 4, 1000
    comm = Simulated(w)
    x = torch.randn(w, n, generator=torch.Generator().manual_seed(0))
    we, se = replicate(init_error_feedback(n, comm=comm), comm)
    step = simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm)
    eager = step(x, we, se)
    per_call = comm.reset_bytes_sent()
    compiled = torch.compile(step)
    for _ in range(2):
        out = compiled(x, we, se)
        for got, want in zip(out, eager, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert comm.reset_bytes_sent() == 2 * per_call
    bad = x.clone()
    bad[2, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        compiled(bad, we, se)

    # A consumer fused after the slice [:n] of the chunk-scaled output (n = 1000 is not a multiple
    # of the 256-element chunk): the pattern inductor miscompiled without the fusion barrier.
    def sgd(p, x, a, b):
        y, a, b = compressed_allreduce(x, a, b, comm=comm)
        return p - 0.1 * y, a, b

    params = torch.randn(w, n)
    want = simulate(sgd, comm)(params, x, we, se)
    got = torch.compile(simulate(sgd, comm))(params, x, we, se)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=0)

    tx = loco_allreduce(4, 32, comm=comm, local_world_size=2)
    state = replicate(tx.init({"x": torch.zeros(n)}), comm)
    update = simulate(tx.update, comm)
    (y_eager, s_eager), (y_comp, s_comp) = (
        update({"x": x}, state),
        torch.compile(update)({"x": x}, state),
    )
    torch.testing.assert_close(y_comp["x"], y_eager["x"], atol=1e-6, rtol=0)
    torch.testing.assert_close(s_comp.errors["x"], s_eager.errors["x"], atol=1e-6, rtol=0)


@pytest.mark.timeout(300)
def test_compiled_allreduce_with_output_buffers_computes_purely_and_copies_into_them():
    """docs/guides/memory.md, "Buffer donation": under torch.compile ``out=`` gives the compiled
    pure call's results, written into the buffers."""
    w, n = 2, 300
    comm = Simulated(w)
    x = torch.randn(w, n, generator=torch.Generator().manual_seed(0))
    we, se = replicate(init_error_feedback(n, comm=comm), comm)
    pure = torch.compile(simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm), comm))
    donated = torch.compile(
        simulate(lambda x, a, b: compressed_allreduce(x, a, b, comm=comm, out=(x, a, b)), comm)
    )
    want = pure(x, we, se)
    buffers = (x.clone(), we.clone(), se.clone())
    got = donated(*buffers)
    for g, b, expected in zip(got, buffers, want, strict=True):
        assert torch.equal(g, expected) and torch.equal(b, expected)
