"""fn.adam / fn.adamw on eager tensors: the fused kernel path against torch.optim and the chain.

On eager, plain, contiguous tensors ``fn.adam`` runs ``torch._fused_adam_`` on fresh copies of
its state; everywhere else it runs the chain of foreach or per-leaf ops. These tests pin the
fused path to ``torch.optim.Adam(fused=True)`` bit for bit, check that it falls back where it
must, and that both paths give the same optimizer.
"""

from __future__ import annotations

import pytest
import torch

import fn

LR = 2.0**-7  # exactly representable in fp32, so the stored lr equals torch.optim's float lr
SHAPES = {"w": (17, 9), "b": (9,), "big": (3000,)}


def _grads(seed: int, steps: int, shapes=SHAPES, device="cpu") -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        scale = 10.0 ** (t % 3 - 1)
        out.append(
            {k: (torch.randn(s, generator=gen) * scale).to(device) for k, s in shapes.items()}
        )
    return out


def _params(device="cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen).to(device, dtype) for k, s in SHAPES.items()}


def _run_fn(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = fn.apply_updates(params, updates)
    return params, state


def _run_torch(make_opt, params, grads):
    leaves = {k: p.clone().requires_grad_(True) for k, p in params.items()}
    opt = make_opt(list(leaves.values()))
    for g in grads:
        for k, p in leaves.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in leaves.items()}


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of torch._fused_adam_ and torch._fused_adamw_ (number of tensors)."""
    calls = []
    for name in ("_fused_adam_", "_fused_adamw_"):
        real = getattr(torch, name)

        def counting(*args, real=real, **kwargs):
            calls.append(len(args[0]))
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    return calls


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("betas,eps", [((0.9, 0.999), 1e-8), ((0.5, 0.9), 1e-3)])
def test_eager_adam_is_torch_fused_adam_bit_for_bit(fused_calls, betas, eps, weight_decay):
    params, grads = _params(), _grads(1, 40)
    got, state = _run_fn(fn.adam(LR, betas, eps, weight_decay), params, grads)
    assert fused_calls == [len(SHAPES)] * len(grads)
    want = _run_torch(
        lambda ps: torch.optim.Adam(ps, LR, betas, eps, weight_decay, fused=True), params, grads
    )
    for k in SHAPES:
        assert torch.equal(got[k], want[k]), k
    assert int(state[1].count) == int(state[2].count) == len(grads)


def test_eager_adamw_matches_torch_adamw(fused_calls):
    params, grads = _params(), _grads(2, 60)
    got, _ = _run_fn(fn.adamw(LR, weight_decay=0.05), params, grads)
    assert len(fused_calls) == len(grads)
    for kind in ("foreach", "fused"):
        want = _run_torch(
            lambda ps, kind=kind: torch.optim.AdamW(ps, LR, weight_decay=0.05, **{kind: True}),
            params,
            grads,
        )
        for k in SHAPES:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
    # p + (p' - p) == p' unless a step moves p by more than half of it: nearly all bits agree
    agree = sum(int((got[k] == want[k]).sum()) for k in SHAPES)
    assert agree >= 0.99 * sum(p.numel() for p in params.values())


def _transposed(grads):
    """The same values with non-contiguous (transposed) storage for the 2-d leaf."""
    return [{**g, "w": g["w"].t().contiguous().t()} for g in grads]


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: fn.adam(LR, weight_decay=0.01),
        lambda: fn.adamw(LR, weight_decay=0.05),
        lambda: fn.adam(lambda count: LR * 0.97 ** count.to(torch.float32)),
    ],
    ids=["adam", "adamw", "adam-schedule"],
)
def test_fused_path_and_chain_agree(fused_calls, make_tx):
    params, grads = _params(), _grads(3, 50)
    fused, fused_state = _run_fn(make_tx(), params, grads)
    assert len(fused_calls) == len(grads)
    fused_calls.clear()
    chained, chained_state = _run_fn(make_tx(), params, _transposed(grads))
    assert fused_calls == []  # the kernel assumes one layout for all operands: no fusion here
    for k in SHAPES:
        torch.testing.assert_close(fused[k], chained[k], rtol=0, atol=1e-6)
    lr_fused, lr_chained = (
        fn.get_hyperparam(fused_state, "lr"),
        fn.get_hyperparam(chained_state, "lr"),
    )
    assert torch.equal(lr_fused, lr_chained)
    assert max((fused[k] - params[k]).abs().max().item() for k in SHAPES) > 1e-2


def test_fused_path_leaves_inputs_alone(fused_calls):
    tx = fn.adam(LR, weight_decay=0.1)
    params, grads = _params(), _grads(4, 3)
    state = tx.init(params)
    _, state = tx.update(grads[0], state, params)
    before = [t.clone() for t in (*params.values(), *grads[1].values())]
    mu, nu = ({k: t.clone() for k, t in tree.items()} for tree in (state[1].mu, state[1].nu))
    updates, new_state = tx.update(grads[1], state, params)
    assert len(fused_calls) == 2
    after = [*params.values(), *grads[1].values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    for k in SHAPES:
        assert torch.equal(state[1].mu[k], mu[k]) and torch.equal(state[1].nu[k], nu[k])
        assert not torch.equal(new_state[1].mu[k], mu[k])


def test_fused_path_keeps_none_and_empty_leaves(fused_calls):
    tx = fn.adam(LR)
    params = {"w": torch.ones(4), "frozen": torch.ones(2), "empty": torch.ones(0)}
    state = tx.init(params)
    g = {"w": torch.full((4,), 0.5), "frozen": None, "empty": torch.ones(0)}
    updates, new_state = tx.update(g, state, params)
    assert fused_calls == [2]
    assert updates["frozen"] is None and updates["empty"].shape == (0,)
    assert new_state[1].mu["frozen"] is state[1].mu["frozen"]
    torch.testing.assert_close(updates["w"], torch.full((4,), -LR))  # the first step is -lr sign(g)


def test_set_hyperparams_lr_reaches_the_fused_kernel(fused_calls):
    params, grads = _params(), _grads(5, 2)
    tx = fn.adam(LR)
    state = tx.init(params)
    _, state = tx.update(grads[0], state, params)
    state = fn.set_hyperparams(state, lr=0.0)
    updates, state = tx.update(grads[1], state, params)
    assert len(fused_calls) == 2
    assert all(torch.equal(u, torch.zeros_like(u)) for u in updates.values())
    assert float(fn.get_hyperparam(state, "lr")) == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_float_dtypes_use_the_kernel(fused_calls, dtype):
    params = _params(dtype=dtype)
    grads = [{k: g.to(dtype) for k, g in step.items()} for step in _grads(6, 10)]
    got, state = _run_fn(fn.adam(LR), params, grads)
    assert len(fused_calls) == len(grads)
    assert all(t.dtype == dtype for t in (*got.values(), *state[1].mu.values()))
    want = _run_torch(lambda ps: torch.optim.Adam(ps, LR, fused=True), params, grads)
    for k in SHAPES:
        if dtype == torch.float64:
            assert torch.equal(got[k], want[k]), k
        else:
            # p + update rounds twice in bf16 where the kernel rounds p - step once: at most one
            # bf16 ulp of the param (eps * |p|, up to 2x) per step apart.
            bound = len(grads) * 2 * torch.finfo(dtype).eps * want[k].float().abs()
            assert ((got[k].float() - want[k].float()).abs() <= bound).all(), k


def test_mixed_dtypes_fall_back_to_the_chain(fused_calls):
    params = {"a": torch.ones(3), "b": torch.ones(3, dtype=torch.float64)}
    g = {"a": torch.ones(3), "b": torch.ones(3, dtype=torch.float64)}
    updates, _ = fn.adam(LR).update(g, fn.adam(LR).init(params), params)
    assert fused_calls == []
    torch.testing.assert_close(updates["a"], torch.full((3,), -LR))
    assert updates["b"].dtype == torch.float64


def test_bad_input_gives_the_chains_errors():
    params = {"w": torch.zeros(3), "b": torch.zeros(2)}
    g = {"w": torch.ones(3), "b": torch.ones(2)}
    adamw = fn.adamw(LR)
    with pytest.raises(ValueError, match="needs params"):
        adamw.update(g, adamw.init(params))
    with pytest.raises(ValueError, match="param is None"):
        adamw.update(g, adamw.init(params), {**params, "b": None})
    adam = fn.adam(LR)
    with pytest.raises(ValueError, match="shape"):
        adam.update({**g, "w": torch.ones(4)}, adam.init(params), params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_eager_adam_is_torch_fused_adam_bit_for_bit(fused_calls):
    params, grads = _params("cuda"), _grads(7, 20, device="cuda")
    got, _ = _run_fn(fn.adam(LR, weight_decay=0.1), params, grads)
    assert len(fused_calls) == len(grads)
    want = _run_torch(
        lambda ps: torch.optim.Adam(ps, LR, weight_decay=0.1, fused=True), params, grads
    )
    for k in SHAPES:
        assert torch.equal(got[k], want[k]), k
