"""Triton kernels for CUDA and XPU (imported only when Triton is installed).

They follow the canonical orders of ``fn.kernels._reference``: a program handles ``GROUP``
blocks of 1024 elements; inside a block, lane ``j`` of 16 adds the squares of elements
``j, j+16, ...`` in fp64 in that order, then the lanes fold as ``lane[j] + lane[j+h]`` for
``h = 8, 4, 2, 1`` (a sum over an axis of length 2 is one addition, so its order is fixed).
"""

import triton
import triton.language as tl


@triton.jit
def sign_blocks_kernel(x_ptr, bits_ptr, sums_ptr, n, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    lanes = tl.arange(0, 16)
    blocks = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP).to(tl.int64)
    weights = (1 << (7 - tl.arange(0, 8))).to(tl.int32)
    nbytes = (n + 7) // 8
    acc = tl.zeros((GROUP, 16), dtype=tl.float64)
    for k in range(BLOCK // 16):
        idx = blocks[:, None] * BLOCK + k * 16 + lanes[None, :]
        inside = idx < n
        v = tl.load(x_ptr + idx, mask=inside, other=0.0)
        d = v.to(tl.float64)
        acc += d * d
        bit = ((v >= 0) & inside).to(tl.int32)
        byte = tl.sum(tl.reshape(bit, (GROUP, 2, 8)) * weights[None, None, :], axis=2)
        byte_idx = blocks[:, None] * (BLOCK // 8) + k * 2 + tl.arange(0, 2)[None, :]
        tl.store(bits_ptr + byte_idx, byte.to(tl.uint8), mask=byte_idx < nbytes)
    acc = tl.sum(tl.reshape(acc, (GROUP, 2, 8)), axis=1)
    acc = tl.sum(tl.reshape(acc, (GROUP, 2, 4)), axis=1)
    acc = tl.sum(tl.reshape(acc, (GROUP, 2, 2)), axis=1)
    acc = tl.sum(acc, axis=1)
    tl.store(sums_ptr + blocks, acc, mask=blocks < (n + BLOCK - 1) // BLOCK)


@triton.jit
def packbits_kernel(x_ptr, bits_ptr, n, BYTES: tl.constexpr):
    byte_idx = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES).to(tl.int64)
    idx = byte_idx[:, None] * 8 + tl.arange(0, 8)[None, :]
    inside = idx < n
    v = tl.load(x_ptr + idx, mask=inside, other=0.0)
    bit = ((v >= 0) & inside).to(tl.int32)
    byte = tl.sum(bit * (1 << (7 - tl.arange(0, 8)))[None, :], axis=1)
    tl.store(bits_ptr + byte_idx, byte.to(tl.uint8), mask=byte_idx < (n + 7) // 8)


@triton.jit
def unpackbits_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = idx < n
    byte = tl.load(bits_ptr + idx // 8, mask=inside, other=0).to(tl.int32)
    bit = (byte >> (7 - (idx % 8)).to(tl.int32)) & 1
    out = tl.where(bit != 0, 1.0, -1.0)
    tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=inside)
