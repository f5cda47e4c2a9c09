"""Test-only Triton kernels: elementwise probes of the fp64 emulation, and a kernel with the
in-kernel i32 bound that the index check must reject."""

import triton
import triton.language as tl

from fn.kernels import _triton_kernels as k


@triton.jit
def square_f64_probe(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    v = tl.load(x_ptr + idx, mask=idx < n, other=0.0)
    tl.store(out_ptr + idx, k._square_f64(v), mask=idx < n)


@triton.jit
def add_f64_probe(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    a = tl.load(a_ptr + idx, mask=idx < n, other=0)
    b = tl.load(b_ptr + idx, mask=idx < n, other=0)
    tl.store(out_ptr + idx, k._add_f64(a, b), mask=idx < n)


@triton.jit
def i32_bound_kernel(x_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    tl.store(x_ptr + idx, 1, mask=idx < (n + 7) // 8)
