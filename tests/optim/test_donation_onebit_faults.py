"""Steady-state allocation of ``fn.optim.OnebitAdam``'s compressed phase on 2 gloo ranks: no
fresh full-size tensor per step (counted as minor page faults in every rank)."""

from __future__ import annotations

import resource
import warnings

import pytest
import torch

import fn.optim
from tests._distributed import run_distributed

NUMEL = 1 << 22
PAGES_OF_ONE_BUFFER = NUMEL * 4 // 4096


def _compressed_faults(rank, world_size):
    warnings.simplefilter("ignore", RuntimeWarning)
    gen = torch.Generator().manual_seed(rank)
    param = torch.nn.Parameter(torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)))
    param.grad = torch.randn(NUMEL, generator=gen) * 1e-3  # kept: backward would allocate
    opt = fn.optim.OnebitAdam([param], lr=1e-3, freeze_step=2)
    for _ in range(4):  # 2 warmup updates, then 2 compressed ones to warm the buffers
        opt.step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        opt.step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.timeout(300)
def test_onebit_adam_compressed_steady_state_allocates_no_full_size_tensor():
    # fresh ranks: a forked one would also fault on the pages of the heap it inherited
    faults = run_distributed(_compressed_faults, 2, timeout=280, start_method="spawn")
    assert all(f < PAGES_OF_ONE_BUFFER // 4 for f in faults), (
        f"minor page faults in 3 compressed steps per rank: {faults} "
        f"(one 2^22 fp32 buffer is {PAGES_OF_ONE_BUFFER} pages)"
    )
