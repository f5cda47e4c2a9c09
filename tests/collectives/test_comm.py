"""The Comm backends' collectives against loop-over-ranks references, byte counting, simulate()."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fn.collectives import Comm, Local, Simulated, replicate, simulate
from tests.collectives import _reference as ref

WORLD_SIZES = (2, 3, 4, 8)


def per_rank_inputs(w: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + w)
    return {
        "vec": torch.randn(w, 5, 3, generator=g),
        "chunked": torch.randn(w, w, 2, 3, generator=g),
        "bytes": torch.randint(0, 256, (w, w, 4), generator=g, dtype=torch.uint8),
    }


def collectives(comm: Comm, vec, chunked, byte_chunks):
    return {
        "all_reduce_mean": comm.all_reduce(vec),
        "all_reduce_sum": comm.all_reduce(vec, "sum"),
        "all_gather": comm.all_gather(vec),
        "all_to_all": comm.all_to_all(chunked),
        "all_to_all_bytes": comm.all_to_all(byte_chunks),
        "reduce_scatter_mean": comm.reduce_scatter(chunked),
        "reduce_scatter_sum": comm.reduce_scatter(chunked, "sum"),
    }


def reference(inputs, groups=None):
    w = inputs["vec"].shape[0]
    groups = groups or [list(range(w))]
    vec = [x.numpy() for x in inputs["vec"]]
    chunked_all = [x.numpy() for x in inputs["chunked"]]
    byte_all = [x.numpy() for x in inputs["bytes"]]
    size = len(groups[0])
    chunked = [x[:size] for x in chunked_all]
    byte_chunks = [x[:size] for x in byte_all]
    return {
        "all_reduce_mean": ref.in_groups(ref.all_reduce, vec, groups, "mean"),
        "all_reduce_sum": ref.in_groups(ref.all_reduce, vec, groups, "sum"),
        "all_gather": ref.in_groups(ref.all_gather, vec, groups),
        "all_to_all": ref.in_groups(ref.all_to_all, chunked, groups),
        "all_to_all_bytes": ref.in_groups(ref.all_to_all, byte_chunks, groups),
        "reduce_scatter_mean": ref.in_groups(ref.reduce_scatter, chunked, groups, "mean"),
        "reduce_scatter_sum": ref.in_groups(ref.reduce_scatter, chunked, groups, "sum"),
    }


def expected_bytes(w: int, group_size: int) -> int:
    """The per-rank traffic formulas, written out for the calls of ``collectives``."""
    s = group_size
    vec, chunked, byte_chunks = 15 * 4, s * 6 * 4, s * 4

    def frac(num, den):
        return math.ceil(num / den)

    return (
        2 * frac(2 * (s - 1) * vec, s)  # two ring all_reduces
        + (s - 1) * vec  # all_gather: (W-1)/W of the W * vec output
        + frac((s - 1) * chunked, s)  # all_to_all
        + frac((s - 1) * byte_chunks, s)
        + 2 * frac((s - 1) * chunked, s)  # two reduce_scatters
    )


def check_against_reference(out, expected):
    for key, want in expected.items():
        got = out[key]
        for r, want_r in enumerate(want):
            np.testing.assert_allclose(got[r].numpy(), want_r, rtol=1e-6, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("w", WORLD_SIZES)
def test_simulated_collectives_match_reference_and_count_bytes(w):
    comm = Simulated(w)
    inputs = per_rank_inputs(w)
    out = simulate(lambda v, c, b: collectives(comm, v, c, b), comm)(
        inputs["vec"], inputs["chunked"], inputs["bytes"]
    )
    check_against_reference(out, reference(inputs))
    assert comm.bytes_sent == expected_bytes(w, w)
    assert comm.reset_bytes_sent() == expected_bytes(w, w) and comm.bytes_sent == 0
    assert comm.bytes_received == expected_bytes(w, w)  # a collective receives what it sends
    assert comm.reset_bytes_received() == expected_bytes(w, w) and comm.bytes_received == 0


@pytest.mark.parametrize(("w", "local"), [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_simulated_split_groups(w, local):
    comm = Simulated(w)
    intra_groups, inter_groups = ref.split_groups(w, local)
    for hop, groups in ((0, intra_groups), (1, inter_groups)):
        comm.reset_bytes_sent()
        inputs = per_rank_inputs(w, seed=hop)
        size = len(groups[0])

        def f(v, c, b, hop=hop, size=size):
            sub = comm.split(local)[hop]
            assert sub.world_size == size
            return collectives(sub, v, c[:size], b[:size])

        out = simulate(f, comm)(inputs["vec"], inputs["chunked"], inputs["bytes"])
        check_against_reference(out, reference(inputs, groups))
        assert comm.bytes_sent == expected_bytes(w, size)


def test_local_collectives():
    comm = Local()
    x = torch.randn(1, 4)
    assert comm.world_size == 1
    assert torch.equal(comm.all_reduce(x[0], "sum"), x[0])
    assert torch.equal(comm.all_gather(x[0]), x)
    assert torch.equal(comm.all_to_all(x), x)
    assert torch.equal(comm.reduce_scatter(x), x[0])
    assert comm.bytes_sent == 0
    assert comm.split(1) == (comm, comm)
    assert isinstance(comm, Comm) and isinstance(Simulated(2), Comm)


def test_unbatched_values_inside_simulate_are_the_same_on_every_rank():
    comm = Simulated(3)
    out = simulate(lambda x: (comm.all_reduce(torch.ones(2), "sum"), comm.all_gather(x)), comm)(
        torch.arange(3.0)
    )
    assert torch.equal(out[0], torch.full((3, 2), 3.0))
    assert torch.equal(out[1], torch.arange(3.0).expand(3, 3))
    out[0][0, 0] = 7.0  # every rank owns its row
    assert out[0][1, 0] == 3.0


def test_inner_vmap_communicates_every_inner_element():
    """A user vmap inside simulate: each inner element is reduced across the ranks."""
    w, inner = 3, 4
    comm = Simulated(w)
    x = torch.randn(w, inner, 5)

    def f(x):
        return torch.func.vmap(lambda row: comm.all_reduce(row, "sum"))(x), torch.func.vmap(
            comm.all_gather
        )(x)

    summed, gathered = simulate(f, comm)(x)
    torch.testing.assert_close(summed, x.sum(0).expand(w, inner, 5))
    for r in range(w):
        for j in range(inner):
            assert torch.equal(gathered[r, j], x[:, j])
    # counted per inner element: one all_reduce and one all_gather of a [5] fp32 payload
    payload = 5 * 4
    assert comm.bytes_sent == math.ceil(2 * (w - 1) * payload / w) + (w - 1) * payload


def test_inner_vmap_all_to_all_and_reduce_scatter():
    w, inner = 2, 3
    comm = Simulated(w)
    x = torch.randn(w, inner, w, 4)

    def f(x):
        return torch.func.vmap(comm.all_to_all)(x), torch.func.vmap(comm.reduce_scatter)(x)

    moved, scattered = simulate(f, comm)(x)
    for r in range(w):
        for j in range(inner):
            for i in range(w):
                assert torch.equal(moved[r, j, i], x[i, j, r])
            torch.testing.assert_close(scattered[r, j], x[:, j, r].mean(0))


def test_outer_vmap_of_simulate():
    comm = Simulated(2)
    x = torch.randn(5, 2, 3)
    out = torch.func.vmap(simulate(lambda v: comm.all_reduce(v, "sum"), comm))(x)
    torch.testing.assert_close(out, x.sum(1, keepdim=True).expand(5, 2, 3))


def test_simulate_passes_non_tensor_leaves_and_draws_different_randoms():
    comm = Simulated(4)

    def f(x, scale, name, nothing):
        assert isinstance(scale, float) and name == "n" and nothing is None
        return {"y": x * scale, "noise": torch.randn(3), "tag": name}

    out = simulate(f, comm)(torch.ones(4, 2), 2.0, "n", None)
    assert out["tag"] == "n" and torch.equal(out["y"], torch.full((4, 2), 2.0))
    assert not torch.equal(out["noise"][0], out["noise"][1])


def test_replicate():
    comm = Simulated(3)
    tree = {"a": torch.arange(4.0), "b": (None, 2, torch.zeros(2, 2))}
    rep = replicate(tree, comm)
    assert rep["a"].shape == (3, 4) and rep["b"][2].shape == (3, 2, 2)
    assert rep["b"][0] is None and rep["b"][1] == 2
    rep["a"][0, 0] = 7.0  # copies, not views of one another or of the input
    assert rep["a"][1, 0] == 0.0 and tree["a"][0] == 0.0


def test_errors():
    comm = Simulated(3)
    with pytest.raises(RuntimeError, match="outside fn.collectives.simulate"):
        comm.all_reduce(torch.ones(3))
    with pytest.raises(RuntimeError, match="outside fn.collectives.simulate"):
        comm.split(1)[0].all_gather(torch.ones(3))
    with pytest.raises(ValueError, match="leading rank axis of size 3"):
        simulate(lambda x: x, comm)(torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="cannot be nested"):
        simulate(lambda x: simulate(lambda y: y, comm)(x), comm)(torch.ones(3, 3, 1))
    with pytest.raises(ValueError, match=r"\[world_size=3, \*chunk\]"):
        simulate(lambda x: comm.all_to_all(x), comm)(torch.ones(3, 2, 1))
    with pytest.raises(ValueError, match="op must be"):
        simulate(lambda x: comm.all_reduce(x, "max"), comm)(torch.ones(3, 1))
    with pytest.raises(ValueError, match="does not divide"):
        comm.split(2)
    with pytest.raises(TypeError, match="Simulated"):
        simulate(lambda x: x, Local())
    with pytest.raises(ValueError, match="positive"):
        Simulated(0)


@pytest.mark.parametrize(
    "backend, device_type",
    [("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("nccl", "cuda"), ("xccl", "xpu")],
)
def test_process_group_sends_its_own_messages_where_the_backend_takes_them(
    backend, device_type, monkeypatch
):
    """split()'s agreement on local_world_size travels on the host under gloo, on the GPU under
    NCCL alone (which refuses host tensors)."""
    import torch.distributed as dist

    from fn.collectives import ProcessGroup

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        comm = ProcessGroup()
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        assert comm._control_device().type == device_type
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
