"""error_dtype: the 1-bit family's error feedback stored in bf16 or fp16."""

from __future__ import annotations

import pytest
import torch

import fn
from fn.collectives import Simulated, replicate, simulate

FACTORIES = {
    "onebit_adam": lambda comm, **kw: fn.onebit_adam(3e-2, 5, comm=comm, **kw),
    "zero_one_adam": lambda comm, **kw: fn.zero_one_adam(
        3e-2, var_freeze_step=5, var_update_scaler=1, comm=comm, **kw
    ),
    "onebit_lamb": lambda comm, **kw: fn.onebit_lamb(3e-2, 5, comm=comm, **kw),
}
WORLD, STEPS = 4, 120


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "bfloat16"])
def test_other_error_dtypes_are_refused(name, dtype):
    with pytest.raises(ValueError, match="error_dtype must be one of"):
        FACTORIES[name](Simulated(2), error_dtype=dtype)


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_errors_are_stored_in_error_dtype(name, dtype):
    """After compressed updates the errors are in ``error_dtype`` (fp32 by default). The
    rounding itself is the kernels' (tests/kernels/test_low_precision_error.py); the fast path
    with bf16 errors equals the pure one bit for bit (test_onebit_donate.py)."""
    comm = Simulated(WORLD)
    params = {"w": torch.randn(8, 32, generator=torch.Generator().manual_seed(0))}
    gen = torch.Generator().manual_seed(1)
    grads = [{"w": torch.randn(WORLD, 8, 32, generator=gen)} for _ in range(6)]
    results = {}
    for storage in (torch.float32, dtype):
        opt = FACTORIES[name](comm, error_dtype=storage)
        state, p = replicate(opt.init(params), comm), replicate(params, comm)
        update = simulate(opt.update, comm)
        for t, g in enumerate(grads, start=1):
            _, state = update(g, state, p, step=t)
        results[storage] = state
    errors = fn.tree.tree_leaves((results[dtype].worker_error, results[dtype].server_error))
    assert errors and all(e.dtype == dtype for e in errors)
    wide = fn.tree.tree_leaves((results[torch.float32].worker_error,))
    assert all(e.dtype == torch.float32 for e in wide)
