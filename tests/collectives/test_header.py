"""The header of an exchange (fn.collectives.header), and the exchanges of the outer compressors
that carry it: the same bits as their ``update``, one message for all leaves, the flags of
every rank on every rank, a sitter's state kept, and their bytes (sent and received) against
their formulas."""

from __future__ import annotations

import pytest
import torch

import fn
from fn.collectives import (
    HEADER_BYTES,
    Simulated,
    cast_allreduce,
    cast_exchange_form,
    loco_allreduce,
    quantized_allreduce,
    quantized_padded_numel,
    simulate,
)
from fn.collectives.header import opened, sealed
from fn.tree import tree_leaves

SHAPES = {"w": (5, 7), "b": (3,), "none": None, "empty": (0,)}


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


def _check_exchange(tx, world_size, steps=3):
    """``exchange`` against ``update`` for ``steps`` calls; the bytes of the last exchange."""
    comm = tx.comm
    x = _inputs(world_size, seed=world_size)
    state = simulate(tx.tx.init, comm)(x)
    for step in range(steps):
        x = _inputs(world_size, seed=10 * world_size + step)
        want = simulate(tx.tx.update, comm)(x, state)
        comm.reset_bytes_sent()
        comm.reset_bytes_received()
        got = simulate(tx.tx.exchange, comm)(x, state)
        assert _same(tuple(got[:2]), want), step
        assert got.flags.tolist() == [[True] * world_size] * world_size
        state = want[1]
    assert comm.bytes_sent == comm.bytes_received
    return comm.bytes_sent


class _Tx:
    def __init__(self, tx, comm):
        self.tx, self.comm = tx, comm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_cast_exchange_has_the_bits_of_its_update_in_one_message(dtype, world_size):
    comm = Simulated(world_size)
    sent = _check_exchange(_Tx(cast_allreduce(dtype, comm=comm), comm), world_size, steps=1)
    n, size = 38, torch.finfo(dtype).bits // 8
    share = -(-n // world_size) * size
    if cast_exchange_form(n, size, world_size) == "gather":  # W = 2: one all-gather
        assert world_size == 2 and sent == (world_size - 1) * (HEADER_BYTES + size * n)
    else:  # the all_to_all to the owners, then the all-gather of their means
        assert sent == (world_size - 1) * (HEADER_BYTES + share) + (world_size - 1) * share


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("loco", [False, True])
def test_the_quantized_exchange_has_the_bits_of_its_update_in_one_message(world_size, loco):
    comm = Simulated(world_size)
    if loco:  # reset_T 2: the errors are reset at the third call
        tx = loco_allreduce(4, 8, 0.8, 2, comm=comm)
    else:
        tx = quantized_allreduce(8, 8, comm=comm)
    sent = _check_exchange(_Tx(tx, comm), world_size)
    bits = 4 if loco else 8
    per_rank = 0  # one chunk of each leaf: codes, then the fp32 scales
    for numel in (35, 3):
        chunk = quantized_padded_numel(numel, world_size, 8) // world_size
        per_rank += chunk * bits // 8 + 4 * chunk // 8
    assert sent == (world_size - 1) * (HEADER_BYTES + per_rank) + (world_size - 1) * per_rank


def test_a_rank_that_sits_out_keeps_its_errors_and_every_rank_sees_its_flag():
    comm = Simulated(3)
    tx = loco_allreduce(4, 8, comm=comm)
    x = _inputs(3, seed=0)
    state = simulate(tx.init, comm)(x)
    _, state = simulate(tx.update, comm)(x, state)
    x["w"][2, 0, 0] = float("inf")
    _, new, flags = simulate(tx.exchange, comm)(x, state)
    assert flags.tolist() == [[True, True, False]] * 3
    for old_e, new_e in zip(state.errors["w"], new.errors["w"], strict=True):
        assert torch.equal(old_e[2], new_e[2]) and not torch.equal(old_e[0], new_e[0])
    assert new.count.tolist() == [2, 2, 2]
    comm = Simulated(4)
    two_hops = loco_allreduce(4, 8, comm=comm, local_world_size=2)
    y = _inputs(4, seed=1)
    with pytest.raises(NotImplementedError, match="runs on one hop"):
        simulate(two_hops.exchange, comm)(y, simulate(two_hops.init, comm)(y))
    assert isinstance(tx, fn.collectives.Compressor)
