"""Ascend NPU hook: packed signs from ``torch_npu.npu_sign_bits_pack``.

``npu_sign_bits_pack`` packs least-significant-bit first, so each byte is bit-reversed to
fn's most-significant-bit-first order. The scale and new error use the reference formulas.
"""

from __future__ import annotations

import torch

from fn.kernels import _reference
from fn.kernels._spec import implementation

_REVERSED = tuple(int(f"{i:08b}"[::-1], 2) for i in range(256))


@implementation()
def packbits(x):
    if x.dtype not in (torch.float32, torch.float16) or x.numel() == 0:
        return None
    import torch_npu

    # -0.0 + 0.0 is +0.0, so -0.0 gets bit 1 whatever the NPU's rule for negative zero.
    lsb_first = torch_npu.npu_sign_bits_pack(x.contiguous() + 0.0, 1).view(-1)
    table = torch.tensor(_REVERSED, dtype=torch.uint8, device=x.device)
    return table[lsb_first.long()]


@implementation()
def sign_compress(m, error=None):
    return _reference.sign_compress_with(packbits, m, error)
