"""fn.adam / fn.adamw's ``implementation``: what each choice runs, bit for bit, and its errors.

``"chain"`` in eager gives the bits of the chain under vmap (``Simulated``) and of a compiled
step whose backend keeps the ops (``aot_eager``); ``"auto"`` is ``"fused"`` where the kernel
runs and the chain elsewhere; forcing a choice where it cannot run names the reason.
"""

from __future__ import annotations

import pytest
import torch

import fn
from fn.collectives import Simulated, simulate
from fn.tree import foreach_ok, per_leaf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from torch internals

LR = 2.0**-7
SHAPES = {"w": (17, 9), "b": (9,), "big": (3000,)}
RANKS, STEPS = 3, 12

FACTORIES = {
    "adam": lambda **kw: fn.adam(LR, weight_decay=0.1, **kw),
    "adamw": lambda **kw: fn.adamw(LR, weight_decay=0.1, **kw),
    "adam-schedule": lambda **kw: fn.adam(lambda c: LR * 0.9 ** c.to(torch.float32), **kw),
}


def _stacked(seed: int, leading: tuple[int, ...]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*leading, *s, generator=gen) for k, s in SHAPES.items()}


def _problem():
    """Params and gradients with a leading rank axis; gradients of mixed magnitudes."""
    params = _stacked(0, (RANKS,))
    grads = [
        {k: g * 10.0 ** (t % 3 - 1) for k, g in _stacked(t + 1, (RANKS,)).items()}
        for t in range(STEPS)
    ]
    return params, grads


def _step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return fn.apply_updates(params, updates), state

    return step


def _run_per_rank(tx, params, grads, step=None):
    """Every rank on its own, eagerly (or with ``step``); the results stacked again."""
    step = step or _step(tx)
    finals = []
    for r in range(RANKS):
        p = {k: v[r] for k, v in params.items()}
        state = tx.init(p)
        for g in grads:
            p, state = step(p, state, {k: v[r] for k, v in g.items()})
        finals.append(p)
    return {k: torch.stack([f[k] for f in finals]) for k in SHAPES}


def _assert_equal(got, want):
    for k in SHAPES:
        assert torch.equal(got[k], want[k]), k


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of the fused kernels and of torch._foreach_lerp (the foreach Adam)."""
    calls = {"fused": 0, "foreach": 0}
    for name, kind in [
        ("_fused_adam_", "fused"),
        ("_fused_adamw_", "fused"),
        ("_foreach_lerp", "foreach"),
    ]:
        real = getattr(torch, name)

        def counting(*args, real=real, kind=kind, **kwargs):
            calls[kind] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    return calls


@pytest.mark.parametrize("name", FACTORIES)
def test_eager_chain_is_simulated_chain_bit_for_bit(name, kernel_calls):
    make = FACTORIES[name]
    params, grads = _problem()
    eager = _run_per_rank(make(implementation="chain"), params, grads)
    assert kernel_calls == {"fused": 0, "foreach": 0}
    tx = make()  # "auto" runs the chain under vmap
    update = simulate(tx.update, Simulated(RANKS))
    stacked, state = params, torch.func.vmap(tx.init)(params)
    for g in grads:
        updates, state = update(g, state, stacked)
        stacked = fn.apply_updates(stacked, updates)
    assert kernel_calls == {"fused": 0, "foreach": 0}
    _assert_equal(eager, stacked)
    assert max((stacked[k] - params[k]).abs().max().item() for k in SHAPES) > 1e-2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_eager_chain_is_compiled_chain_bit_for_bit(name):
    tx = FACTORIES[name](implementation="chain")
    params, grads = _problem()
    torch._dynamo.reset()
    compiled = torch.compile(_step(tx), backend="aot_eager", fullgraph=True)
    _assert_equal(_run_per_rank(tx, params, grads), _run_per_rank(tx, params, grads, step=compiled))
    torch._dynamo.reset()


@pytest.mark.parametrize("name", FACTORIES)
def test_auto_is_fused_on_contiguous_tensors_and_foreach_elsewhere(name, kernel_calls):
    make = FACTORIES[name]
    params, grads = _problem()
    auto = _run_per_rank(make(), params, grads)
    assert kernel_calls == {"fused": RANKS * STEPS, "foreach": 0}
    _assert_equal(auto, _run_per_rank(make(implementation="fused"), params, grads))
    kernel_calls.update(fused=0)
    # A transposed copy of "w" is not contiguous: "auto" falls back to the foreach chain.
    transposed = [{**g, "w": g["w"].transpose(1, 2).contiguous().transpose(1, 2)} for g in grads]
    auto = _run_per_rank(make(), params, transposed)
    assert kernel_calls == {"fused": 0, "foreach": RANKS * STEPS}
    _assert_equal(auto, _run_per_rank(make(implementation="foreach"), params, transposed))
    # On CPU the foreach ops round as the per-leaf ones.
    _assert_equal(auto, _run_per_rank(make(implementation="chain"), params, grads))


def test_chain_choice_does_not_leak_into_later_calls(kernel_calls):
    params, grads = _problem()
    p, g = {k: v[0] for k, v in params.items()}, {k: v[0] for k, v in grads[0].items()}
    chained, auto = fn.adam(LR, implementation="chain"), fn.adam(LR)
    chained.update(g, chained.init(p), p)
    with pytest.raises(ValueError, match="shape"):
        chained.update({**g, "b": torch.ones(2)}, chained.init(p), p)
    assert foreach_ok(*p.values())
    auto.update(g, auto.init(p), p)
    assert kernel_calls == {"fused": 1, "foreach": 0}


def test_per_leaf_turns_foreach_off_inside_only():
    t = torch.ones(2)
    assert per_leaf(foreach_ok, t) is False
    assert foreach_ok(t)


def _under_vmap(tx):
    params = _stacked(0, (2,))
    torch.func.vmap(_step(tx))(params, torch.func.vmap(tx.init)(params), params)


def _under_grad(tx):
    params = {k: v[0] for k, v in _stacked(0, (1,)).items()}

    def loss(p):
        new, _ = _step(tx)(p, tx.init(p), {k: v * 2 for k, v in p.items()})
        return sum(v.sum() for v in new.values())

    torch.func.grad(loss)(params)


def _under_autograd(tx):
    params = {k: v[0].requires_grad_() for k, v in _stacked(0, (1,)).items()}
    _step(tx)(params, tx.init(params), {k: v * 2 for k, v in params.items()})


def _under_compile(tx):
    params = {k: v[0] for k, v in _stacked(0, (1,)).items()}
    torch._dynamo.reset()
    try:
        torch.compile(_step(tx), backend="eager")(params, tx.init(params), params)
    finally:
        torch._dynamo.reset()


def _eager(params, grads=None):
    def run(tx):
        _step(tx)(params, tx.init(params), params if grads is None else grads)

    return run


ANYWHERE = [
    ("vmap", _under_vmap, "torch.func"),
    ("grad", _under_grad, "torch.func"),
    ("autograd", _under_autograd, "requires grad"),
    ("compile", _under_compile, "torch.compile"),
]
FUSED_ONLY = [
    ("non-contiguous", _eager({"w": torch.ones(4, 3).t()}), "not contiguous"),
    ("mixed-dtypes", _eager({"a": torch.ones(3), "b": torch.ones(3).double()}), "mix"),
    ("meta-device", _eager({"w": torch.ones(3, device="meta")}), "meta"),
]


@pytest.mark.parametrize("name", ["adam", "adamw"])
@pytest.mark.parametrize(
    "implementation,case,run,reason",
    [("fused", *c) for c in ANYWHERE + FUSED_ONLY] + [("foreach", *c) for c in ANYWHERE],
    ids=[f"fused-{c[0]}" for c in ANYWHERE + FUSED_ONLY] + [f"foreach-{c[0]}" for c in ANYWHERE],
)
def test_forced_implementation_that_cannot_run_names_the_reason(
    name, implementation, case, run, reason
):
    tx = FACTORIES[name](implementation=implementation)
    with pytest.raises(RuntimeError, match=rf"{name}: implementation='{implementation}'.*{reason}"):
        run(tx)


@pytest.mark.parametrize("case,run", [(c[0], c[1]) for c in ANYWHERE], ids=[c[0] for c in ANYWHERE])
def test_chain_and_auto_run_everywhere(case, run):
    for implementation in ("auto", "chain"):
        run(fn.adamw(LR, implementation=implementation))


def test_forced_foreach_runs_where_fused_cannot(kernel_calls):
    _eager({"w": torch.ones(4, 3).t(), "b": torch.ones(3).double()})(
        fn.adam(LR, implementation="foreach")
    )
    assert kernel_calls == {"fused": 0, "foreach": 1}


def test_forced_fused_keeps_the_chains_input_errors():
    params = {"w": torch.zeros(3)}
    tx = fn.adamw(LR, implementation="fused")
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params))
    with pytest.raises(ValueError, match="param is None"):
        tx.update(params, tx.init(params), {"w": None})


@pytest.mark.parametrize("factory", [fn.adam, fn.adamw])
@pytest.mark.parametrize("bad", ["Fused", "torch", True, None])
def test_unknown_implementation_lists_the_choices(factory, bad):
    with pytest.raises(ValueError, match="'auto', 'fused', 'foreach', 'chain'"):
        factory(implementation=bad)
