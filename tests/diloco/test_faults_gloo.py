"""What users do next on unreliable machines, on 2 gloo ranks in one launch (issue 60):

- a real ``torch.amp.GradScaler`` that skips one worker's inner step on an overflow: with
  ``grad_scaler=`` every worker takes its outer steps at the same loop iteration and the ranks
  end identical; without it, the exchange after the mismatch raises on every rank with both
  counts;
- inner optimizers that communicate across the workers (``fn.optim.OnebitAdam`` with its
  default comm, a ``DistributedDataParallel`` model) or that differ across them (param groups,
  a missing parameter): refused at construction, the same message on every rank;
- a layer unfrozen (and added to the inner optimizer) after construction: it joins at the next
  outer step with the workers' mean and stays synced; unfrozen on one worker only: refused;
- BatchNorm's running statistics: averaged at every outer step (``num_batches_tracked`` equal),
  or kept per worker with ``buffers="local"``; the buffers' exchange itself (one
  ``cast_allreduce`` exchange, the integer values in its header or, past ``HEADER_INTS``, in an
  all-gather) against the mean over the participants and the first participant's integers;
  a bad batch (a NaN sample) whose step the
  ``GradScaler`` skips leaves the parameters finite but the statistics NaN: that worker sits out,
  so the NaN never reaches the others;
- a checkpoint taken after a layer that is not the last joined, resumed into a ``DiLoCo`` built
  with it trainable: the run goes on bit for bit;
- a checkpoint taken just after a worker sat out (a NaN loss under AdamW) and just before it
  sits out again: the resumed run goes on bit for bit, with the sit-outs counted in a row across
  the resume (``max_sit_outs`` raises at the same step).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fn.collectives
import fn.diloco
import fn.optim
from fn.diloco.buffers import HEADER_INTS, Buffers, CapturedBuffers
from tests._distributed import run_distributed
from tests.diloco import _reference

W = 2
H = 3
STEPS = 9
INF_AT = (1, 4)  # rank 1's gradient overflows at loop iteration 4


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2))


def _batch(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(8, 4, generator=g) + rank, torch.randn(8, 2, generator=g)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _step(model: nn.Module, inner: torch.optim.Optimizer, rank: int, t: int) -> None:
    x, y = _batch(rank, t)
    nn.functional.mse_loss(model(x), y).backward()
    inner.step()
    inner.zero_grad()


def _unfreeze(model: nn.Module, inner: torch.optim.Optimizer, layer: int) -> None:
    """Layer ``layer`` trainable, as a param group of its own."""
    model[layer].requires_grad_(True)
    inner.add_param_group({"params": list(model[layer].parameters())})


def _scaled(rank: int, counted: bool):
    """A loop with a real GradScaler; rank 1's gradient overflows once. Per iteration: the outer
    steps so far; at the end the parameters after ``sync()``, or its error."""
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    kwargs = {"grad_scaler": scaler} if counted else {}
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=H, timeout=60, **kwargs)
    outer_steps, error = [], None
    try:
        for t in range(STEPS):
            x, y = _batch(rank, t)
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            if (rank, t) == INF_AT:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(inner)
            scaler.update()
            inner.zero_grad()
            outer_steps.append(diloco.outer_steps)
        diloco.sync()
    except ValueError as err:
        error = str(err)
    return outer_steps, diloco.inner_steps, _params(model), error


def _refused(build) -> str:
    try:
        build()
    except ValueError as err:
        return str(err)
    return "not refused"


def _refusals(rank: int) -> dict[str, str]:
    model = _net()
    other = [{"params": list(model[0].parameters()), "lr": 0.1}]
    other.append({"params": list(model[1:].parameters()), "lr": 0.2})
    groups = other if rank == 1 else model.parameters()
    missing = list(model.parameters())[: (-1 if rank == 1 else None)]
    ddp = nn.parallel.DistributedDataParallel(_net())

    def diloco(m, inner):
        return fn.diloco.DiLoCo(m, inner, sync_every=H)

    return {
        "fn.optim comm": _refused(lambda: diloco(model, fn.optim.OnebitAdam(model.parameters()))),
        "ddp": _refused(lambda: diloco(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))),
        "groups": _refused(lambda: diloco(model, torch.optim.AdamW(groups, lr=0.1))),
        "missing": _refused(lambda: diloco(model, torch.optim.AdamW(missing, lr=0.1))),
        "local comm": _refused(
            lambda: diloco(
                model, fn.optim.OnebitAdam(model.parameters(), comm=fn.collectives.Local())
            )
        ),
    }


def _unfrozen(rank: int, only: int | None):
    """The head frozen at first, unfrozen after loop iteration 4 (on rank ``only``; None:
    every rank) and given to the inner optimizer: per outer step, the parameters just before
    it and after it; or the error."""
    model = _net()
    model[3].requires_grad_(False)
    inner = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    before = []
    inner.register_step_post_hook(lambda *_: before.append(_params(model)))  # before DiLoCo's
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=H, timeout=60)
    after = []
    try:
        for t in range(STEPS):
            if t == 4 and only in (None, rank):
                _unfreeze(model, inner, 3)
            _step(model, inner, rank, t)
            if (t + 1) % H == 0:
                after.append(_params(model))
    except ValueError as err:
        return str(err)
    return [before[t] for t in range(H - 1, STEPS, H)], after, diloco.state_dict()["settings"]


def _batchnorm(rank: int, policy: str):
    """Per outer step, the buffers just before it and after it."""
    model = _net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    before, after = [], []
    inner.register_step_post_hook(lambda *_: before.append([b.clone() for b in model[1].buffers()]))
    fn.diloco.DiLoCo(model, inner, sync_every=H, buffers=policy)
    for t in range(2 * H):
        x, y = _batch(rank, t)
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        if (t + 1) % H == 0:
            after.append([b.clone() for b in model[1].buffers()])
    return [before[t] for t in range(H - 1, 2 * H, H)], after


def _buffer_values(rank: int, large: bool) -> list[torch.Tensor]:
    """Rank ``rank``'s buffers: two floating, one int64 with extreme values and, with ``large``,
    an int32 one that takes the integers past ``HEADER_INTS`` (into an all-gather)."""
    g = torch.Generator().manual_seed(rank)
    extreme = torch.tensor([-(2**63), 2**63 - 1, -1, 2**40 + rank], dtype=torch.int64)
    values = [torch.randn(3, generator=g), torch.randn(2, 2, generator=g).double(), extreme]
    if large:
        values.append(torch.arange(HEADER_INTS, dtype=torch.int32) * (rank + 1) - 7)
    return values


BUFFER_CASES = ((False, [True, True]), (False, [False, True]), (True, [False, True]))


def _buffer_exchange(rank: int):
    """Buffers.exchange in each of BUFFER_CASES (large, participants): the results and the
    bytes this rank sent."""
    comm = fn.collectives.ProcessGroup(timeout=60)
    out = []
    for large, participants in BUFFER_CASES:
        values = _buffer_values(rank, large)
        captured = CapturedBuffers([v.clone() for v in values], values)
        comm.reset_bytes_sent()
        got = Buffers.exchange(captured, comm, (), torch.tensor(participants), rank)
        out.append((got, comm.bytes_sent))
    return out


def _bad_batch(rank: int):
    """A NaN sample in rank 1's batch at iteration 4 under a real GradScaler (which skips the
    step): per iteration the outer steps and whether the buffers are finite; at the end the
    sit-outs, the buffers and an eval output."""
    model = _net()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    diloco = fn.diloco.DiLoCo(model, inner, sync_every=H, grad_scaler=scaler, timeout=60)
    finite = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(2 * H):
            x, y = _batch(rank, t)
            if (rank, t) == INF_AT:
                x[0, 0] = float("nan")
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(inner)
            scaler.update()
            inner.zero_grad()
            finite.append(all(bool(torch.isfinite(b).all()) for b in model.buffers()))
    model.eval()
    with torch.no_grad():
        out = model(_batch(0, 99)[0])
    messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
    return finite, diloco.sat_out, [b.clone() for b in model.buffers()], out, messages


def _resumed_after_a_join(rank: int):
    """The first layer frozen, unfrozen after iteration 1 and added to AdamW as a group of its
    own; saved after the 2nd outer step; resumed into a DiLoCo built with it trainable (and
    AdamW with the two groups, as its state holds them): the parameters at the end of both."""

    def build(trainable: bool):
        model = _net()
        model[0].requires_grad_(trainable)
        rest = [
            p for p in model.parameters() if p.requires_grad and p not in set(model[0].parameters())
        ]
        groups = [{"params": rest}] + (
            [{"params": list(model[0].parameters())}] if trainable else []
        )
        inner = torch.optim.AdamW(groups, lr=1e-2)
        return model, inner, fn.diloco.DiLoCo(model, inner, sync_every=H, timeout=60)

    def train(model, inner, first, last):
        for t in range(first, last):
            if t == 1 and not model[0].weight.requires_grad:
                _unfreeze(model, inner, 0)
            _step(model, inner, rank, t)

    model, inner, diloco = build(False)
    train(model, inner, 0, 2 * H)
    saved = copy.deepcopy(  # as a file would: the optimizer's state_dict() shares its tensors
        {"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}
    )
    train(model, inner, 2 * H, STEPS)
    model2, inner2, diloco2 = build(True)
    model2.load_state_dict(saved["model"])
    inner2.load_state_dict(saved["inner"])
    try:
        diloco2.load_state_dict(saved["diloco"])
    except ValueError as err:
        return str(err)
    train(model2, inner2, 2 * H, STEPS)
    return _params(model), _params(model2)


def _resumed_after_a_sit_out(rank: int):
    """Rank 1's loss NaN at iterations 4 and 7 (it sits out the outer steps after 5 and 8,
    ``max_sit_outs=2``), saved after iteration 5: the uninterrupted run and the resumed one,
    each as the iteration that raised, its error and the parameters; and the sit-outs loaded."""

    def build():
        model = _net()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, inner, fn.diloco.DiLoCo(model, inner, sync_every=H, max_sit_outs=2)

    def train(model, inner, first, last):
        error = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the sit-outs'
            for t in range(first, last):
                x, y = _batch(rank, t)
                nan = float("nan") if (rank, t) in ((1, 4), (1, 7)) else 1.0
                (nn.functional.mse_loss(model(x), y) * nan).backward()
                try:
                    inner.step()
                except RuntimeError as err:
                    error = (t, str(err))
                inner.zero_grad()
        return error, _params(model)

    model, inner, diloco = build()
    train(model, inner, 0, 2 * H)
    saved = copy.deepcopy(
        {"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}
    )
    uninterrupted = train(model, inner, 2 * H, STEPS)
    model, inner, diloco = build()
    model.load_state_dict(saved["model"])
    inner.load_state_dict(saved["inner"])
    diloco.load_state_dict(saved["diloco"])
    return uninterrupted, diloco.sat_out, train(model, inner, 2 * H, STEPS)


def _faults(rank, world_size):
    del world_size
    results = {
        "buffer exchange": _buffer_exchange(rank),
        "scaler": _scaled(rank, counted=True),
        "refusals": _refusals(rank),
        "unfrozen": _unfrozen(rank, None),
        "unfrozen on one": _unfrozen(rank, 1),
        "batchnorm": _batchnorm(rank, "mean"),
        "batchnorm local": _batchnorm(rank, "local"),
        "bad batch": _bad_batch(rank),
        "resumed after a join": _resumed_after_a_join(rank),
        "resumed after a sit-out": _resumed_after_a_sit_out(rank),
    }
    results["mismatch"] = _scaled(rank, counted=False)  # last: leaves a rank's exchange behind
    return results


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_faults, W, timeout=200)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_grad_scaler_skip_counts_as_the_same_inner_step_on_every_worker(ranks):
    (steps0, inner0, params0, error0), (steps1, inner1, params1, error1) = (
        r["scaler"] for r in ranks
    )
    assert error0 is error1 is None, (error0, error1)
    assert steps0 == steps1 == [t // H for t in range(1, STEPS + 1)]  # the same iterations
    assert inner0 == inner1 == STEPS
    assert _equal(params0, params1)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_without_grad_scaler_the_first_exchange_out_of_step_raises_on_every_rank(ranks):
    (steps0, inner0, _, error0), (steps1, inner1, _, error1) = (r["mismatch"] for r in ranks)
    assert (inner0, inner1) == (STEPS, STEPS - 1)  # rank 1's skipped step was not counted
    assert error0 == error1, (error0, error1)  # the same message on every rank
    assert "the workers are not at the same outer exchange" in error0, error0
    assert "worker 0: inner step 9, fragment 0" in error0 and "from sync() 0" in error0
    assert "worker 1: inner step 8, fragment 0" in error0, error0
    assert steps0[-1] == steps1[-1] == 2  # raised at rank 0's 3rd and rank 1's sync()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_inner_optimizers_that_communicate_or_differ_are_refused_on_every_rank(ranks):
    refused = [r["refusals"] for r in ranks]
    assert refused[0] == refused[1]
    assert (
        "the inner optimizer (OnebitAdam) communicates over its comm, which holds 2 of the 2"
        in (refused[0]["fn.optim comm"])
    )
    assert "DistributedDataParallel" in refused[0]["ddp"]
    assert "inner optimizer's hyperparameters (ranks 0 | 1)" in refused[0]["groups"]
    assert "inner optimizer's parameters (ranks 0 | 1)" in refused[0]["groups"]
    assert "inner optimizer's parameters (ranks 0 | 1)" in refused[0]["missing"]
    assert refused[0]["local comm"] == "not refused"


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_an_unfrozen_layer_joins_at_the_next_outer_step(ranks):
    (before0, after0, settings0), (before1, after1, settings1) = (r["unfrozen"] for r in ranks)
    assert settings0 == settings1 and "(2,)" in settings0  # the head joined the settings
    frozen = _params(_net())[-2:]
    for s in range(STEPS // H):
        assert _equal(after0[s], after1[s]), s  # every parameter the same on every worker
    assert _equal(after0[0][-2:], frozen)  # not trainable yet at the first outer step
    # unfrozen after iteration 4: joins at the 2nd outer step with the workers' mean
    joined = [_reference.cast_mean([b0, b1], torch.float32) for b0, b1 in zip(
        before0[1][-2:], before1[1][-2:], strict=True
    )]  # fmt: skip
    assert not _equal(before0[1][-2:], before1[1][-2:])
    assert _equal(after0[1][-2:], joined)
    assert not _equal(after0[2][-2:], after0[1][-2:])  # and trains, synced, from then on
    messages = [r["unfrozen on one"] for r in ranks]
    assert messages[0] == messages[1] and "trainable tensors 4" in messages[0], messages
    assert "trainable tensors 6" in messages[0]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_batchnorm_statistics_are_averaged_at_every_outer_step(ranks):
    (before0, after0), (before1, after1) = (r["batchnorm"] for r in ranks)
    for s in range(2):
        mean, var, tracked = after0[s]
        assert _equal(after0[s], after1[s]), s
        assert torch.equal(
            mean, _reference.cast_mean([before0[s][0], before1[s][0]], torch.float32)
        )
        assert torch.equal(var, _reference.cast_mean([before0[s][1], before1[s][1]], torch.float32))
        assert int(tracked) == H * (s + 1)
        assert not torch.equal(before0[s][0], before1[s][0])  # the workers' data differ
    (before0, after0), (before1, after1) = (r["batchnorm local"] for r in ranks)
    assert _equal(before0[1], after0[1]) and not _equal(after0[1][:2], after1[1][:2])


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_the_buffers_exchange_is_the_participants_mean_and_the_first_ones_integers(ranks):
    """Bit for bit: the floating buffers' fp32 mean over the participants, rounded to each
    dtype; the integer ones (int64 extremes) the first participant's, in the header (two 32-bit
    halves each) or, past ``HEADER_INTS`` values, in an all-gather; the same on both ranks; one
    exchange (at W = 2 one all-gather: its header, the fp32 values) plus that all-gather."""
    for case, (large, participants) in enumerate(BUFFER_CASES):
        every = [_buffer_values(r, large) for r in range(W)]
        taking = [r for r in range(W) if participants[r]]
        got = [r["buffer exchange"][case][0] for r in ranks]
        assert _equal(got[0], got[1])
        for i in (0, 1):
            total = sum((every[r][i].float() for r in taking), torch.zeros(every[0][i].shape))
            assert torch.equal(got[0][i], (total / len(taking)).to(every[0][i].dtype)), (case, i)
        assert _equal(got[0][2:], every[taking[0]][2:])
        assert [x.dtype for x in got[0]] == [x.dtype for x in every[0]]
        ints = sum(x.numel() for x in every[0][2:])
        in_header = 0 if large else 2 * ints
        expected = (W - 1) * (fn.collectives.HEADER_BYTES + 8 * in_header + 4 * (3 + 4))
        expected += (W - 1) * 8 * ints if large else 0
        assert [r["buffer exchange"][case][1] for r in ranks] == [expected] * W, case


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_bad_batch_under_a_grad_scaler_never_spreads_nan_statistics(ranks):
    (finite0, sat0, buffers0, out0, messages0), (finite1, sat1, buffers1, out1, messages1) = (
        r["bad batch"] for r in ranks
    )
    _, t = INF_AT  # the bad batch at iteration 4, the outer step after iteration 5
    assert finite1 == [True] * t + [False, True], finite1  # its statistics NaN until then
    assert all(finite0)  # the NaN statistics never reached worker 0
    assert sat0 == sat1 == [0, 1]  # worker 1 sat out the outer step after its bad batch
    assert messages0 == messages1 and "worker(s) 1 sat out" in messages0[0], messages0
    assert "its buffers" in messages0[0]
    assert _equal(buffers0, buffers1)
    assert torch.isfinite(out0).all() and torch.equal(out0, out1)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_checkpoint_after_a_join_resumes_into_a_diloco_built_with_it_trainable(ranks):
    for result in (r["resumed after a join"] for r in ranks):
        assert not isinstance(result, str), result
        uninterrupted, resumed = result
        assert _equal(uninterrupted, resumed)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_checkpoint_after_a_sit_out_resumes_bit_for_bit_with_the_sit_outs_in_a_row(ranks):
    results = [r["resumed after a sit-out"] for r in ranks]
    for (error, params), sat_out, (resumed_error, resumed_params) in results:
        assert sat_out == [0, 1]
        assert error == resumed_error and error[0] == STEPS - 1, error  # the 2nd in a row
        assert "worker(s) 1 sat out 2 outer steps in a row (max_sit_outs=2)" in error[1]
        assert _equal(params, resumed_params)
    assert _equal(results[0][0][1], results[1][0][1])  # every rank the same parameters
