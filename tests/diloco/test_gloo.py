"""fn.diloco on gloo ranks, in one launch of 2 processes.

- The outer step: the same bits as under ``Simulated`` for the rules and the compressors that
  fn.diloco adds (``cast_allreduce``, ``topk_allreduce``), a non-finite pseudo-gradient skipped
  on every rank, and ranks whose sizes or settings differ refused together. The other
  compressors (int8, LoCo, 1-bit) give the bits of ``Simulated`` on gloo in tests/collectives;
  leaving them out here spares each process the import their kernels' first call costs (about
  20 s on a loaded machine).
- ``DiLoCo``, the outer step hooked onto an inner optimizer: against a loop over the workers
  written plainly (bit for bit); a checkpoint that resumes bit for bit and restarts the error
  feedback under another world size; a non-finite pseudo-gradient (its worker sits out),
  settings that differ, and a worker that leaves.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fn.diloco
import fn.fsdp
from fn.collectives import (
    CollectiveTimeoutError,
    ProcessGroup,
    Simulated,
    cast_allreduce,
    replicate,
    simulate,
    topk_allreduce,
)
from fn.tree import tree_leaves
from tests._distributed import run_distributed
from tests.diloco import _reference
from tests.diloco._cases import drifts, outer_rule

W = 2
KINDS = ("fp32", "bf16", "topk", "sparseloco")
SHAPE = (4, 5)
ANCHOR = torch.linspace(-1.0, 1.0, 20).view(SHAPE)


def _steps(outer, comm, rank, moves):
    """Outer steps on one rank (``rank`` None: every rank under ``simulate``); the anchor and
    the state's leaves after the last."""
    anchor = {"w": ANCHOR.clone()}
    if rank is None:
        anchor = replicate(anchor, comm)
        state = simulate(outer.init, comm)(anchor)
        step = simulate(lambda a, p, s: fn.diloco.outer_step(outer, a, p, s, comm=comm), comm)
    else:
        state = outer.init(anchor)

        def step(a, p, s):
            return fn.diloco.outer_step(outer, a, p, s, comm=comm)

    applied = []
    for move in moves:
        result = step(anchor, {"w": anchor["w"] + (move if rank is None else move[rank])}, state)
        anchor, state = result.anchor, result.state
        applied.append(bool(result.applied.all()))
    return anchor["w"], tree_leaves(state), applied


def _refused(update) -> str:
    try:
        update()
    except ValueError as err:
        return str(err)
    return "not refused"


def _outer_steps(rank, world_size):
    comm = ProcessGroup(timeout=60)
    moves = drifts(SHAPE, world_size, steps=3, seed=0)
    results = {kind: _steps(outer_rule(kind, comm), comm, rank, moves) for kind in KINDS}
    bad = [m.clone() for m in moves]
    bad[1][world_size - 1, 0, 0] = float("inf")
    results["skip"] = _steps(outer_rule("topk", comm), comm, rank, bad)
    x, same = {"w": torch.ones(10 + rank % 2)}, {"w": torch.ones(8)}
    sizes = topk_allreduce(2, 8, comm=comm)
    settings = topk_allreduce(2 + rank % 2, 8, comm=comm)
    cast = cast_allreduce(torch.bfloat16, comm=comm)
    results["refused"] = [
        _refused(lambda: sizes.update(x, sizes.init(x))),
        _refused(lambda: settings.update(same, settings.init(same))),
        _refused(lambda: cast.update(x, cast.init(x))),
    ]
    return results


def _gloo(rank, world_size, path):
    # the wrapper's part ends with rank 1 leaving: it goes last
    return {
        "outer": _outer_steps(rank, world_size),
        "wrapper": _wrapper(rank, world_size, path),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return str(tmp_path_factory.mktemp("diloco"))


@pytest.fixture(scope="module")
def gloo_ranks(checkpoints):
    return run_distributed(_gloo, W, checkpoints, timeout=200)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_gloo_ranks_match_simulated_bit_for_bit_and_refuse_together(gloo_ranks):
    ranks = [result["outer"] for result in gloo_ranks]
    comm = Simulated(W)
    moves = drifts(SHAPE, W, steps=3, seed=0)
    for kind in KINDS:
        anchor, leaves, applied = _steps(outer_rule(kind, comm), comm, None, moves)
        assert applied == [True] * 3
        for r, result in enumerate(ranks):
            got_anchor, got_leaves, got_applied = result[kind]
            assert got_applied == applied
            assert torch.equal(got_anchor, anchor[r]), (kind, r)
            assert len(got_leaves) == len(leaves)
            for got, expected in zip(got_leaves, leaves, strict=True):
                assert torch.equal(got, expected[r]), (kind, r)
    sat_out = [result["skip"] for result in ranks]  # rank 1's Inf: rank 0's step applied
    assert all(applied == [True] * 3 for _, _, applied in sat_out)
    assert all(torch.equal(anchor, sat_out[0][0]) for anchor, _, _ in sat_out)
    for result in ranks:
        sizes, settings, cast = result["refused"]
        assert "different sizes" in sizes and "rank 0: 10 elements, rank 1: 11" in sizes, sizes
        assert "different sets of tensors" in settings, settings
        assert "different sizes" in cast, cast


H = 2
OUTER_STEPS = 3
SETTINGS = {
    "nesterov": {},
    "sparseloco": {
        "outer": "sparseloco",
        "outer_options": {"lr": 0.9, "beta": 0.9},
        "compression_options": {"k": 2, "chunk_size": 4},
    },
}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _inner_step(model, inner, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    inner.step()
    inner.zero_grad()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _train(rank, kwargs, steps, start=0, state=None):
    """A worker's ``(model, inner optimizer, DiLoCo, params after every outer step)`` after
    ``steps`` inner steps from ``start`` (having loaded ``state``, the three state dicts)."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=H, **kwargs)
    if state is not None:
        model.load_state_dict(state[0])
        inner.load_state_dict(state[1])
        diloco.load_state_dict(state[2])
    after = []
    for step in range(start, start + steps):
        _inner_step(model, inner, rank, step)
        if (step + 1) % H == 0:
            after.append(_params(model))
    return model, inner, diloco, after


def _checkpoint(model, inner, diloco, rank) -> fn.fsdp.TrainingCheckpoint:
    """Through DCP: one name per worker (their models and inner optimizers differ)."""
    return fn.fsdp.TrainingCheckpoint(model, inner, extra={"diloco": diloco}, key=f"worker{rank}")


def _wrapper(rank, world_size, path):
    results = {}
    for name, kwargs in SETTINGS.items():
        full = _train(rank, kwargs, H * OUTER_STEPS)[3]
        part = _train(rank, kwargs, H * 2)
        saved = tuple(copy.deepcopy(x.state_dict()) for x in part[:3])
        resumed = _train(rank, kwargs, H, start=2 * H, state=saved)[3]
        _checkpoint(*part[:3], rank).save(f"{path}/{name}")
        model, inner, diloco, _ = _train(rank, kwargs, 0)
        _checkpoint(model, inner, diloco, rank).load(f"{path}/{name}")
        for step in range(2 * H, 3 * H):
            _inner_step(model, inner, rank, step)
        results[name] = (full, resumed, saved[2], _params(model))
    # a non-finite pseudo-gradient on rank 1: it sits out, rank 0's step is applied
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=H)
    anchor = _params(model)
    _inner_step(model, inner, rank, 0)
    if rank == 1:
        with torch.no_grad():
            model.weight[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _inner_step(model, inner, rank, 1)
    moved = not any(torch.equal(a, b) for a, b in zip(_params(model), anchor, strict=True))
    counts = (diloco.skipped_steps, diloco.sat_out)
    results["skip"] = (_params(model), moved, counts, [str(w.message) for w in caught])
    # settings or parameters that differ: the same error on every rank
    results["refused"] = [
        _refused(lambda: fn.diloco.DiLoCo(model, inner, sync_every=H + rank)),
        _refused(lambda: fn.diloco.DiLoCo(*_with_sgd(_model(seed=rank)), sync_every=H)),
    ]
    # a worker that leaves: the other raises within its timeout
    diloco = fn.diloco.DiLoCo(*_with_sgd(_model()), sync_every=H, timeout=5)
    if rank == 0:
        try:
            diloco.sync()
            results["left"] = "no error"
        except CollectiveTimeoutError as err:
            results["left"] = str(err)
    return results


def _with_sgd(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _reference_run(kwargs) -> list[list[torch.Tensor]]:
    """DiLoCo over a loop of workers, each with its own model, inner optimizer and data: the
    anchor after every outer step (every worker's params)."""
    models = [_model() for _ in range(W)]
    inners = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    anchor = _params(models[0])
    errors = [[torch.zeros_like(a) for a in anchor] for _ in range(W)]
    momentum = [torch.zeros_like(a) for a in anchor]
    out = []
    for s in range(OUTER_STEPS):
        for step in range(s * H, (s + 1) * H):
            for r in range(W):
                _inner_step(models[r], inners[r], r, step)
        params = [_params(m) for m in models]
        new = []
        for j, a in enumerate(anchor):
            deltas = [a - params[r][j] for r in range(W)]
            if kwargs.get("outer") == "sparseloco":  # e = 0.9 e + delta, top-2 of 4, lr 0.9
                mean, kept = _reference.topk_allreduce(
                    deltas, [errors[r][j] for r in range(W)], 2, 4, 0.9
                )
                for r in range(W):
                    errors[r][j] = kept[r]
                new.append(a + mean * torch.tensor(-0.9))
            else:  # Nesterov, lr 0.7, momentum 0.9, on the exact mean
                mean = _reference.cast_mean(deltas, torch.float32)
                momentum[j] = momentum[j] * 0.9 + mean
                new.append(a + torch.add(mean, momentum[j], alpha=0.9) * torch.tensor(-0.7))
        anchor = new
        with torch.no_grad():
            for m in models:
                for p, a in zip(m.parameters(), anchor, strict=True):
                    p.copy_(a)
        out.append(anchor)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_diloco_on_gloo_ranks(gloo_ranks):
    ranks = [result["wrapper"] for result in gloo_ranks]
    for name, kwargs in SETTINGS.items():
        expected = _reference_run(kwargs)
        for rank, result in enumerate(ranks):
            full, resumed, _, through_dcp = result[name]
            for s in range(OUTER_STEPS):
                assert all(
                    torch.equal(got, e) for got, e in zip(full[s], expected[s], strict=True)
                ), (name, rank, s)
            assert all(torch.equal(a, b) for a, b in zip(resumed[0], full[2], strict=True))
            assert all(torch.equal(a, b) for a, b in zip(through_dcp, full[2], strict=True))
    for params, moved, counts, caught in (result["skip"] for result in ranks):
        assert moved and counts == (0, [0, 1])
        assert all(torch.equal(a, b) for a, b in zip(params, ranks[0]["skip"][0], strict=True))
        assert caught == ranks[0]["skip"][3] and len(caught) == 1, caught
        assert "worker(s) 1 sat out the outer step started after inner step 2" in caught[0]
    assert ranks[0]["refused"] == ranks[1]["refused"]  # the same message on every rank
    settings, values = ranks[0]["refused"]
    assert "sync_every (ranks 0 | 1)" in settings, settings
    assert "parameter values (ranks 0 | 1)" in values and "sync_every" not in values, values
    assert "rank(s) [1] never reached it" in ranks[0]["left"], ranks[0]["left"]  # who left

    # the sparseloco checkpoint of rank 0, loaded on one rank: the error feedback restarts
    saved = ranks[0]["sparseloco"][2]
    assert any(bool(t.ne(0).any()) for t in saved["per_rank"]["rank0"]["error_feedback"])
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=H, **SETTINGS["sparseloco"])
    with pytest.warns(UserWarning, match="error feedback restarts from zero"):
        diloco.load_state_dict(saved)
    loaded = diloco.state_dict()
    assert all(not bool(t.ne(0).any()) for t in loaded["per_rank"]["rank0"]["error_feedback"])
    assert all(torch.equal(a, b) for a, b in zip(loaded["anchor"], saved["anchor"], strict=True))
    _same_counts(loaded["counts"], saved["counts"])


def _same_counts(loaded: dict, saved: dict) -> None:
    """The counts of a 2-worker checkpoint loaded by one worker: the same, but for the
    per-worker ones, which restart."""
    per_worker = ("sat_out", "sit_outs_in_a_row")
    assert {k: v for k, v in loaded.items() if k not in per_worker} == {
        k: v for k, v in saved.items() if k not in per_worker
    }
    assert [loaded[k] for k in per_worker] == [[0], [0]]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_a_dcp_checkpoint_loads_on_another_worker_count_or_is_refused(gloo_ranks, checkpoints):
    """Worker 0's part of the 2-worker checkpoint, loaded by one worker (no process group)."""
    path = f"{checkpoints}/sparseloco"
    kwargs = SETTINGS["sparseloco"]
    saved = gloo_ranks[0]["wrapper"]["sparseloco"][2]
    model, inner, diloco, _ = _train(0, kwargs, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _checkpoint(model, inner, diloco, 0).load(path)
    assert [str(w.message) for w in caught if "error feedback" in str(w.message)] == [
        "DiLoCo.load_state_dict: the checkpoint was taken on 2 workers with another layout or "
        "rank, this run has 1: the error feedback restarts from zero"
    ]
    loaded = diloco.state_dict()
    assert all(not bool(t.ne(0).any()) for t in loaded["per_rank"]["rank0"]["error_feedback"])
    assert all(torch.equal(a, b) for a, b in zip(loaded["anchor"], saved["anchor"], strict=True))
    _same_counts(loaded["counts"], saved["counts"])
    assert diloco.inner_steps == 2 * H
    # another model, or other settings: refused, nothing changed
    for other, options in ((torch.nn.Linear(4, 2), kwargs), (_model(), SETTINGS["nesterov"])):
        inner = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
        diloco = fn.diloco.DiLoCo(other, inner, sync_every=H, **options)
        before, state = _params(other), diloco.state_dict()
        with pytest.raises(ValueError, match="nothing was loaded"):
            _checkpoint(other, inner, diloco, 0).load(path)
        assert all(torch.equal(a, b) for a, b in zip(before, _params(other), strict=True))
        after = diloco.state_dict()
        assert after["counts"] == state["counts"] and not inner.state
        assert all(torch.equal(a, b) for a, b in zip(after["anchor"], state["anchor"], strict=True))
