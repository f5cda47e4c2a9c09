"""QuantizedReduceScatter's fused path: the same bits as the padded path
(fn.collectives.quantized._reduce_scatter on the padded rows), errors updated in place (never in
buffers state_dict() handed out), no full-size allocation in steady state."""

from __future__ import annotations

import platform
import resource

import pytest
import torch
import torch.distributed as dist

import fn.collectives.quantized as quantized
from fn.collectives import ProcessGroup
from fn.collectives.quantized import _plan, _reduce_scatter
from fn.fsdp import QuantizedReduceScatter, reduce_scale
from tests._distributed import run_distributed
from tests.collectives.test_quantized_donation import FRESH, count_full_size_faults_only
from tests.fsdp.test_reduce_scatter import OPS, call, inputs

pytestmark = pytest.mark.distributed

ROWS = (64, 37)  # a multiple of the group (the output is written directly), and not
GROUP = 8
BETA = 0.8
STEPS = 5


def _padded_path(x, errors, count, comm, beta, op, rank):
    """What the padded path computes for this rank's input ``x[rank]``: rows padded apart."""
    world_size = x.shape[0]
    row = x.shape[1] // world_size
    plan = _plan(comm, 4, GROUP, None)
    if beta is not None and count % 2 == 0:  # reset_T = 2
        errors = tuple(torch.zeros_like(e) for e in errors)
    v = x[rank].float().view(world_size, row)
    v = torch.nn.functional.pad(v, (0, -row % GROUP)).reshape(-1)
    shard, new = _reduce_scatter(v, x.shape[1], errors or (None,), plan, beta or 0.0)
    shard = shard[:row]
    scale = reduce_scale(op, world_size)
    result = (shard if scale == 1.0 else shard * scale).to(x.dtype)
    return result, tuple(new) if beta is not None else errors


def _worker_identity(rank, world_size):
    comm = ProcessGroup()
    for row, beta in [(row, beta) for row in ROWS for beta in (None, BETA)]:
        for op_name, op in OPS.items():
            for dtype in (torch.float32, torch.bfloat16):
                rs = QuantizedReduceScatter(bits=4, group_size=GROUP, err_beta=beta, reset_T=2)
                errors = ()
                for step in range(STEPS):
                    x = inputs(world_size, row, seed=step, dtype=dtype)
                    errors_before = rs.errors
                    got = call(rs, x, op(), rank)
                    if step == 0:
                        errors = tuple(torch.zeros_like(e) for e in rs.errors)
                    want, errors = _padded_path(x, errors, step, comm, beta, op(), rank)
                    case = (row, beta, op_name, dtype, step)
                    assert torch.equal(got, want), case
                    for a, b in zip(rs.errors, errors, strict=True):
                        assert torch.equal(a, b), case
                    if step > 0 and beta is not None:  # in place
                        assert all(a is b for a, b in zip(rs.errors, errors_before, strict=True))
    # state_dict() hands out the buffers: later calls leave them alone
    rs = QuantizedReduceScatter(bits=4, group_size=GROUP, err_beta=BETA)
    call(rs, inputs(world_size, ROWS[1], seed=0), dist.ReduceOp.AVG, rank)
    saved = rs.state_dict()
    kept = saved["error.0"].clone()
    call(rs, inputs(world_size, ROWS[1], seed=1), dist.ReduceOp.AVG, rank)
    assert torch.equal(saved["error.0"], kept) and rs.errors[0] is not saved["error.0"]
    # a non-finite input on one rank: NaN output everywhere, errors unchanged
    x = inputs(world_size, ROWS[1], seed=2)
    x[1, 3] = torch.nan
    before = rs.errors[0].clone()
    assert bool(call(rs, x, dist.ReduceOp.AVG, rank).isnan().all())
    assert torch.equal(rs.errors[0], before)
    return True


@pytest.mark.timeout(240)
def test_fused_path_matches_the_padded_path_bit_for_bit():
    assert run_distributed(_worker_identity, 2, timeout=200) == [True, True]


def _worker_faults(rank, world_size, local_world_size, padded_path):
    if padded_path:  # the path the fused one replaces (taken under vmap and torch.compile)
        quantized.eager = lambda *tensors: False
    n = 1 << 22
    rs = QuantizedReduceScatter(
        bits=4, group_size=128, err_beta=BETA, local_world_size=local_world_size
    )
    torch.manual_seed(rank)
    x = torch.randn(n)
    out = torch.empty(n // world_size)
    windows = []
    for step in range(2 + 3 * 4):  # 2 warm-up calls, then 4 windows of 3 calls
        if step >= 2 and (step - 2) % 3 == 0:
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        rs(out, x, dist.group.WORLD, dist.ReduceOp.AVG)
        if step >= 2 and (step - 2) % 3 == 2:
            windows.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
    return min(windows)


@pytest.mark.timeout(800)  # three launches of fresh ranks, 250 s each at most
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the malloc tuning needs glibc")
def test_fused_path_allocates_no_full_size_buffer(monkeypatch):
    count_full_size_faults_only(monkeypatch)
    pages_of_one_buffer = (1 << 22) * 4 // resource.getpagesize()
    for local_world_size in (None, 1):
        faults = run_distributed(
            _worker_faults, 2, local_world_size, False, timeout=250, start_method=FRESH
        )
        assert max(faults) < pages_of_one_buffer // 4, (local_world_size, faults)
    # The measure can fail: the padded path allocates full-size buffers.
    faults = run_distributed(_worker_faults, 2, None, True, timeout=250, start_method=FRESH)
    assert min(faults) >= pages_of_one_buffer // 4, faults
