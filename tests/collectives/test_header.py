"""The header of an exchange (fn.collectives.header), and the exchanges of the outer compressors
that carry it: the same bits as their ``update``, one message for all leaves, the flags and the
caller's values of every rank on every rank, a rank that sits out (or whose input is not finite)
as ``update`` with its ``participation`` gives it, and their bytes (sent and received) against
their formulas."""

from __future__ import annotations

import functools

import pytest
import torch

import fn
from fn.collectives import (
    HEADER_BYTES,
    Participation,
    Simulated,
    cast_allreduce,
    cast_exchange_form,
    loco_allreduce,
    onebit_allreduce,
    padded_numel,
    quantized_allreduce,
    quantized_padded_numel,
    simulate,
)
from fn.collectives.header import opened, sealed
from fn.tree import tree_leaves

SHAPES = {"w": (5, 7), "b": (3,), "none": None, "empty": (0,)}
HEAD = HEADER_BYTES + 16  # the first collective's header, with two values of the caller's


def _inputs(world_size: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        name: None if shape is None else torch.randn(world_size, *shape, generator=g)
        for name, shape in SHAPES.items()
    }


def _same(a, b) -> bool:
    a, b = tree_leaves(a), tree_leaves(b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_header_carries_the_flag_the_slot_and_the_size_record():
    payload = torch.arange(6, dtype=torch.uint8).view(3, 2)
    rows = sealed(payload, torch.tensor(True), 70, 0xABCDEF, slots=True)
    assert rows.shape == (3, HEADER_BYTES + 2) and HEADER_BYTES == 20
    got = opened(rows[1:2].expand(3, -1), 70, "x", 0xABCDEF)  # rank 1's rows, say
    assert got.flags.tolist() == [True] * 3 and int(got.slot) == 1
    assert torch.equal(got.payload, payload[1:2].expand(3, -1))
    other = sealed(payload[:1], torch.tensor(False), 71, 0xABCDEF)
    mixed = torch.cat([rows[:1], other])
    with pytest.raises(ValueError, match="rank 0: 70 elements, rank 1: 71 elements"):
        opened(mixed, 70, "the exchange", 0xABCDEF)
    with pytest.raises(ValueError, match="different sets of tensors"):
        opened(rows, 70, "the exchange", 0x123456)


def test_the_header_carries_integers_below_2_to_the_48_exactly_and_refuses_others():
    extra = [0, 2**24 - 1, 2**24, 2**48 - 1]
    rows = sealed(torch.zeros(1, 0, dtype=torch.uint8), torch.tensor(True), 0, 5, extra=extra)
    assert opened(rows, 0, "x", 5, extra=len(extra)).extra.tolist() == [extra]
    for value in (-1, 2**48):
        with pytest.raises(ValueError, match=rf"integers in \[0, 2\^48\), got \[{value}\]"):
            sealed(torch.zeros(1, 0, dtype=torch.uint8), torch.tensor(True), 0, 5, extra=[value])


def _check_exchange(tx, comm, world_size, steps=3):
    """``exchange`` against ``update`` for ``steps`` calls, every rank taking part, then one with
    rank 1 sitting out (against ``update`` with its ``participation``) and one with rank 1's
    input not finite (it sits out too); the bytes of the last exchange where all took part."""
    x = _inputs(world_size, seed=world_size)
    state = simulate(tx.init, comm)(x)
    for step in range(steps):
        x = _inputs(world_size, seed=10 * world_size + step)
        want = simulate(tx.update, comm)(x, state)
        comm.reset_bytes_sent()
        comm.reset_bytes_received()
        got = simulate(functools.partial(tx.exchange, extra=(7, step)), comm)(x, state)
        assert _same(tuple(got[:2]), want), step
        assert got.participants.tolist() == [[True] * world_size] * world_size
        assert got.extra.tolist() == [[[7, step]] * world_size] * world_size
        state = want[1]
    sent = comm.bytes_sent
    assert sent == comm.bytes_received
    takes_part = torch.tensor([r != 1 for r in range(world_size)])
    part = Participation(takes_part, torch.full((world_size,), world_size - 1))
    want = simulate(lambda x, s, p: tx.update(x, s, participation=p), comm)(x, state, part)
    for flag in (takes_part, torch.ones(world_size, dtype=torch.bool)):
        if bool(flag.all()):  # rank 1 offers a NaN: it sits out all the same
            x["w"][1, 0, 0] = float("nan")
        got = simulate(tx.exchange, comm)(x, state, flag)
        assert got.participants.tolist() == [takes_part.tolist()] * world_size
        assert _same(tuple(got[:2]), want)
    return sent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_cast_exchange_has_the_bits_of_its_update_in_one_message(dtype, world_size):
    comm = Simulated(world_size)
    sent = _check_exchange(cast_allreduce(dtype, comm=comm), comm, world_size, steps=1)
    n, size = 38, torch.finfo(dtype).bits // 8
    share = -(-n // world_size) * size
    if cast_exchange_form(n, size, world_size) == "gather":  # W = 2: one all-gather
        assert world_size == 2 and sent == (world_size - 1) * (HEAD + size * n)
    else:  # the all_to_all to the owners, then the all-gather of their means
        assert sent == (world_size - 1) * (HEAD + share) + (world_size - 1) * share


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("loco", [False, True])
def test_the_quantized_exchange_has_the_bits_of_its_update_in_one_message(world_size, loco):
    comm = Simulated(world_size)
    if loco:  # reset_T 2: the errors are reset at the third call
        tx = loco_allreduce(4, 8, 0.8, 2, comm=comm)
    else:
        tx = quantized_allreduce(8, 8, comm=comm)
    sent = _check_exchange(tx, comm, world_size)
    bits = 4 if loco else 8
    per_rank = 0  # one chunk of each leaf: codes, then the fp32 scales
    for numel in (35, 3):
        chunk = quantized_padded_numel(numel, world_size, 8) // world_size
        per_rank += chunk * bits // 8 + 4 * chunk // 8
    assert sent == (world_size - 1) * (HEAD + per_rank) + (world_size - 1) * per_rank


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_onebit_exchange_has_the_bits_of_its_update_per_leaf_in_two_collectives(world_size):
    """Every leaf's signs and worker scale in one all_to_all, every owner's in one all-gather,
    where ``update`` makes four collectives per leaf (DeepSpeed's): the same bits, the worker
    and server errors included."""
    comm = Simulated(world_size)
    sent = _check_exchange(onebit_allreduce(comm=comm), comm, world_size)
    per_rank = sum(padded_numel(numel, world_size) // world_size // 8 + 4 for numel in (35, 3))
    assert sent == (world_size - 1) * (HEAD + per_rank) + (world_size - 1) * per_rank


def test_the_two_hop_mode_has_no_exchange():
    comm = Simulated(4)
    two_hops = loco_allreduce(4, 8, comm=comm, local_world_size=2)
    y = _inputs(4, seed=1)
    with pytest.raises(NotImplementedError, match="runs on one hop"):
        simulate(two_hops.exchange, comm)(y, simulate(two_hops.init, comm)(y))
    assert isinstance(two_hops, fn.collectives.Compressor)
    hierarchical = onebit_allreduce(comm=comm, local_world_size=2)
    with pytest.raises(NotImplementedError, match="runs flat"):
        simulate(hierarchical.exchange, comm)(y, simulate(hierarchical.init, comm)(y))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "make",
    [
        lambda comm: cast_allreduce(comm=comm),
        lambda comm: cast_allreduce(torch.bfloat16, comm=comm),
        lambda comm: quantized_allreduce(8, 8, comm=comm),
        lambda comm: loco_allreduce(4, 8, comm=comm),
        lambda comm: onebit_allreduce(comm=comm),
        lambda comm: fn.collectives.topk_allreduce(2, 8, comm=comm, exchange="gather"),
        lambda comm: fn.collectives.topk_allreduce(2, 8, comm=comm, exchange="owner"),
    ],
    ids=["fp32", "bf16", "int8", "loco4", "onebit", "topk-gather", "topk-owner"],
)
def test_an_exchange_with_no_value_to_send_agrees_the_flags_and_values_in_its_headers(
    make, world_size
):
    """A tree whose leaves are all empty or ``None`` (``fn.diloco.DiLoCo`` gives one for a
    fragment of empty parameters) sends headers alone: the leaves come back as they are, and
    every rank holds every rank's flag and values."""
    comm = Simulated(world_size)
    tx = make(comm)
    tree = {"empty": torch.zeros(world_size, 0, 3), "none": None}
    state = simulate(tx.init, comm)(tree)
    flags = torch.arange(world_size) != 1
    before = comm.bytes_sent
    exchange = functools.partial(tx.exchange, extra=(7, 3))
    out, _, participants, extra = simulate(exchange, comm)(tree, state, flags)
    assert out["none"] is None and out["empty"].shape == (world_size, 0, 3)
    assert participants.tolist() == [flags.tolist()] * world_size
    assert extra.tolist() == [[[7, 3]] * world_size] * world_size
    assert comm.bytes_sent - before == (world_size - 1) * (HEADER_BYTES + 16)
