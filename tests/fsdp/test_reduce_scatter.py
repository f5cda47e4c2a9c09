"""QuantizedReduceScatter called as FSDP2 calls it, on gloo ranks, against exact references.

Every rank's input is a seeded function of its rank, so every rank can rebuild all inputs and
the exact ``dist.reduce_scatter_tensor`` result in fp64.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import fn.collectives.quantized as quantized
from fn.collectives import Simulated, quantized_reduce_scatter, simulate
from fn.fsdp import QuantizedReduceScatter, loco_reduce_scatter, reduce_scale
from tests._distributed import run_distributed, run_together
from tests.fsdp import test_fsdp

ROW = 37  # values per rank's row: not a multiple of the quantization group
GROUP = 8
BETA = 0.8
STEPS = 5
OPS = {
    "avg": lambda: dist.ReduceOp.AVG,
    "sum": lambda: dist.ReduceOp.SUM,
    "premul": lambda: dist.ReduceOp.PREMUL_SUM(0.3),
}


def inputs(world_size: int, row: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """``[W, W * row]``: rank ``i``'s reduce-scatter input is row ``i``."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 1, world_size * row).view(1, -1)
    return (torch.randn(world_size, world_size * row, generator=g) * scales).to(dtype)


def exact(x: torch.Tensor, op_name: str, rank: int) -> torch.Tensor:
    """``dist.reduce_scatter_tensor``'s result for ``rank``, in fp64."""
    world_size = x.shape[0]
    total = x.double().sum(0).view(world_size, -1)[rank]
    return total * reduce_scale(OPS[op_name](), world_size) / world_size


def call(rs, x: torch.Tensor, op, rank: int) -> torch.Tensor:
    cpu = torch.device("cpu")
    out = rs.allocate((x.shape[1] // x.shape[0],), dtype=x.dtype, device=cpu)
    buffer = rs.allocate((x.shape[1],), dtype=x.dtype, device=cpu)
    buffer.copy_(x[rank])
    rs(out, buffer, dist.group.WORLD, op)
    return out


def _worker_two_ranks(rank: int, world_size: int) -> dict:
    out = {}
    for op_name in OPS:
        for dtype in (torch.float32, torch.bfloat16):
            x = inputs(world_size, ROW, seed=1, dtype=dtype)
            rs = QuantizedReduceScatter(bits=8, group_size=GROUP, err_beta=None)
            out["qgz", op_name, dtype] = call(rs, x, OPS[op_name](), rank)
    x = inputs(world_size, ROW, seed=1)
    dense = torch.empty(ROW)
    dist.reduce_scatter_tensor(dense, x[rank].clone(), dist.ReduceOp.SUM)
    out["dense_sum"] = dense

    rs = QuantizedReduceScatter(bits=8, group_size=GROUP, err_beta=None)
    aligned = inputs(world_size, 4 * GROUP, seed=2)
    out["aligned"] = call(rs, aligned, dist.ReduceOp.AVG, rank)

    for beta in (BETA, 0.0):
        rs = QuantizedReduceScatter(bits=4, group_size=GROUP, err_beta=beta)
        outs = [
            call(rs, inputs(world_size, ROW, seed=10 + t), dist.ReduceOp.AVG, rank)
            for t in range(STEPS)
        ]
        errors = [torch.empty_like(rs.errors[0]) for _ in range(world_size)]
        dist.all_gather(errors, rs.errors[0])
        out["loco", beta] = torch.stack(outs), torch.stack(errors), int(rs.count)

    def fresh():
        return QuantizedReduceScatter(bits=4, group_size=GROUP, err_beta=BETA, reset_T=2)

    rs = fresh()
    outs = [
        call(rs, inputs(world_size, ROW, seed=30 + t), dist.ReduceOp.AVG, rank) for t in range(3)
    ]
    alone = [
        call(fresh(), inputs(world_size, ROW, seed=30 + t), dist.ReduceOp.AVG, rank) for t in (1, 2)
    ]
    out["reset_T"] = torch.equal(outs[1], alone[0]), torch.equal(outs[2], alone[1])

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("fn.fsdp.reduce_scatter")
    logger.addHandler(handler)
    try:
        rs = QuantizedReduceScatter(bits=4, group_size=GROUP, err_beta=BETA, name="layer")
        call(rs, inputs(world_size, ROW, seed=3), dist.ReduceOp.AVG, rank)
        before = rs.layout, int(rs.count), tuple(e.shape for e in rs.errors)
        call(rs, inputs(world_size, ROW + 5, seed=3), dist.ReduceOp.AVG, rank)
        after = rs.layout, int(rs.count), tuple(e.shape for e in rs.errors)
    finally:
        logger.removeHandler(handler)
    out["layout"] = before, after, [r.getMessage() for r in records]

    rs = QuantizedReduceScatter(bits=4, group_size=GROUP, err_beta=BETA)
    call(rs, inputs(world_size, ROW, seed=4), dist.ReduceOp.AVG, rank)
    saved = {k: v.clone() for k, v in rs.state_dict().items()}
    bad = inputs(world_size, ROW, seed=5)
    bad[1, 3] = torch.nan
    nan_out = call(rs, bad, dist.ReduceOp.AVG, rank)
    same = all(torch.equal(saved[k], v) for k, v in rs.state_dict().items())
    out["non_finite"] = bool(nan_out.isnan().all()), same
    try:
        call(rs, inputs(world_size, ROW, seed=4), dist.ReduceOp.MAX, rank)
        out["max"] = None
    except ValueError as err:
        out["max"] = str(err)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_distributed(_worker_two_ranks, 2, timeout=240)


def quantization_bound(x: torch.Tensor, op_name: str, bits: int, hops: int = 1) -> float:
    """``|out - exact|`` bound: a value moves by at most one step ``absmax / 2^(bits-1)`` per
    quantization (half a step, or a whole one where +absmax clamps to ``2^(bits-1) - 1``); every
    hop adds the W ranks' errors (hop 2 quantizes node sums: L times the values, W / L ranks);
    the op scales the mean."""
    world_size = x.shape[0]
    step = x.double().abs().max() / 2 ** (bits - 1)
    per_hop = step * world_size
    return float(hops * per_hop * reduce_scale(OPS[op_name](), world_size) / world_size)


@pytest.mark.timeout(300)
def test_qgz_within_quantization_error_of_reduce_scatter(two_ranks):
    for op_name in OPS:
        for dtype in (torch.float32, torch.bfloat16):
            x = inputs(2, ROW, seed=1, dtype=dtype)
            for rank in range(2):
                got = two_ranks[rank]["qgz", op_name, dtype]
                assert got.dtype == dtype and got.shape == (ROW,)
                want = exact(x, op_name, rank)
                bound = quantization_bound(x, op_name, bits=8)
                if dtype == torch.bfloat16:  # the written-back value is rounded to bf16
                    bound += float(want.abs().max()) * 2**-8
                err = float((got.double() - want).abs().max())
                assert err <= bound, (op_name, dtype, rank, err, bound)
                assert err > 0  # it was quantized
    x = inputs(2, ROW, seed=1)
    for rank in range(2):  # the SUM reference is gloo's own reduce-scatter
        torch.testing.assert_close(two_ranks[rank]["dense_sum"].double(), exact(x, "sum", rank))


@pytest.mark.timeout(300)
def test_ranks_match_fn_quantized_reduce_scatter(two_ranks):
    """Rows of whole groups: rank r's output is chunk r of fn.collectives' reduce-scatter."""
    x = inputs(2, 4 * GROUP, seed=2)
    comm = Simulated(2)
    want = simulate(
        lambda v: quantized_reduce_scatter(v, comm=comm, bits=8, group_size=GROUP), comm
    )(x)
    for rank in range(2):
        torch.testing.assert_close(two_ranks[rank]["aligned"], want[rank], atol=1e-6, rtol=0)


@pytest.mark.timeout(300)
def test_error_feedback_telescopes(two_ranks):
    """From zero error, with r_t = v_t - DQ(q_t) and e_{t+1} = beta e_t + (1 - beta) r_t:
    sum_t DQ(q_t) = sum_t x_t - e_T / (1 - beta) on every rank, so on rank r
    sum_t out_t + (1 / ((1 - beta) W)) sum_i e_{i,T}[row r] = sum_t mean_t[row r]."""
    world_size = 2
    truth = sum(inputs(world_size, ROW, seed=10 + t).double() for t in range(STEPS))
    for beta in (BETA, 0.0):
        for rank in range(world_size):
            outs, errors, count = two_ranks[rank]["loco", beta]
            assert count == STEPS
            rows = errors.view(world_size, world_size, -1)[:, rank, :ROW].double()
            lhs = outs.double().sum(0) + rows.sum(0) / ((1 - beta) * world_size)
            want = truth.sum(0).view(world_size, -1)[rank] / world_size
            torch.testing.assert_close(lhs, want, atol=1e-5, rtol=1e-5)
            # without the error term the identity fails: the feedback holds real mass
            assert (outs.double().sum(0) - want).abs().max() > 1e-4


@pytest.mark.timeout(300)
def test_reset_T_zeroes_the_error_every_reset_T_calls(two_ranks):
    for rank in range(2):
        # call 2 uses call 1's error; call 3 (count 2 % reset_T == 0) starts from zero again
        assert two_ranks[rank]["reset_T"] == (False, True)


@pytest.mark.timeout(300)
def test_layout_change_resets_with_a_log(two_ranks):
    for rank in range(2):
        before, after, messages = two_ranks[rank]["layout"]
        assert before == ((2 * ROW, 2), 1, ((2 * 40,),))
        assert after == ((2 * (ROW + 5), 2), 1, ((2 * 48,),))
        assert len(messages) == 1 and "layer" in messages[0] and "reset" in messages[0]


@pytest.mark.timeout(300)
def test_non_finite_input_gives_nan_and_keeps_state(two_ranks):
    for rank in range(2):
        assert two_ranks[rank]["non_finite"] == (True, True)
        assert "ReduceOp.AVG, SUM or PREMUL_SUM" in two_ranks[rank]["max"]


def _worker_two_hop(rank: int, world_size: int) -> dict:
    out = {}
    for op_name in ("avg", "premul"):
        x = inputs(world_size, ROW, seed=6)
        rs = QuantizedReduceScatter(bits=8, group_size=GROUP, err_beta=None, local_world_size=2)
        out["qgz", op_name] = call(rs, x, OPS[op_name](), rank)
    rs = QuantizedReduceScatter(bits=4, group_size=GROUP, err_beta=BETA, local_world_size=2)
    outs = [
        call(rs, inputs(world_size, ROW, seed=20 + t), dist.ReduceOp.AVG, rank)
        for t in range(STEPS)
    ]
    out["loco"] = torch.stack(outs), [tuple(e.shape) for e in rs.errors]

    dense = test_fsdp.grads(test_fsdp.build(world_size), rank)
    model = test_fsdp.build(world_size)
    loco_reduce_scatter(model, bits=8, group_size=4, err_beta=None, local_world_size=2)
    out["fsdp"] = dense, test_fsdp.grads(model, rank)
    return out


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list]:
    """The 4-rank workers of this file, in one launch."""
    return run_together(
        {"two hop": (_worker_two_hop, ()), "sizes": (_worker_sizes, ())}, 4, timeout=400
    )


@pytest.mark.timeout(500)
def test_two_hop_four_ranks(four_ranks):
    results = four_ranks["two hop"]
    for op_name in ("avg", "premul"):
        x = inputs(4, ROW, seed=6)
        for rank in range(4):  # rank r gets row r, through the intra-node and inter-node hops
            err = (results[rank]["qgz", op_name].double() - exact(x, op_name, rank)).abs().max()
            assert err <= quantization_bound(x, op_name, bits=8, hops=2), (op_name, rank)
    truth = sum(inputs(4, ROW, seed=20 + t).double() for t in range(STEPS)) / 4
    for rank in range(4):
        outs, shapes = results[rank]["loco"]
        assert shapes == [(4 * 40,), (2 * 40,)]
        drift = outs.double().sum(0) - truth.sum(0).view(4, -1)[rank]
        # telescoping per hop: the summed outputs miss the truth by the last errors / (1 - beta)
        bound = quantization_bound(inputs(4, ROW, seed=20), "avg", 4, 2) / (1 - BETA)
        assert drift.abs().max() <= bound
        dense, quantized = results[rank]["fsdp"]  # FSDP2 gradients through the two hops
        for name, want in dense.items():
            err = float((quantized[name] - want).abs().max())
            assert err <= 2 * 3 * float(want.abs().max()) * 2 / 128 + 1e-7, name


def _worker_sizes(rank: int, world_size: int) -> dict:
    """Rank 3's FSDP2 buffer holds rows of another length (another padded size): the fused and
    the padded path, one hop and two, from a state that a first call made."""
    out = {}
    eager = quantized.eager
    for local in (None, 2):
        for fused in (True, False):
            if not fused:  # the path taken under torch.compile
                quantized.eager = lambda *tensors: False
            try:
                rs = QuantizedReduceScatter(
                    bits=4, group_size=GROUP, err_beta=BETA, local_world_size=local
                )
                call(rs, inputs(world_size, ROW, seed=7), dist.ReduceOp.AVG, rank)
                before = rs.layout, {k: v.clone() for k, v in rs.state_dict().items()}
                row = ROW + 64 if rank == 3 else ROW
                x = inputs(world_size, row, seed=8)[rank]
                buffer, output = x.clone(), torch.full((row,), 7.0)
                try:
                    rs(output, buffer, dist.group.WORLD, dist.ReduceOp.AVG)
                    message = None
                except ValueError as err:
                    message = str(err)
                state = rs.state_dict()
                kept = rs.layout == before[0] and all(
                    torch.equal(v, state[k]) for k, v in before[1].items()
                )
                untouched = torch.equal(buffer, x) and bool((output == 7.0).all())
                after = call(rs, inputs(world_size, ROW, seed=9), dist.ReduceOp.AVG, rank)
                out[local, fused] = message, kept, untouched, bool(after.isfinite().all())
            finally:
                quantized.eager = eager
    return out


@pytest.mark.timeout(500)
def test_different_sizes_raise_on_every_rank_and_keep_the_state(four_ranks):
    results = four_ranks["sizes"]
    counts = ", ".join(f"rank {r}: {4 * ROW} elements" for r in range(3))
    expected = (
        f"quantized allreduce: the ranks passed tensors of different sizes ({counts}, "
        f"rank 3: {4 * (ROW + 64)} elements); every rank must pass the same number of "
        "elements. Nothing was changed."
    )
    for rank in range(4):
        assert len(results[rank]) == 4
        for path, (message, kept, untouched, after) in results[rank].items():
            assert message == expected, (rank, path, message)
            assert kept and untouched and after, (rank, path)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(bits=3), ValueError, "bits"),
        (dict(group_size=7), ValueError, "group_size"),
        (dict(err_beta=1.0), ValueError, "err_beta"),
        (dict(reset_T=0), ValueError, "reset_T"),
        (dict(local_world_size=0), ValueError, "local_world_size"),
        (dict(bits=8.0), TypeError, r"bits must be an int, got 8\.0 \(float\)"),
        (dict(bits=True), TypeError, "bits must be an int"),
        (dict(group_size="8"), TypeError, "group_size must be an int"),
        (dict(err_beta="0.8"), TypeError, "err_beta must be a float or None"),
        (dict(err_beta=False), TypeError, "err_beta must be a float or None"),
        (dict(reset_T=True), TypeError, "reset_T must be an int"),
        (dict(local_world_size=2.0), TypeError, "local_world_size must be an int"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        QuantizedReduceScatter(**kwargs)
