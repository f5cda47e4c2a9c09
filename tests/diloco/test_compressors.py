"""The outer compressors: cast_allreduce and topk_allreduce against the plain references of
_reference.py, bit for bit, their bytes, their refusals, and the menu of fn.diloco.compression."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn
import fn.diloco
from fn.collectives import (
    Local,
    Simulated,
    TopkAllreduceState,
    TopkOwnerState,
    cast_allreduce,
    simulate,
    topk_allreduce,
    topk_message_bytes,
)
from tests.diloco import _reference


def _per_rank(world_size: int, shapes: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(world_size, *shape, generator=g) for name, shape in shapes.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_cast_allreduce_is_the_plain_mean_in_rank_order(dtype, world_size):
    comm = Simulated(world_size)
    x = _per_rank(world_size, {"w": (5, 3), "b": (7,)}, seed=world_size)
    x["unused"], x["empty"] = None, torch.zeros(world_size, 0)
    tx = cast_allreduce(dtype, comm=comm)
    out, state = simulate(tx.update, comm)(x, tx.init(x))
    assert state == fn.EmptyState() and out["unused"] is None and out["empty"].numel() == 0
    for name in ("w", "b"):
        expected = _reference.cast_mean(list(x[name]), dtype)
        for r in range(world_size):
            assert torch.equal(out[name][r], expected)
    n = 22
    n_w = -(-n // world_size) * world_size
    size = torch.finfo(dtype).bits // 8
    wire = (world_size - 1) * size * n_w // world_size
    assert comm.bytes_sent == 12 * (world_size - 1) + 2 * wire


def test_cast_allreduce_with_one_rank_passes_through_and_refuses_other_dtypes():
    x = {"w": torch.tensor([1 / 3])}
    out, _ = cast_allreduce(torch.bfloat16, comm=Local()).update(x, fn.EmptyState())
    assert out["w"] is x["w"]
    with pytest.raises(ValueError, match="dtype must be one of"):
        cast_allreduce(torch.int8, comm=Local())


def _run_topk(world_size, shapes, k, chunk_size, decay, steps, seed):
    comm = Simulated(world_size)
    tx = topk_allreduce(k, chunk_size, comm=comm, decay=decay)
    xs = [_per_rank(world_size, shapes, seed + s) for s in range(steps)]
    state = simulate(tx.init, comm)(xs[0])
    errors = {
        name: [torch.zeros(shape) for _ in range(world_size)] for name, shape in shapes.items()
    }
    for x in xs:
        out, state = simulate(tx.update, comm)(x, state)
        for name in shapes:
            mean, errors[name] = _reference.topk_allreduce(
                list(x[name]), errors[name], k, chunk_size, decay
            )
            for r in range(world_size):
                assert torch.equal(out[name][r], mean), (name, r)
                assert torch.equal(state.error[name][r], errors[name][r]), (name, r)
    return comm


@settings(max_examples=12, deadline=None)
@given(
    world_size=st.integers(1, 4),
    numel=st.integers(1, 40),
    log_chunk=st.integers(1, 4),
    k_fraction=st.floats(0.0, 1.0),
    decay=st.sampled_from([1.0, 0.95, 0.0]),
    seed=st.integers(0, 2**16),
)
def test_topk_allreduce_matches_the_reference(
    world_size, numel, log_chunk, k_fraction, decay, seed
):
    chunk_size = 2**log_chunk
    k = max(1, round(k_fraction * chunk_size))
    shapes = {"w": (numel,), "m": (3, 5)}
    _run_topk(world_size, shapes, k, chunk_size, decay, steps=3, seed=seed)


def test_topk_allreduce_sends_its_formula_bytes():
    shapes = {"w": (70,), "m": (4, 9)}  # 3 + 2 chunks of 32
    comm = _run_topk(3, shapes, k=5, chunk_size=32, decay=1.0, steps=2, seed=1)
    per_call = 2 * 12 + 2 * topk_message_bytes(5, 5, 32)  # all-gathers to W - 1 = 2 peers
    # L = floor(log2(32 / 5)) = 2 low bits a position, k + 32 / 2^L = 13 high bits a chunk
    assert topk_message_bytes(5, 5, 32) == (
        math.ceil(25 * 2 / 8) + math.ceil(5 * 13 / 8) + math.ceil(25 / 4) + 20
    )
    assert comm.bytes_sent == 2 * per_call


def test_topk_ties_go_to_the_lower_position_and_zeros_stay_zero():
    tx = topk_allreduce(2, 4, comm=Local())
    x = {"w": torch.tensor([1.0, -2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0])}
    out, state = tx.update(x, tx.init(x))
    # chunk 0 keeps positions 1 and 2 (the first two of magnitude 2); chunk 1 is all zero
    assert out["w"].tolist() == [0.0, -1.5, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert state.error["w"].tolist() == [1.0, -0.5, 0.5, 2.0, 0.0, 0.0, 0.0, 0.0]


def test_topk_refuses_non_finite_input_on_every_rank_and_changes_nothing():
    comm = Simulated(3)
    tx = topk_allreduce(2, 8, comm=comm)
    x = _per_rank(3, {"w": (10,)}, seed=0)
    state = simulate(tx.init, comm)(x)
    _, state = simulate(tx.update, comm)(x, state)
    before = state.error["w"].clone()
    x["w"][1, 3] = float("inf")
    with pytest.raises(fn.NonFiniteError, match="non-finite"):
        simulate(tx.update, comm)(x, state)
    assert torch.equal(state.error["w"], before)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"k": 2, "chunk_size": 6}, "power of two"),
        ({"k": 2, "chunk_size": 2**17}, "from 2 to 2"),
        ({"k": 9, "chunk_size": 8}, "k must be"),
        ({"k": 0, "chunk_size": 8}, "k must be"),
        ({"k": 2, "chunk_size": 8, "decay": 1.5}, "decay"),
    ],
)
def test_topk_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        topk_allreduce(comm=Local(), **kwargs)


def test_topk_none_and_empty_leaves_pass_through_with_their_errors():
    tx = topk_allreduce(1, 2, comm=Local())
    params = {"w": torch.ones(3), "frozen": torch.ones(2), "empty": torch.ones(0)}
    state = TopkAllreduceState({**tx.init(params).error, "frozen": torch.full((2,), 7.0)})
    out, new = tx.update({"w": torch.ones(3), "frozen": None, "empty": torch.ones(0)}, state)
    assert out["frozen"] is None and out["empty"].numel() == 0
    assert new.error["frozen"] is state.error["frozen"]
    assert new.error["empty"] is state.error["empty"]


@pytest.mark.parametrize("kind", fn.diloco.COMPRESSIONS)
def test_every_compression_gives_every_rank_the_same_mean(kind):
    options = {"topk": {"k": 4, "chunk_size": 16}, "int8": {"group_size": 8}}.get(kind, {})
    comm = Simulated(3)
    tx = fn.diloco.compression(kind, comm=comm, **options)
    x = _per_rank(3, {"w": (6, 5), "b": (3,)}, seed=3)
    state = simulate(tx.init, comm)(x)
    for _ in range(2):
        out, state = simulate(tx.update, comm)(x, state)
        for name in x:
            assert all(torch.equal(out[name][r], out[name][0]) for r in range(3)), (kind, name)
    exact = _reference.cast_mean(list(x["w"]), torch.float32)
    tolerance = {"fp32": 0.0, "bf16": 1e-2, "int8": 0.05}.get(kind)
    if tolerance is not None:  # no error feedback: each mean on its own is close
        torch.testing.assert_close(out["w"][0], exact, atol=tolerance, rtol=0.0)


def test_compression_refuses_unknown_kinds_and_options():
    for kind in ("fp8", ["fp32"]):
        with pytest.raises(ValueError, match="kind must be one of"):
            fn.diloco.compression(kind, comm=Local())
    with pytest.raises(TypeError, match="comm must be a fn.collectives.Comm .* got NoneType"):
        fn.diloco.compression("fp32", comm=None)
    with pytest.raises(ValueError, match="'onebit' takes no options; got k"):
        fn.diloco.compression("onebit", comm=Local(), k=3)
    takes = "takes k, chunk_size, exchange, server_k, round_trip_bytes; got group_size"
    with pytest.raises(ValueError, match=takes):
        fn.diloco.compression("topk", comm=Local(), group_size=8)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fn.diloco.sparseloco(k=True, chunk_size=8, comm=Local()), "k must be an int"),
        (lambda: fn.diloco.sparseloco(beta=1.5, comm=Local()), "sparseloco: beta must be in"),
        (lambda: fn.diloco.compression("topk", comm=Local(), chunk_size=True), "chunk_size"),
        (lambda: fn.diloco.compression("loco4", comm=Local(), err_beta=None), "err_beta must"),
        (lambda: fn.diloco.compression("loco4", comm=Local(), reset_T=True), "reset_T must"),
        (
            lambda: fn.diloco.compression("loco4", comm=Local(), error_dtype="bf16"),
            "error_dtype must be a float dtype or torch.int8, got 'bf16'",
        ),
        (
            lambda: fn.diloco.nesterov(fn.diloco.compression("fp32", comm=Local()), 0.7, math.inf),
            "momentum must be finite",
        ),
    ],
)
def test_the_outer_rules_refuse_settings_out_of_range_when_built(make, message):
    """A bool where a count belongs, a decay out of [0, 1], an infinite momentum, a dtype's
    name in place of the dtype: a ``ValueError`` naming the setting at construction, not a
    ``TypeError`` or a non-finite anchor at the first outer step."""
    with pytest.raises(ValueError, match=message):
        make()


def test_topk_and_sparseloco_pass_the_round_trips_worth_to_auto():
    """``round_trip_bytes`` reaches ``"auto"`` through ``compression("topk")`` and
    ``sparseloco``: at 8 workers of 38 chunks, owners below what they save, the all-gather at
    125,000 bytes (fn.collectives.topk_exchange_form)."""
    params, comm = {"w": torch.zeros(38 * 4096)}, Simulated(8)
    for worth, state_type in ((0, TopkOwnerState), (125_000, TopkAllreduceState)):
        topk = fn.diloco.compression("topk", comm=comm, k=128, round_trip_bytes=worth)
        outer = fn.diloco.sparseloco(k=128, comm=comm, round_trip_bytes=worth)
        assert isinstance(topk.init(params), state_type)
        assert isinstance(outer.init(params)[0], state_type)
