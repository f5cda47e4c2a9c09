"""``fn.kernels.adamw_step``: the C kernel against the reference (torch's fused AdamW kernel on a
copy of the params, then ``p + (p' - p)``), bit for bit, in every build of the C source."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn.kernels as K
from fn.kernels import _cpu, _reference
from tests.kernels.test_implementations import OLDER_CPUS, use_c_kernels_built_for

_DTYPES = (torch.float32, torch.float64)
_SPECIAL = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-310, 3e38)


@pytest.fixture(scope="module")
def c_kernels():
    if _cpu.library() is None:
        pytest.skip("no working C compiler: the CPU kernels fall back to the reference")
    if not all(_cpu._adamw_lanes(d, s) for d in _DTYPES for s in (True, False)):
        pytest.skip("torch's fused AdamW kernel rounds otherwise on this build: the C one is off")
    return _cpu


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
)
def test_c_kernel_matches_the_reference(
    c_kernels, sizes, dtype, seed, special, hyper, separate_outputs
):
    got, want = _both(c_kernels.adamw_step, sizes, dtype, seed, special, hyper, separate_outputs)
    assert _same(got, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_cut_across_leaves(c_kernels, monkeypatch, threads):
    monkeypatch.setattr(_cpu, "_CHUNK", 48)  # chunks of 48 elements: many per leaf, and across
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sizes = [0, 5, 100, 17, 0, 1, 256, 31]
        hyper = (3.0, 1e-3, 0.9, 0.999, 1e-8, 1e-2)
        for dtype in _DTYPES:
            got, want = _both(c_kernels.adamw_step, sizes, dtype, 0, True, hyper, False)
            assert _same(got, want)
    finally:
        torch.set_num_threads(previous)


def test_many_steps_stay_identical(c_kernels):
    runs = {impl: _leaves([1000, 7, 129], torch.float32, 3, False) for impl in ("c", "reference")}
    gen = torch.Generator().manual_seed(4)
    for t in range(1, 41):
        grads = [torch.randn(p.shape, generator=gen) * 1e-2 for p in runs["c"][0]]
        hyper = (float(t), 2.0**-10, 0.9, 0.999, 1e-8, 1e-2)
        for impl, (ps, _, ms, vs) in runs.items():
            step = c_kernels.adamw_step if impl == "c" else _reference.adamw_step
            step(ps, grads, ms, vs, ms, vs, *hyper)
        (p1, _, m1, v1), (p2, _, m2, v2) = runs.values()
        assert _same(p1 + m1 + v1, p2 + m2 + v2), t


@OLDER_CPUS
def test_other_c_code_paths_bit_exact(c_kernels, march, needs, tmp_path, monkeypatch):
    """The AVX2 and plain-C (scalar ``fmaf``) branches, built for an older CPU. The plain-C
    build (libm's ``fmaf``, the compiler's operand order) may give a NaN of another sign where
    two NaNs meet; torch's AVX2 kernel, which it follows, never runs without AVX2 anyway."""
    same = _same if march == "haswell" else _same_but_nan_signs
    use_c_kernels_built_for(march, needs, tmp_path, monkeypatch)
    for dtype in _DTYPES:
        for beta1 in (0.9, 0.3, 0.0):
            hyper = (5.0, 1e-3, beta1, 0.999, 1e-8, 1e-2)
            sizes = [4096 + 15, 3, 0, 33]
            for seed in range(3):
                got, want = _both(_cpu._adamw_c, sizes, dtype, seed, True, hyper, True)
                assert same(got, want), (march, dtype, beta1, seed)


def test_the_check_against_torch_detects_another_rounding(c_kernels, monkeypatch):
    """With the tail rounded as the vector lanes, the one-time check fails: the reference runs."""
    _cpu._adamw_lanes.cache_clear()
    monkeypatch.setattr(_cpu, "_ADAM_VECTOR_BYTES", (4, 8))  # 1 or 2 fp32 lanes
    try:
        assert _cpu._adamw_lanes(torch.float32, True) is None
        assert not _cpu.adamw_step_runs(torch.float32, 0.9)
    finally:
        monkeypatch.undo()
        _cpu._adamw_lanes.cache_clear()
    assert _cpu._adamw_lanes(torch.float32, True) in (8, 16)


def test_the_vector_length_is_found_by_running_torchs_kernel(c_kernels, monkeypatch):
    """The check tries the 512-bit length too: a build whose kernel runs it is followed."""
    _cpu._adamw_lanes.cache_clear()
    found = _cpu._adamw_lanes(torch.float32, False)
    monkeypatch.setattr(_cpu, "_ADAM_VECTOR_BYTES", (8, found * 4))  # a wrong length first
    try:
        _cpu._adamw_lanes.cache_clear()
        assert _cpu._adamw_lanes(torch.float32, False) == found
    finally:
        monkeypatch.undo()
        _cpu._adamw_lanes.cache_clear()


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
