"""``fn.update_and_apply(fn.adamw(...))`` on the CPU runs ``fn.kernels.adamw_step`` (one pass
over params, gradients and moments) and gives, bit for bit, the params and state of the pure
``tx.update`` + ``fn.apply_updates`` and of the two donated calls."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import fn
from fn.kernels import _cpu
from fn.transforms import adam_transform as adam_module

SIZES = [(1000,), (7,), (3, 5), (1,), (129,), (4096 + 13,)]


def _params(dtypes):
    gen = torch.Generator().manual_seed(0)
    return {
        f"p{i}": (torch.randn(shape, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
        for i, (shape, dtype) in enumerate(zip(SIZES, dtypes, strict=True))
    }


def _same(a, b):
    la = [x for x in pytree.tree_leaves(a) if isinstance(x, torch.Tensor)]
    lb = [x for x in pytree.tree_leaves(b) if isinstance(x, torch.Tensor)]
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))


def _three_ways(tx, params, steps, mode):
    """The pure loop, the two donated calls and ``update_and_apply`` side by side; asserts
    bit-identical params and states after every step."""
    runs = {name: {k: p.clone() for k, p in params.items()} for name in ("pure", "two", "fused")}
    states = {name: tx.init(params) for name in runs}
    spare = tx.init(params)
    gen = torch.Generator().manual_seed(1)
    for t in range(1, steps + 1):
        grads = {
            k: (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype) for k, p in params.items()
        }
        updates, states["pure"] = tx.update(dict(grads), states["pure"], runs["pure"])
        runs["pure"] = fn.apply_updates(runs["pure"], updates)
        donated = {k: g.clone() for k, g in grads.items()}
        updates, states["two"] = tx.update(donated, states["two"], runs["two"], donate=True)
        runs["two"] = fn.apply_updates(runs["two"], updates, donate=True)
        donated = {k: g.clone() for k, g in grads.items()}
        if mode == "in place":
            runs["fused"], states["fused"] = fn.update_and_apply(
                tx, donated, states["fused"], runs["fused"]
            )
        else:
            new_params, new_state = fn.update_and_apply(
                tx, donated, states["fused"], runs["fused"], donate=spare
            )
            runs["fused"], spare, states["fused"] = new_params, states["fused"], new_state
        for name in ("two", "fused"):
            assert _same(runs[name], runs["pure"]), f"{name}: params differ at step {t}"
            assert _same(states[name], states["pure"]), f"{name}: states differ at step {t}"


@pytest.fixture
def kernel_calls(monkeypatch):
    """The number of C kernel calls so far (a list holding one count)."""
    if _cpu.library() is not None:  # the one-time checks run the kernel: not counted
        for dtype in (torch.float32, torch.float64):
            for small_lerp in (True, False):
                _cpu._adamw_lanes(dtype, small_lerp)
    calls = [0]
    run = _cpu._adamw_c

    def counted(*args):
        calls[0] += 1
        return run(*args)

    monkeypatch.setattr(_cpu, "_adamw_c", counted)
    return calls


def _c_kernel_runs(dtype):
    return _cpu.adamw_step_runs(dtype, 0.9)


@pytest.mark.parametrize("mode", ["in place", "spare"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "make, decayed",
    [
        (lambda: fn.adamw(1e-2), True),
        (lambda: fn.adamw(0.5, weight_decay=0.9), True),  # steps of more than half a param
        (lambda: fn.adamw(lambda count: 1e-2 / (1.0 + count), weight_decay=0.1), True),
        (lambda: fn.adamw(1e-3, betas=(0.0, 0.99), weight_decay=0.1), True),  # other lerp form
        (lambda: fn.adamw(1e-2, weight_decay=0.0), False),  # Adam: torch's kernel on the params
    ],
    ids=["adamw", "large-steps", "schedule", "beta1-0", "no-decay"],
)
def test_adamw_three_ways_bit_identical(make, decayed, dtype, mode, kernel_calls):
    _three_ways(make(), _params([dtype] * len(SIZES)), steps=12, mode=mode)
    if _c_kernel_runs(dtype):
        assert kernel_calls[0] == (12 if decayed else 0)


def test_the_c_kernel_runs_once_per_step(kernel_calls):
    if not _c_kernel_runs(torch.float32):
        pytest.skip("the C kernel does not run here (no compiler, or torch rounds otherwise)")
    _three_ways(fn.adamw(1e-2), _params([torch.float32] * len(SIZES)), steps=5, mode="in place")
    assert kernel_calls[0] == 5  # one job over all leaves per step


def test_mixed_dtypes_fall_back_bit_identical(kernel_calls):
    dtypes = [torch.float32, torch.float64] * (len(SIZES) // 2)
    _three_ways(fn.adamw(1e-2), _params(dtypes), steps=6, mode="in place")
    _three_ways(fn.adamw(1e-2), _params(dtypes), steps=6, mode="spare")
    assert kernel_calls[0] == 0  # torch's kernel takes one dtype: the chain runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_without_the_c_kernel_the_workspace_path_runs(monkeypatch, kernel_calls, dtype):
    monkeypatch.setattr(adam_module, "adamw_step_runs", lambda dtype, beta1: False)
    _three_ways(fn.adamw(1e-2), _params([dtype] * len(SIZES)), steps=6, mode="in place")
    _three_ways(fn.adamw(0.5, weight_decay=0.9), _params([dtype] * len(SIZES)), 6, "spare")
    assert kernel_calls[0] == 0
