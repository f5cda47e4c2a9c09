"""fn.diloco on a CUDA device, where users train: the outer rules under ``Simulated``, DiLoCo
around a model on the GPU (its anchor there or on the host) resumed from a checkpoint, and ranks
that exchange CUDA tensors over gloo and over NCCL.

Skipped without CUDA (CI has none): run on a GPU machine with ``python3 -m pytest
tests/diloco/test_cuda.py``. Across devices the bits may differ (CUDA's kernels round a fused
multiply-add once), so the GPU is held to the CPU's result within rounding, and to itself (every
rank, a resumed run) bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fn.diloco
from fn.collectives import Local, ProcessGroup, Simulated, replicate, simulate
from tests._distributed import run_distributed
from tests.diloco._cases import KINDS, OPTIONS, drifts, outer_rule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
BACKEND = "nccl"
W = 3
SHAPE = (6, 7)
ANCHOR = torch.linspace(-1.0, 1.0, 42).view(SHAPE)
RULES = (*KINDS, "sparseloco-owner")


def _rule(kind: str, comm):
    if kind == "sparseloco-owner":
        return fn.diloco.sparseloco(comm=comm, exchange="owner", **OPTIONS["sparseloco"])
    return outer_rule(kind, comm)


def _simulated_anchors(kind: str, device: str) -> list[torch.Tensor]:
    """Three outer steps of ``kind`` on ``W`` simulated workers; every rank's anchor after each."""
    comm = Simulated(W)
    outer = _rule(kind, comm)
    anchors = replicate({"w": ANCHOR.to(device)}, comm)
    state = simulate(outer.init, comm)(anchors)
    step = simulate(lambda a, p, s: fn.diloco.outer_step(outer, a, p, s, comm=comm), comm)
    out = []
    for move in drifts(SHAPE, W, steps=3, seed=0):
        result = step(anchors, {"w": anchors["w"] + move.to(device)}, state)
        assert bool(result.applied.all())
        anchors, state = result.anchor, result.state
        out.append(anchors["w"])
    return out


@pytest.mark.parametrize("kind", RULES)
def test_outer_rules_on_cuda_agree_across_ranks_and_with_the_cpu(kind):
    on_gpu = _simulated_anchors(kind, DEVICE)
    on_cpu = _simulated_anchors(kind, "cpu")
    for step, (gpu, cpu) in enumerate(zip(on_gpu, on_cpu, strict=True)):
        assert gpu.device.type == DEVICE and gpu.dtype == torch.float32
        for r in range(1, W):
            assert torch.equal(gpu[r], gpu[0]), (step, r)
        # the first step's selection is the CPU's (no error feedback yet to round differently)
        if step == 0 or kind not in ("topk", "sparseloco", "sparseloco-owner"):
            torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-6)


def _model(device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(
        device
    )


def _train(model, inner, steps, start):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 5, generator=g).to(next(model.parameters()).device)
        model(x).square().mean().backward()
        inner.step()
        inner.zero_grad()


def _diloco(model, options, group=None):
    inner = torch.optim.AdamW(model.parameters(), lr=0.02)
    return inner, fn.diloco.DiLoCo(model, inner, group=group, **{"sync_every": 3, **options})


WRAPPER_CASES = {
    "nesterov-int8": {"compression": "int8"},
    "sparseloco": {"outer": "sparseloco", "outer_options": {"k": 4, "chunk_size": 16}},
    "sparseloco-anchor-on-host": {
        "outer": "sparseloco",
        "outer_options": {"k": 4, "chunk_size": 16},
        "anchor_device": "cpu",
    },
    "streaming-fp32": {"sync_every": 6, "fragments": 3, "delay": 1},
}


@pytest.mark.parametrize("case", WRAPPER_CASES)
def test_diloco_trains_a_cuda_model_and_resumes_bit_for_bit(case):
    """Eleven inner steps straight against five, a checkpoint, and six more in a new model,
    optimizer and DiLoCo; the model stays on the GPU."""
    options = WRAPPER_CASES[case]
    model = _model(DEVICE)
    inner, diloco = _diloco(model, options)
    _train(model, inner, 11, 0)
    assert diloco.outer_steps > 0
    assert all(p.device.type == DEVICE for p in model.parameters())

    first = _model(DEVICE)
    first_inner, first_diloco = _diloco(first, options)
    _train(first, first_inner, 5, 0)
    saved = {
        "model": first.state_dict(),
        "inner": first_inner.state_dict(),
        "diloco": first_diloco.state_dict(),
    }
    del first_diloco
    resumed = _model(DEVICE)
    resumed_inner, resumed_diloco = _diloco(resumed, options)
    resumed.load_state_dict(saved["model"])
    resumed_inner.load_state_dict(saved["inner"])
    resumed_diloco.load_state_dict(saved["diloco"])
    _train(resumed, resumed_inner, 6, 5)
    assert resumed_diloco.outer_steps == diloco.outer_steps
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


GROUP_CASES = ("fp32", "topk", "sparseloco", "sparseloco-owner")


def _group_options(kind: str) -> dict:
    if kind in ("fp32", "topk"):
        return {"compression": kind, "compression_options": OPTIONS.get(kind, {})}
    exchange = "owner" if kind == "sparseloco-owner" else "gather"
    return {
        "outer": "sparseloco",
        "outer_options": {**OPTIONS["sparseloco"], "exchange": exchange},
    }


def test_gloo_ranks_exchange_cuda_tensors_and_agree_bit_for_bit():
    """Two gloo ranks on the one GPU, each training its own data: after two outer steps both
    hold the same parameters, moved from where they started."""
    results = run_distributed(_gloo_worker_at_sync, 2, timeout=240)
    for kind in GROUP_CASES:
        for a, b in zip(results[0][kind], results[1][kind], strict=True):
            assert torch.equal(a, b), kind
        start = _model("cpu").parameters()
        assert not all(torch.equal(a, b) for a, b in zip(results[0][kind], start, strict=True))


def _gloo_worker_at_sync(rank: int, world_size: int) -> dict:
    out = {}
    for kind in GROUP_CASES:
        model = _model(DEVICE)
        inner, diloco = _diloco(model, _group_options(kind), group=ProcessGroup(timeout=60))
        _train(model, inner, 6, 100 * rank)
        assert diloco.outer_steps == 2
        out[kind] = [p.detach().cpu() for p in model.parameters()]
    return out


def test_a_nccl_group_of_one_rank_steps_as_local():
    """One process, one GPU: an NCCL group of one rank (every collective on the device) gives the
    bits of ``Local``."""
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    try:
        for kind in GROUP_CASES:
            got = []
            for group in (ProcessGroup(timeout=60), Local()):
                model = _model(DEVICE)
                inner, _ = _diloco(model, _group_options(kind), group=group)
                _train(model, inner, 7, 0)
                got.append(list(model.parameters()))
            for a, b in zip(*got, strict=True):
                assert torch.equal(a, b), kind
    finally:
        dist.destroy_process_group()
