"""topk_allreduce's owner-partitioned exchange against the loop over workers of
tests/diloco/_reference.py, bit for bit (its result, every worker's error and every owner's server
error); its bytes against their formula, flat in W; the exchange forms with a header; the
choice of "auto"."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fn
from fn.collectives import (
    HEADER_BYTES,
    Simulated,
    TopkAllreduceState,
    TopkOwnerState,
    simulate,
    topk_allreduce,
    topk_exchange_form,
    topk_message_bytes,
)
from tests.diloco import _reference


def _inputs(world_size: int, shapes: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(world_size, *shape, generator=g) for name, shape in shapes.items()}


def _run_owner(
    world_size, shapes, k, chunk_size, decay, steps, seed, through="update", server_k=None
):
    """``steps`` calls on ``Simulated(world_size)``, each checked against the reference;
    returns the comm."""
    comm = Simulated(world_size)
    tx = topk_allreduce(k, chunk_size, comm=comm, decay=decay, exchange="owner", server_k=server_k)
    xs = [_inputs(world_size, shapes, seed + s) for s in range(steps)]
    state = simulate(tx.init, comm)(xs[0])
    assert isinstance(state, TopkOwnerState)
    names = list(shapes)
    errors = [[torch.zeros(shapes[name]) for name in names] for _ in range(world_size)]
    server = [torch.zeros_like(state.server_error[0]) for _ in range(world_size)]
    for x in xs:
        if through == "update":
            out, state = simulate(tx.update, comm)(x, state)
        else:
            out, state, participants, _ = simulate(tx.exchange, comm)(x, state)
            assert bool(participants.all())
        per_worker = [[x[name][r] for name in names] for r in range(world_size)]
        mean, errors, server = _reference.topk_owner_allreduce(
            per_worker, errors, server, k, chunk_size, decay, server_k=server_k
        )
        for r in range(world_size):
            for j, name in enumerate(names):
                assert torch.equal(out[name][r], mean[j]), (name, r)
                assert torch.equal(state.error[name][r], errors[r][j]), (name, r)
            assert torch.equal(state.server_error[r], server[r]), r
    return comm


@settings(max_examples=12, deadline=None)
@given(
    world_size=st.integers(1, 5),
    numel=st.integers(1, 70),
    log_chunk=st.integers(1, 4),
    k_fraction=st.floats(0.0, 1.0),
    server_fraction=st.none() | st.floats(0.0, 1.0),
    decay=st.sampled_from([1.0, 0.9, 0.0]),
    seed=st.integers(0, 2**16),
)
def test_the_owner_exchange_matches_the_reference(
    world_size, numel, log_chunk, k_fraction, server_fraction, decay, seed
):
    chunk_size = 2**log_chunk
    k = max(1, round(k_fraction * chunk_size))
    server_k = None if server_fraction is None else max(1, round(server_fraction * chunk_size))
    shapes = {"w": (numel,), "m": (3, 5)}
    _run_owner(world_size, shapes, k, chunk_size, decay, steps=3, seed=seed, server_k=server_k)


def test_its_exchange_with_a_header_has_the_same_bits():
    _run_owner(4, {"w": (300,), "b": (7,)}, 3, 16, 0.9, steps=3, seed=1, through="exchange")


@pytest.mark.parametrize("world_size", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("server_k", [None, 20])
def test_bytes_sent_and_received_follow_their_formula(world_size, server_k):
    shapes = {"w": (70,), "m": (4, 9)}  # 3 + 2 chunks of 32
    k, chunk_size, chunks = 5, 32, 5
    share = -(-chunks // world_size)
    comm = _run_owner(world_size, shapes, k, chunk_size, 1.0, 2, seed=2, server_k=server_k)
    record = 12 * (world_size - 1)  # the standalone update's size record
    to_owners = HEADER_BYTES + topk_message_bytes(share, k, chunk_size)
    from_owners = HEADER_BYTES + topk_message_bytes(share, server_k or k, chunk_size)
    exchange = (world_size - 1) * (to_owners + from_owners)
    assert comm.bytes_sent == comm.bytes_received == 2 * (record + exchange)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_gather_forms_exchange_is_its_update_with_a_header(world_size):
    comm = Simulated(world_size)
    tx = topk_allreduce(3, 8, comm=comm, decay=0.9)
    x = _inputs(world_size, {"w": (20,), "b": (5,)}, seed=3)
    state = simulate(tx.init, comm)(x)
    for _ in range(2):
        want, want_state = simulate(tx.update, comm)(x, state)
        comm.reset_bytes_sent()
        got, got_state, participants, _ = simulate(tx.exchange, comm)(x, state)
        assert bool(participants.all()) and participants.shape == (world_size, world_size)
        assert all(torch.equal(a, b) for a, b in zip(fn.tree.tree_leaves((got, got_state)),
                                                      fn.tree.tree_leaves((want, want_state)),
                                                      strict=True))  # fmt: skip
        message = HEADER_BYTES + topk_message_bytes(3 + 1, 3, 8)
        assert comm.bytes_sent == (world_size - 1) * message  # one collective, no record
        state = got_state


def test_a_rank_that_sits_out_is_the_reference_over_the_others_and_keeps_its_error():
    """Rank 1 sits out (its message zero, its error kept, the mean over the 3 others): the
    reference over the participants; its NaN input the same; ``update`` raises on a NaN."""
    world_size, shapes, k, chunk_size = 4, {"w": (70,)}, 3, 16
    comm = Simulated(world_size)
    tx = topk_allreduce(k, chunk_size, comm=comm, decay=0.9, exchange="owner")
    x = _inputs(world_size, shapes, seed=4)
    state = simulate(tx.init, comm)(x)
    per_worker = [[x["w"][r]] for r in range(world_size)]
    errors = [[state.error["w"][r]] for r in range(world_size)]
    server = list(state.server_error)
    mask = [r != 1 for r in range(world_size)]
    mean, new_errors, new_server = _reference.topk_owner_allreduce(
        per_worker, errors, server, k, chunk_size, 0.9, mask
    )
    flag = torch.tensor(mask)
    for offered, poisoned in ((flag, False), (torch.ones(world_size, dtype=torch.bool), True)):
        y = {"w": x["w"].clone()}
        if poisoned:
            y["w"][1, 3] = float("nan")
        out, new_state, participants, _ = simulate(tx.exchange, comm)(y, state, offered)
        assert participants.tolist() == [mask] * world_size
        for r in range(world_size):
            assert torch.equal(out["w"][r], mean[0])
            assert torch.equal(new_state.error["w"][r], new_errors[r][0])
            assert torch.equal(new_state.server_error[r], new_server[r])
    with pytest.raises(fn.NonFiniteError, match="non-finite values in some rank's input"):
        simulate(tx.update, comm)(y, state)


def test_auto_chooses_the_form_with_fewer_bytes_at_init():
    params = {"w": torch.zeros(8 * 4096)}
    for world_size, state_type in ((2, TopkAllreduceState), (4, TopkOwnerState)):
        tx = topk_allreduce(32, 4096, comm=Simulated(world_size), exchange="auto")
        assert isinstance(tx.init(params), state_type)
    assert topk_exchange_form(8, 32, 4096, 2) == "gather"
    assert topk_exchange_form(8, 32, 4096, 4) == "owner"
    with pytest.raises(ValueError, match="exchange must be one of gather, owner, auto"):
        topk_allreduce(2, 8, comm=Simulated(2), exchange="ring")


def test_auto_counts_the_owners_server_k_in_their_bytes():
    """The owners' messages at ``server_k = 4 k`` weigh ``(1 + 4) / 2`` times more: at 4
    workers, the all-gather; at 8, the owners."""
    params = {"w": torch.zeros(256 * 4096)}
    for world_size, state_type in ((4, TopkAllreduceState), (8, TopkOwnerState)):
        tx = topk_allreduce(32, 4096, comm=Simulated(world_size), exchange="auto", server_k=128)
        assert isinstance(tx.init(params), state_type)
    assert topk_exchange_form(256, 32, 4096, 4) == "owner"


def test_auto_weighs_the_owners_second_round_trip_at_round_trip_bytes():
    """The owners win only where the bytes per rank they save, ``(W - 1)`` times the difference
    of the two messages, exceed what the round trip is worth: on the 38 chunks of
    benchmarks/diloco.py's model, at 8 workers the all-gather stays; at 26, the owners."""
    chunks, k, chunk_size, world_size = 38, 128, 4096, 8
    share = -(-chunks // world_size)
    gather = HEADER_BYTES + topk_message_bytes(chunks, k, chunk_size)
    owner = 2 * HEADER_BYTES + 2 * topk_message_bytes(share, k, chunk_size)
    saved = (world_size - 1) * (gather - owner)
    assert 0 < saved < 125_000
    forms = [
        topk_exchange_form(chunks, k, chunk_size, world_size, round_trip_bytes=worth)
        for worth in (0, saved - 1, saved)
    ]
    assert forms == ["owner", "owner", "gather"]
    # docs/guides/diloco.md: at 125,000 bytes, the all-gather up to 25 workers, owners from 26
    assert [
        topk_exchange_form(chunks, k, chunk_size, w, round_trip_bytes=125_000) for w in (25, 26)
    ] == ["gather", "owner"]
    params = {"w": torch.zeros(chunks * chunk_size)}
    for worth, state_type in ((saved - 1, TopkOwnerState), (saved, TopkAllreduceState)):
        tx = topk_allreduce(
            k, chunk_size, comm=Simulated(world_size), exchange="auto", round_trip_bytes=worth
        )
        assert isinstance(tx.init(params), state_type)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"exchange": "owner", "round_trip_bytes": 8}, "exchange='auto' only"),
        ({"exchange": "auto", "round_trip_bytes": -1}, "round_trip_bytes must be an int >= 0"),
        ({"exchange": "auto", "round_trip_bytes": 1.5}, "round_trip_bytes must be an int >= 0"),
    ],
)
def test_a_round_trip_worth_it_cannot_use_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        topk_allreduce(2, 8, comm=Simulated(2), **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"exchange": "gather", "server_k": 4}, "server_k is the owners' k"),
        ({"exchange": "owner", "server_k": 0}, "server_k must be an int from 1 to chunk_size=8"),
        ({"exchange": "auto", "server_k": 9}, "server_k must be an int from 1 to chunk_size=8"),
        ({"exchange": "owner", "server_k": 2.0}, "server_k must be an int"),
        ({"exchange": "owner", "server_k": True}, "server_k must be an int"),
    ],
)
def test_a_server_k_it_cannot_use_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        topk_allreduce(2, 8, comm=Simulated(2), **options)
