"""The top-k message's code (fn/collectives/_topk_code.py): the kept positions in the
Elias-Fano code, the 2-bit codes and the scales decode exactly, in the bytes of
``topk_message_bytes``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fn.collectives import topk_message_bytes
from fn.collectives._topk_code import Layout, Sparse


def _round_trip(chunk_size: int, k: int, chunks: int, rows: int, seed: int) -> None:
    """``rows`` messages of ``chunks`` chunks, each of ``k`` distinct random positions (sorted),
    random codes and scales: encoded to :func:`topk_message_bytes` each, decoded exactly."""
    g = torch.Generator().manual_seed(seed)
    count = rows * chunks
    ranks = torch.rand(count, chunk_size, generator=g).argsort(dim=-1)
    positions = ranks[:, :k].sort(dim=-1).values
    codes = torch.randint(0, 4, (count, k), generator=g)
    sparse = Sparse(positions, codes, torch.randn(count, generator=g))
    layout = Layout(chunks, k, chunk_size)
    message = layout.encode(sparse, rows=rows)
    assert message.shape == (rows, topk_message_bytes(chunks, k, chunk_size))
    for r in range(rows):
        got = layout.decode(message[r])
        mine = slice(r * chunks, (r + 1) * chunks)
        assert torch.equal(got.positions, positions[mine])
        assert torch.equal(got.codes, codes[mine])
        assert torch.equal(got.scales, sparse.scales[mine])


@settings(max_examples=40, deadline=None)
@given(data=st.data(), log_chunk=st.integers(1, 16), chunks=st.integers(0, 3),
       rows=st.integers(1, 3), seed=st.integers(0, 2**16))  # fmt: skip
def test_the_message_code_round_trips_in_its_formula_bytes(data, log_chunk, chunks, rows, seed):
    chunk_size = 2**log_chunk
    k = data.draw(st.integers(1, chunk_size), label="k")
    _round_trip(chunk_size, k, chunks, rows, seed)


@pytest.mark.parametrize(
    ("chunk_size", "k"),
    [(2, 1), (2, 2), (2**16, 1), (2**16, 2**16), (2**16, 2**15 + 1), (4096, 128), (64, 33),
     (64, 32), (64, 31), (4096, 4096)],
)  # fmt: skip
def test_the_message_code_round_trips_at_its_edges(chunk_size, k):
    """k = 1, k = C, C = 2, and k = C / 2 + 1 (no low bits) among them."""
    _round_trip(chunk_size, k, chunks=2, rows=2, seed=k)


def test_the_positions_cost_k_l_plus_k_plus_c_over_2_to_the_l_bits_a_chunk():
    layout = Layout(1, 128, 4096)  # L = 5: 640 + 128 + 128 bits, 112 bytes
    assert (layout.low, layout.high_bits, layout.position_bytes) == (5, 256, 112)
    assert Layout(1, 33, 64).low == 0 and Layout(1, 32, 64).low == 1
    assert topk_message_bytes(1, 128, 4096) == 112 + 32 + 4
