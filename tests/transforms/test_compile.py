"""A torch.compile'd update step compiles once: neither the next call nor a new lr recompiles."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fn
from tests.transforms._problem import grads_of, make_data, make_mlp, max_abs_diff, params_of

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from torch internals

CASES = [
    ("adamw", lambda: fn.adamw(lr=1e-2, weight_decay=0.1), "inductor"),
    ("lamb", lambda: fn.lamb(lr=1e-2, weight_decay=0.01), "aot_eager"),
    ("sgd", lambda: fn.sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=0.01), "aot_eager"),
    ("schedule", lambda: fn.adam(lr=lambda c: 1e-2 / (c + 1).float()), "aot_eager"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,make_tx,backend", CASES, ids=[c[0] for c in CASES])
def test_compiled_step_does_not_recompile(name, make_tx, backend):
    tx = make_tx()

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return fn.apply_updates(params, updates), state

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    model = make_mlp()
    xs, ys = make_data(4)
    params = ref_params = params_of(model)
    state = ref_state = tx.init(params)
    for t in range(4):
        if t == 2:
            state = fn.set_hyperparams(state, lr=3e-3)
            ref_state = fn.set_hyperparams(ref_state, lr=3e-3)
        params, state = compiled(params, state, grads_of(model, params, xs[t], ys[t]))
        ref_params, ref_state = step(
            ref_params, ref_state, grads_of(model, ref_params, xs[t], ys[t])
        )
        assert counter.frame_count == 1
        assert max_abs_diff(params, ref_params) <= 1e-6
    assert max_abs_diff(params, params_of(model)) > 1e-3
    torch._dynamo.reset()
