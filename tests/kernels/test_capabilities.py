"""The C kernels that sum over ranks (in rank order, ``fn.kernels.sum_ranks``) give the
reference's bits, and run instead of falling back to it, under every CPU capability torch can be
given on this host (``ATEN_CPU_CAPABILITY``): nothing of theirs depends on torch's build."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fn.kernels import _cpu

_CHECK = textwrap.dedent(
    """
    import sys
    import torch
    import fn.kernels as K
    from fn.kernels import _cpu, _reference

    capability = torch.backends.cpu.get_cpu_capability()
    if capability.lower() != sys.argv[1]:
        print("unavailable", capability)
        sys.exit(0)

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran instead of the C kernel")

    SHAPES = ((5, 4), (6, 12), (5, 8), (5, 24), (4, 40), (7, 104), (17, 4136), (4, 65544))
    gen = torch.Generator().manual_seed(0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for ranks, cols in SHAPES:
            x = torch.randn(ranks * cols, generator=gen) * torch.logspace(-6, 6, ranks * cols)
            q, scales = K.quantize(x, 4, 4)
            want = K.sum_ranks(K.dequantize(q, scales, 4, ranks * cols).view(ranks, -1))
            bits = -(-cols // 8)  # sign rows of whole bytes: cols rounded up to 8
            signs = torch.randint(0, 256, (ranks, bits), dtype=torch.uint8, generator=gen)
            weights = torch.rand(ranks, generator=gen) * torch.logspace(-3, 3, ranks)
            error = torch.randn(8 * bits, generator=gen)
            want_signs, want_scale = _reference.sign_sum_compress(signs, weights, error)
            want_error = torch.empty(8 * bits)
            _reference.sign_sum_apply_error(signs, weights, error, want_scale, want_error)
            saved = {name: getattr(_reference, name) for name in (
                "dequantize_sum", "sign_sum_compress", "sign_sum_apply_error")}
            for name in saved:
                setattr(_reference, name, refuse)
            got = torch.empty(cols)
            _cpu.dequantize_sum(q, scales, 4, ranks, got)
            got_signs, got_scale = _cpu.sign_sum_compress(signs, weights, error)
            got_error = torch.empty(8 * bits)
            _cpu.sign_sum_apply_error(signs, weights, error, got_scale, got_error)
            for name, impl in saved.items():
                setattr(_reference, name, impl)
            where = (capability, threads, ranks, cols)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), where
            assert torch.equal(got_signs, want_signs), where
            assert torch.equal(got_scale, want_scale), where
            assert torch.equal(got_error.view(torch.int32), want_error.view(torch.int32)), where
    print("checked", capability)
    """
)


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_kernels_match_the_reference_under_every_capability(capability):
    if _cpu.library() is None:
        pytest.skip("no working C compiler: the CPU kernels fall back to the reference")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, capability],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    if done.stdout.startswith("unavailable"):
        pytest.skip(f"this CPU or torch build has no {capability} kernels: {done.stdout}")
    assert done.stdout.startswith("checked"), done.stdout
