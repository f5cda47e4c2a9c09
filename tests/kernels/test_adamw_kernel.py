"""``fn.kernels.adamw_step``: the CPU kernel set's batched step against the reference (torch's
fused AdamW kernel on a copy of the params, then ``p + (p' - p)``), bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn.kernels as K
from fn.kernels import _cpu, _reference

_DTYPES = (torch.float32, torch.float64)
_SPECIAL = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-310, 3e38)


def _leaves(sizes, dtype, seed, special):
    """Params, gradients and moments; with ``special``, non-finite values, denormals, -0.0 and
    huge values at random places of every operand."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(n, scale, positive=False):
        x = torch.randn(n, generator=gen, dtype=torch.float64)
        x = (x.abs() if positive else x) * scale
        x *= torch.pow(10.0, torch.randint(-8, 3, (n,), generator=gen).double())
        x = x.to(dtype)
        if special and n:
            picks = torch.randint(0, n, (min(n, 6),), generator=gen)
            values = torch.randint(0, len(_SPECIAL), (len(picks),), generator=gen)
            for i, k in zip(picks.tolist(), values.tolist(), strict=True):
                x[i] = abs(_SPECIAL[k]) if positive else _SPECIAL[k]
        return x

    ps = [leaf(n, 1.0) for n in sizes]
    gs = [leaf(n, 1e-2) for n in sizes]
    ms = [leaf(n, 1e-2) for n in sizes]
    vs = [leaf(n, 1e-4, positive=True) for n in sizes]
    return ps, gs, ms, vs


def _bits(ts):
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return [t.view(ints[t.dtype]) for t in ts]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


def _same_but_nan_signs(a, b):
    """Equal bits, except that NaNs only need to be NaNs in both."""
    nan_free = [[x.nan_to_num(0.0, 0.0, 0.0) for x in xs] for xs in (a, b)]
    both_nan = all(torch.equal(x.isnan(), y.isnan()) for x, y in zip(a, b, strict=True))
    return both_nan and _same(*nan_free)


def _both(impl, sizes, dtype, seed, special, hyper, separate_outputs):
    """``impl`` and the reference from the same inputs: their params and moments."""
    results = []
    for run in (impl, _reference.adamw_step):
        ps, gs, ms, vs = _leaves(sizes, dtype, seed, special)
        m_outs = [torch.full_like(m, 7.0) for m in ms] if separate_outputs else ms
        v_outs = [torch.full_like(v, 7.0) for v in vs] if separate_outputs else vs
        run(ps, gs, ms, vs, m_outs, v_outs, *hyper)
        results.append(ps + m_outs + v_outs)
    return results


_SIZES = st.lists(st.integers(0, 600), min_size=1, max_size=5)
_HYPER = st.tuples(
    st.sampled_from([1.0, 2.0, 35.0, 1000.0, 2.0**24 + 2]),  # step
    st.sampled_from([1e-3, 2.0**-10, 0.5]),  # lr
    st.sampled_from([0.9, 0.0, 0.3]),  # beta1 (0.0 and 0.3: torch's other lerp branch)
    st.sampled_from([0.999, 0.95, 0.0]),  # beta2
    st.sampled_from([1e-8, 0.0]),  # eps
    st.sampled_from([0.0, 1e-2, 0.9]),  # weight_decay
)


@settings(max_examples=80, deadline=None)
@given(
    sizes=_SIZES,
    dtype=st.sampled_from(_DTYPES),
    seed=st.integers(0, 2**16),
    special=st.booleans(),
    hyper=_HYPER,
    separate_outputs=st.booleans(),
    batch=st.sampled_from([64, 256, 1 << 18]),
)
def test_cpu_batches_match_the_reference(
    sizes, dtype, seed, special, hyper, separate_outputs, batch
):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_cpu, "_ADAMW_BATCH", batch)  # leaves cut into pieces, batches across leaves
        got, want = _both(_cpu.adamw_step, sizes, dtype, seed, special, hyper, separate_outputs)
    assert _same(got, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_batches_cut_across_leaves(monkeypatch, threads):
    monkeypatch.setattr(_cpu, "_ADAMW_BATCH", 48)  # many pieces per leaf, and batches across
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sizes = [0, 5, 100, 17, 0, 1, 256, 31]
        hyper = (3.0, 1e-3, 0.9, 0.999, 1e-8, 1e-2)
        for dtype in _DTYPES:
            got, want = _both(_cpu.adamw_step, sizes, dtype, 0, True, hyper, False)
            assert _same(got, want)
    finally:
        torch.set_num_threads(previous)


def test_non_contiguous_and_mixed_dtype_leaves(monkeypatch):
    """A strided leaf is stepped whole; leaves of two dtypes share a batch."""
    monkeypatch.setattr(_cpu, "_ADAMW_BATCH", 64)
    results = []
    for run in (_cpu.adamw_step, _reference.adamw_step):
        ps, gs, ms, vs = (a + b for a, b in zip(
            _leaves([40, 300], torch.float32, 1, True),
            _leaves([9], torch.float64, 2, True),
            strict=True,
        ))  # fmt: skip
        strided = [x.view(20, 2)[:, 0] for x in (ps[0], gs[0], ms[0], vs[0])]
        ps[0], gs[0], ms[0], vs[0] = strided
        run(ps, gs, ms, vs, ms, vs, 4.0, 1e-3, 0.9, 0.999, 1e-8, 1e-2)
        results.append(ps + ms + vs)
    assert _same(*results)


def test_many_steps_stay_identical():
    runs = {impl: _leaves([1000, 7, 129], torch.float32, 3, False) for impl in ("cpu", "reference")}
    gen = torch.Generator().manual_seed(4)
    for t in range(1, 41):
        grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in runs["cpu"][0]]
        hyper = (float(t), 2.0**-10, 0.9, 0.999, 1e-8, 1e-2)
        for impl, (ps, _, ms, vs) in runs.items():
            step = _cpu.adamw_step if impl == "cpu" else _reference.adamw_step
            step(ps, grads, ms, vs, ms, vs, *hyper)
        (p1, _, m1, v1), (p2, _, m2, v2) = runs.values()
        assert _same(p1 + m1 + v1, p2 + m2 + v2), t


def test_torch_adamw_bit_for_bit():
    """The params and moments of ``torch.optim.AdamW(fused=True)``'s steps (whose params are
    ``p'``; the public step's are ``p + (p' - p)``, equal where ``p' - p`` is exact)."""
    gen = torch.Generator().manual_seed(6)
    params = [torch.randn(n, generator=gen) for n in (300, 5)]
    ours = [p.clone() for p in params]
    ms, vs = [torch.zeros_like(p) for p in ours], [torch.zeros_like(p) for p in ours]
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(theirs, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                            fused=True)  # fmt: skip
    for t in range(1, 4):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for p, g in zip(theirs, grads, strict=True):
            p.grad = g.clone()
        before = [p.detach().clone() for p in theirs]
        opt.step()
        kw = {"step": t, "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
        K.adamw_step(ours, grads, ms, vs, **kw)
        want = [b + (p.detach() - b) for b, p in zip(before, theirs, strict=True)]
        assert _same(ours, want)
        assert _same(ms + vs, [opt.state[p][k] for k in ("exp_avg", "exp_avg_sq") for p in theirs])
        ours = [w.clone() for w in want]  # both go on from torch's params


def test_public_op_defaults_checks_and_dispatch():
    ps, gs, ms, vs = _leaves([9, 4], torch.float32, 5, False)
    want = [x.clone() for x in ps + ms + vs]
    _reference.adamw_step(
        want[:2], gs, want[2:4], want[4:], want[2:4], want[4:], 2.0, 0.1, 0.9, 0.99, 1e-8, 0.1
    )
    kw = {"step": 2, "lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    m_outs, v_outs = K.adamw_step(ps, gs, ms, vs, **kw)
    assert all(a is b for a, b in zip(m_outs + v_outs, ms + vs, strict=True))
    assert _same(ps + ms + vs, want)
    with pytest.raises(ValueError, match="gs has 1 tensors for 2 params"):
        K.adamw_step(ps, gs[:1], ms, vs, **kw)
    with pytest.raises(ValueError, match="a tensor of vs differs"):
        K.adamw_step(ps, gs, ms, [v.double() for v in vs], **kw)
    assert K.adamw_step([], [], [], [], **kw) == ([], [])
