"""The bytes of one outer step, per rank, as docs/algorithms.md's table gives them ("Bytes per
rank per outer step"), against fn's counters (sent and received) at several W, without an
exchange header and with one of DiLoCo's six values."""

from __future__ import annotations

import functools

import pytest
import torch

import fn.diloco
from fn.collectives import (
    HEADER_BYTES,
    Simulated,
    padded_numel,
    quantized_padded_numel,
    replicate,
    simulate,
    topk_exchange_form,
    topk_message_bytes,
)

H = HEADER_BYTES
SIZES = (300, 37)  # two leaves
K, C, GROUP = 3, 16, 8
SERVER_K = {"gather": None, "owner": None, "owner4": 4 * K}  # the owners' k (None: K)
# DiLoCo's header (fn/diloco/wrapper.py): inner step, fragment, size, from sync(), trainable
# tensors and their checksum
DILOCO_HEADER = {"step": 30, "fragment": 0, "size": 337, "sync": 0, "tensors": 2, "crc": 2**31}


def _rule(kind, comm):
    if kind in SERVER_K:
        exchange, server_k = kind.rstrip("4"), SERVER_K[kind]
        return fn.diloco.sparseloco(
            k=K, chunk_size=C, comm=comm, exchange=exchange, server_k=server_k
        )
    options = {"int8": {"group_size": GROUP}, "loco4": {"group_size": GROUP}}.get(kind, {})
    return fn.diloco.nesterov(fn.diloco.compression(kind, comm=comm, **options))


def _documented(kind: str, w: int, h: int) -> int:
    """docs/algorithms.md's table, for an exchange header of ``h`` values."""
    n, hh = sum(SIZES), H + 8 * h
    if kind in ("fp32", "bf16"):
        s = 4 if kind == "fp32" else 2
        if w <= 2:
            return (w - 1) * (hh + s * n)
        n_w = -(-n // w) * w
        return (w - 1) * (hh + s * n_w // w) + (w - 1) * s * n_w // w
    if kind in ("int8", "loco4"):
        b = 8 if kind == "int8" else 4
        r = sum(quantized_padded_numel(m, w, GROUP) // w * (b / 8 + 4 / GROUP) for m in SIZES)
        return (w - 1) * (hh + int(r)) + (w - 1) * int(r)
    if kind == "onebit":  # each leaf's signs and worker scale, then its owner's
        r = sum(padded_numel(m, w) // w // 8 + 4 for m in SIZES)
        return (w - 1) * (hh + r) + (w - 1) * r
    chunks = sum(-(-m // C) for m in SIZES)
    if kind == "gather":
        return (w - 1) * (hh + topk_message_bytes(chunks, K, C))
    share = -(-chunks // w)
    to_owners = topk_message_bytes(share, K, C)
    from_owners = topk_message_bytes(share, SERVER_K[kind] or K, C)
    return (w - 1) * (hh + to_owners) + (w - 1) * (H + from_owners)


# every W without a header, DiLoCo's header at 2 and 3 (the gather and owner forms of each)
@pytest.mark.parametrize(
    ("world_size", "header"),
    [(2, None), (3, None), (4, None), (8, None), (2, DILOCO_HEADER), (3, DILOCO_HEADER)],
)
@pytest.mark.parametrize(
    "kind", ["fp32", "bf16", "int8", "loco4", "onebit", "gather", "owner", "owner4"]
)
def test_one_outer_step_sends_and_receives_the_documented_bytes(kind, world_size, header):
    comm = Simulated(world_size)
    outer = _rule(kind, comm)
    anchor = replicate({"a": torch.zeros(SIZES[0]), "b": torch.zeros(SIZES[1])}, comm)
    params = {name: a + torch.randn(a.shape) for name, a in anchor.items()}
    state = simulate(outer.init, comm)(anchor)
    step = simulate(functools.partial(fn.diloco.outer_step, outer, comm=comm, header=header), comm)
    assert bool(step(anchor, params, state).applied.all())
    expected = _documented(kind, world_size, len(header or ()))
    assert comm.bytes_sent == comm.bytes_received == expected, (comm.bytes_sent, expected)


@pytest.mark.parametrize("owner", ["owner", "owner4"])
def test_auto_picks_the_form_with_fewer_bytes(owner):
    chunks = sum(-(-m // C) for m in SIZES)
    forms = []
    for w in (2, 3, 4, 8, 16):
        forms.append(topk_exchange_form(chunks, K, C, w, SERVER_K[owner]))
        fewer = min(("gather", owner), key=lambda f: (_documented(f, w, 0), f != "gather"))
        assert forms[-1] == fewer.rstrip("4"), w
    assert forms[0] == "gather" and forms[-1] == "owner", forms
