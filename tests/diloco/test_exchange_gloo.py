"""The outer step's exchanges on 4 gloo ranks, in one launch: every compressor with a header
(the owner forms among them: fp32 and bf16 from W = 3, int8, loco4, 1-bit, top-k reduced on
owners) gives the bits of ``Simulated(4)``, sends and receives its bytes and makes its collectives,
also where a worker's non-finite pseudo-gradient makes it sit out; a rank whose sizes differ
from the others' (its message of the same size) raises the same error on every rank;
``DiLoCo`` with SparseLoCo reduced on owners (its owners keeping twice its k) matches the loop
over workers and owners of _reference.py bit for bit, and resumes mid-run from its state dicts
(both error feedbacks)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import fn.diloco
from fn.collectives import ProcessGroup, Simulated, replicate, simulate
from fn.tree import tree_leaves
from tests._distributed import run_distributed
from tests.diloco import _reference

W = 4
KINDS = ("fp32", "bf16", "int8", "loco4", "onebit", "topk", "owner")
ANCHOR = {"w": torch.linspace(-1.0, 1.0, 60).view(6, 10), "b": torch.linspace(0.0, 1.0, 9)}


def _rule(kind, comm):
    if kind == "owner":
        return fn.diloco.sparseloco(0.9, 0.9, k=3, chunk_size=16, comm=comm, exchange="owner")
    options = {"topk": {"k": 3, "chunk_size": 16}, "int8": {"group_size": 8}}
    options["loco4"] = {"group_size": 8}
    return fn.diloco.nesterov(fn.diloco.compression(kind, comm=comm, **options.get(kind, {})))


def _moves(steps: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {name: torch.randn(W, *a.shape, generator=g) * 0.1 for name, a in ANCHOR.items()}
        for _ in range(steps)
    ]


class _Counting(ProcessGroup):
    """A ``ProcessGroup`` that counts the collectives it runs."""

    calls = 0

    def _run(self, kind, x, start):
        _Counting.calls += 1
        return super()._run(kind, x, start)


def _steps(kind, comm, rank, moves):
    """Outer steps on this rank (``rank`` None: every rank under ``simulate``): the anchor and
    the state's leaves after each, whether it was applied, and the bytes and collectives of the
    first step."""
    outer = _rule(kind, comm)
    anchor = {name: a.clone() for name, a in ANCHOR.items()}
    if rank is None:
        anchor = replicate(anchor, comm)
        state = simulate(outer.init, comm)(anchor)
        step = simulate(functools.partial(fn.diloco.outer_step, outer, comm=comm), comm)
    else:
        state = outer.init(anchor)
        step = functools.partial(fn.diloco.outer_step, outer, comm=comm)
    out, counts = [], None
    for move in moves:
        comm.reset_bytes_sent()
        comm.reset_bytes_received()
        _Counting.calls = 0
        mine = {name: m if rank is None else m[rank] for name, m in move.items()}
        params = {name: anchor[name] + mine[name] for name in anchor}
        result = step(anchor, params, state)
        anchor, state = result.anchor, result.state
        out.append((anchor, tree_leaves(state), result.participants.tolist()))
        counts = counts or (comm.bytes_sent, comm.bytes_received, _Counting.calls)
    return out, counts


def _sizes_differ(comm, rank):
    """Rank 3's leaf has 20 values where the others' have 19: the same chunks of 16, so the
    same message size, and the header's record tells them apart."""
    outer = _rule("topk", comm)
    anchor = {"w": torch.zeros(19 + (rank == 3))}
    params = {"w": anchor["w"] + 1.0}
    try:
        fn.diloco.outer_step(outer, anchor, params, outer.init(anchor), comm=comm)
    except ValueError as err:
        return str(err)
    return "not refused"


H = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 3))


def _inner_step(model, inner, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    inner.step()
    inner.zero_grad()


SPARSELOCO = {
    "outer": "sparseloco",
    "outer_options": {"lr": 0.9, "beta": 0.9},
    "compression_options": {"k": 3, "chunk_size": 16, "exchange": "owner", "server_k": 6},
}


def _train(rank, steps, start=0, state=None):
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=H, **SPARSELOCO)
    if state is not None:
        model.load_state_dict(state[0])
        inner.load_state_dict(state[1])
        diloco.load_state_dict(state[2])
    after = []
    for step in range(start, start + steps):
        _inner_step(model, inner, rank, step)
        if (step + 1) % H == 0:
            after.append([p.detach().clone() for p in model.parameters()])
    return model, inner, diloco, after


def _gloo(rank, world_size):
    comm = _Counting(timeout=60)
    moves = _moves(2)
    results = {kind: _steps(kind, comm, rank, moves) for kind in KINDS}
    bad = copy.deepcopy(moves)
    bad[1]["w"][2, 0, 0] = float("nan")
    results["skip"] = _steps("owner", comm, rank, bad)
    results["sizes"] = _sizes_differ(comm, rank)
    full = _train(rank, 3 * H)[3]
    part = _train(rank, 2 * H)
    saved = tuple(copy.deepcopy(x.state_dict()) for x in part[:3])
    results["diloco"] = full, _train(rank, H, start=2 * H, state=saved)[3], saved[2]
    return results


@pytest.fixture(scope="module")
def gloo_ranks():
    return run_distributed(_gloo, W, timeout=280)


@pytest.mark.distributed
@pytest.mark.timeout(320)
def test_every_exchange_has_the_bits_bytes_and_collectives_of_simulated(gloo_ranks):
    comm = Simulated(W)
    everyone = [True] * W
    cases = [(kind, kind, _moves(2), [everyone] * 2) for kind in KINDS]
    bad = copy.deepcopy(_moves(2))
    bad[1]["w"][2, 0, 0] = float("nan")  # worker 2 sits the second step out
    cases.append(("skip", "owner", bad, [everyone, [True, True, False, True]]))
    for name, kind, moves, participants in cases:
        _Counting.calls = 0
        expected, (sent, received, _) = _steps(kind, comm, None, moves)
        for r, result in enumerate(gloo_ranks):
            got, (got_sent, got_received, calls) = result[name]
            assert (got_sent, got_received) == (sent, received), (kind, r)
            assert calls == (1 if kind == "topk" else 2), (kind, calls)
            for s, ((a, leaves, part), (ea, eleaves, epart)) in enumerate(
                zip(got, expected, strict=True)
            ):
                assert part == participants[s] and epart == [participants[s]] * W
                assert all(torch.equal(a[n], ea[n][r]) for n in ANCHOR), (kind, r)
                assert all(torch.equal(x, e[r]) for x, e in zip(leaves, eleaves, strict=True))


@pytest.mark.distributed
@pytest.mark.timeout(320)
def test_different_sizes_are_refused_on_every_rank(gloo_ranks):
    messages = {result["sizes"] for result in gloo_ranks}
    assert len(messages) == 1, messages  # the same message on every rank
    (message,) = messages
    assert "rank 0: 19 elements" in message and "rank 3: 20 elements" in message, message


def _reference_run() -> list[list[torch.Tensor]]:
    """DiLoCo with SparseLoCo reduced on owners (``server_k = 2 k``), over a loop of workers:
    the anchor after every outer step."""
    models = [_model() for _ in range(W)]
    inners = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    chunks = sum(-(-a.numel() // 16) for a in anchor)
    errors = [[torch.zeros_like(a) for a in anchor] for _ in range(W)]
    server = [torch.zeros(-(-chunks // W) * 16) for _ in range(W)]
    out = []
    for s in range(3):
        for step in range(s * H, (s + 1) * H):
            for r in range(W):
                _inner_step(models[r], inners[r], r, step)
        deltas = [[a - p.detach() for a, p in zip(anchor, m.parameters(), strict=True)]
                  for m in models]  # fmt: skip
        mean, errors, server = _reference.topk_owner_allreduce(
            deltas, errors, server, 3, 16, 0.9, server_k=6
        )
        anchor = [a + u * torch.tensor(-0.9) for a, u in zip(anchor, mean, strict=True)]
        with torch.no_grad():
            for m in models:
                for p, a in zip(m.parameters(), anchor, strict=True):
                    p.copy_(a)
        out.append(anchor)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(320)
def test_diloco_reduced_on_owners_is_the_loop_over_workers_and_resumes_mid_run(gloo_ranks):
    expected = _reference_run()
    for rank, result in enumerate(gloo_ranks):
        full, resumed, saved = result["diloco"]
        for s in range(3):
            assert all(torch.equal(a, b) for a, b in zip(full[s], expected[s], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(resumed[0], full[2], strict=True))
        own = saved["per_rank"][f"rank{rank}"]["error_feedback"]
        assert len(own) == 5 and own[-1].shape == (16 * 2,)  # 4 errors, the server: 7 chunks
        assert any(bool(t.ne(0).any()) for t in own)
