"""``fn.update_and_apply(fn.adamw(...))`` runs ``torch._fused_adamw_`` on the params: its params
and moments are ``torch.optim.AdamW(fused=True)``'s bit for bit, and the pure ``tx.update`` +
``fn.apply_updates``'s wherever every step so far moved a param by less than half of it (the
pure update ``p' - p`` is then exact); where the fused kernel cannot run it is the two calls."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import fn

SIZES = [(1000,), (7,), (3, 5), (1,), (129,), (4096 + 13,)]
LR = 2**-7  # exact in fp32, as the state stores it, so torch.optim.AdamW sees the same lr


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


def _three_ways(tx, params, steps, mode, torch_kwargs=None, lr_at=None):
    """The pure loop, ``update_and_apply`` and (``torch_kwargs``) ``torch.optim.AdamW(fused=
    True, **torch_kwargs)`` side by side, ``lr_at(t)`` its learning rate at step ``t``; asserts
    after every step: the states of the first two bit-identical, their params where every step
    moved a param by less than half of it (everywhere without ``torch_kwargs``), torch's params
    and moments everywhere."""
    pure = {k: p.clone() for k, p in params.items()}
    fast = {k: p.clone() for k, p in params.items()}
    pure_state, state, spare = tx.init(params), tx.init(params), tx.init(params)
    reference = [p.clone().requires_grad_(True) for p in params.values()]
    if torch_kwargs is not None:
        opt = torch.optim.AdamW(reference, fused=True, **torch_kwargs)
    small = {k: torch.ones_like(p, dtype=torch.bool) for k, p in params.items()}
    gen = torch.Generator().manual_seed(1)
    for t in range(1, steps + 1):
        grads = {
            k: (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype) for k, p in params.items()
        }
        old = pure
        updates, pure_state = tx.update(dict(grads), pure_state, pure)
        pure = fn.apply_updates(pure, updates)
        donated = {k: g.clone() for k, g in grads.items()}
        if mode == "in place":
            fast, state = fn.update_and_apply(tx, donated, state, fast)
        else:
            fast, new_state = fn.update_and_apply(tx, donated, state, fast, donate=spare)
            spare, state = state, new_state
        assert _same(state, pure_state), f"states differ at step {t}"
        for k, p in fast.items():
            if torch_kwargs is not None:
                small[k] &= (pure[k] - old[k]).abs() < old[k].abs() / 2
            assert torch.equal(p[small[k]], pure[k][small[k]]), f"{k} differs at step {t}"
        if torch_kwargs is None:
            continue
        for p, g in zip(reference, grads.values(), strict=True):
            p.grad = g.clone()
        if lr_at is not None:
            opt.param_groups[0]["lr"] = lr_at(t)
        opt.step()
        assert _same(fast, [p.detach() for p in reference]), f"torch's params differ at step {t}"
        moments = [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in reference]
        mu, nu = state[0].mu, state[0].nu
        assert _same([(mu[k], nu[k]) for k in fast], moments), f"moments differ at step {t}"


@pytest.mark.parametrize("mode", ["in place", "spare"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "make, torch_kwargs, lr_at",
    [
        (lambda: fn.adamw(LR), {"lr": LR}, None),
        # steps of more than half a param: torch's params, the pure ones only elsewhere
        (lambda: fn.adamw(0.5, weight_decay=0.9), {"lr": 0.5, "weight_decay": 0.9}, None),
        (
            lambda: fn.adamw(lambda count: LR * 0.5**count, weight_decay=0.1),
            {"lr": LR, "weight_decay": 0.1},
            lambda t: LR * 0.5 ** (t - 1),
        ),
        (
            lambda: fn.adamw(LR, betas=(0.0, 0.99), weight_decay=0.1),
            {"lr": LR, "betas": (0.0, 0.99), "weight_decay": 0.1},
            None,
        ),
        (lambda: fn.adamw(LR, weight_decay=0.0), None, None),  # Adam: the two calls bit for bit
    ],
    ids=["adamw", "large-steps", "schedule", "beta1-0", "no-decay"],
)
def test_adamw_fast_step_is_torch_fused_adamw(make, torch_kwargs, lr_at, dtype, mode):
    _three_ways(make(), _params([dtype] * len(SIZES)), 12, mode, torch_kwargs, lr_at)


def test_mixed_dtypes_fall_back_bit_identical():
    dtypes = [torch.float32, torch.float64] * (len(SIZES) // 2)
    _three_ways(fn.adamw(LR), _params(dtypes), steps=6, mode="in place")  # torch's kernel takes
    _three_ways(fn.adamw(LR), _params(dtypes), steps=6, mode="spare")  # one dtype: the chain runs
