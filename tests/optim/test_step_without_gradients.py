"""A ``step()`` at which no param has a gradient on any rank is a no-op (fn.optim's policy):
before any backward pass, and again after ``zero_grad()``, in warmup and compressed phases,
nothing changes (params, state with its error feedback, step counts) and the next real update
is the one an optimizer without the no-op makes, bit for bit. The ranks decide it inside the
allreduce every step makes anyway; a rank without gradients while another has them still
updates (its gradient counts as zero). On one process, on mirrored ranks and on 2 gloo ranks."""

from __future__ import annotations

import warnings
from itertools import pairwise

import pytest
import torch
from torch.utils import _pytree as pytree

import fn
import fn.optim
from fn.collectives import Local
from tests._distributed import run_distributed
from tests._mirror import Mirror, same_bits
from tests.optim._problem import backward, flat_params, make_model, save_and_load

FREEZE, STEPS = 3, 6  # updates 1, 2 warm up; 3 to 6 are compressed
MAKERS = {
    "OnebitAdam": lambda ps, comm=None: fn.optim.OnebitAdam(
        ps, lr=1e-2, freeze_step=FREEZE, weight_decay=0.01, comm=comm
    ),
    "OnebitLamb": lambda ps, comm=None: fn.optim.OnebitLamb(
        ps, lr=1e-2, freeze_step=FREEZE, weight_decay=0.01, comm=comm
    ),
}
LOCAL_MAKERS = {
    **MAKERS,
    "ZeroOneAdam": lambda ps, comm=None: fn.optim.ZeroOneAdam(
        ps, lr=1e-2, var_freeze_step=2, var_update_scaler=1, local_step_scaler=2, comm=comm
    ),
    "FunctionalOptimizer(fn.adamw)": lambda ps, comm=None: fn.optim.FunctionalOptimizer(
        ps, fn.adamw(1e-2), comm
    ),
    "FunctionalOptimizer(fn.sgd)": lambda ps, comm=None: fn.optim.FunctionalOptimizer(
        ps, fn.sgd(1e-2, momentum=0.9, weight_decay=0.01), comm
    ),
}


def same_state(a: dict, b: dict) -> bool:
    """Two state_dicts equal: the same structure, the same non-tensor values, tensors bit for
    bit."""
    (xs, xspec), (ys, yspec) = pytree.tree_flatten(a), pytree.tree_flatten(b)
    if xspec != yspec:
        return False
    plain = [(x, y) for x, y in zip(xs, ys, strict=True) if not isinstance(x, torch.Tensor)]
    return all(x == y for x, y in plain) and same_bits(a, b)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    state = save_and_load(opt.state_dict())
    return {
        "params": flat_params(model),
        "state": state,
        "steps": [record["step"] for record in state["state"].values()],
    }


def noop(model, opt) -> dict:
    """A ``step()`` without gradients: the snapshots before and after it."""
    assert all(p.grad is None for p in model.parameters())
    before = snapshot(model, opt)
    result = opt.step()
    return {"before": before, "after": snapshot(model, opt), "result": result}


def run(make, rank, comm=None, silent_rank=None, silent_updates=()):
    """``STEPS`` updates of ``opt`` with a no-op ``step()`` before the first backward pass and
    after every update's ``zero_grad()``, beside ``ref``, the same optimizer on the same
    gradients without the no-ops. At the updates in ``silent_updates`` rank ``silent_rank``
    makes no backward pass (its gradients are None while the other rank's are not)."""
    model, ref_model = make_model(), make_model()
    opt, ref = make(model.parameters(), comm), make(ref_model.parameters(), comm)
    noops = [noop(model, opt)]
    history, ref_history, skipped = [], [], []
    for t in range(STEPS):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            if not (rank == silent_rank and t in silent_updates):
                backward(m, rank, t)
            o.step()
        skipped.append(opt.last_step_skipped)
        history.append(flat_params(model))
        ref_history.append(flat_params(ref_model))
        opt.zero_grad()
        noops.append(noop(model, opt))
    return {
        "noops": noops,
        "history": history,
        "ref_history": ref_history,
        "skipped": skipped,
        "last_skipped": opt.last_step_skipped,
        "skipped_steps": opt.skipped_steps,
        "state": save_and_load(opt.state_dict()),
        "ref_state": save_and_load(ref.state_dict()),
    }


def check_run(out: dict, start: torch.Tensor) -> None:
    """What every rank's :func:`run` must show."""
    for i, case in enumerate(out["noops"]):
        before, after = case["before"], case["after"]
        assert torch.equal(before["params"], after["params"]), f"no-op {i} moved the params"
        assert before["steps"] == after["steps"] == [i], f"no-op {i}: {after['steps']}"
        assert same_state(before["state"], after["state"]), f"no-op {i} changed the state"
        assert case["result"] is None
    assert out["last_skipped"] and out["skipped_steps"] == 0
    assert out["skipped"] == [False] * STEPS  # every real update after a no-op is one
    # the real updates are the ones of an optimizer that never saw the no-ops
    for t, (a, b) in enumerate(zip(out["history"], out["ref_history"], strict=True)):
        assert torch.equal(a, b), f"update {t + 1} differs from the run without no-ops"
    assert same_state(out["state"], out["ref_state"])
    moved = [start, *out["history"]]
    assert all(not torch.equal(x, y) for x, y in pairwise(moved)), "an update did nothing"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the unsafe-variance report
@pytest.mark.parametrize("name", LOCAL_MAKERS)
def test_step_without_gradients_is_a_no_op_on_one_process(name):
    check_run(run(LOCAL_MAKERS[name], 0, Local()), flat_params(make_model()))


def test_a_no_op_leaves_the_first_step_checks_to_the_first_update():
    """On two mirrored ranks: a no-op step before the first update makes the gradient vote
    and the ranks' comparison (made at every step until an update is made, so that ranks
    that differ are caught before the first one); the first real update still compares the
    ranks and looks for gradients averaged before it (one all_gather each), and warns about the
    mirrored ones."""
    model = make_model()
    comm = Mirror()
    opt = MAKERS["OnebitAdam"](model.parameters(), comm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            comm.calls = 0
            opt.step()
            assert comm.calls == 2  # the comparison, the vote
        assert not caught
        comm.calls = 0
        backward(model, 0, 0)
        opt.step()
    assert comm.calls == 1 + 2 + 1  # the vote, the two start checks, the warmup's allreduce
    assert any("bit-identical" in str(w.message) for w in caught)
    assert opt.state_dict()["state"][0]["step"] == 1


def test_a_closure_that_computes_gradients_makes_an_update():
    model = make_model()
    opt = MAKERS["OnebitLamb"](model.parameters(), Local())
    start = flat_params(model)
    loss = opt.step(lambda: backward(model, 0, 0))
    assert loss is not None and not opt.last_step_skipped
    assert opt.state_dict()["state"][0]["step"] == 1 and not torch.equal(flat_params(model), start)


def test_zero_gradients_are_gradients():
    """``zero_grad(set_to_none=False)`` leaves zero tensors: an update (weight decay moves the
    params, the count advances), as in torch.optim."""
    model = make_model()
    opt = MAKERS["OnebitAdam"](model.parameters(), Local())
    backward(model, 0, 0)
    opt.step()
    opt.zero_grad(set_to_none=False)
    params = flat_params(model)
    opt.step()
    assert opt.state_dict()["state"][0]["step"] == 2 and not opt.last_step_skipped
    assert not torch.equal(flat_params(model), params)


def _start_check_after_no_op(rank, name):
    """A no-op first step, then rank 1's params are changed: the first real update must still
    find the ranks out of sync (on every rank, with nothing changed)."""
    model = make_model()
    opt = MAKERS[name](model.parameters())
    opt.step()
    if rank == 1:
        with torch.no_grad():
            model[0].bias.add_(1.0)
    backward(model, rank, 0)
    params = flat_params(model)
    try:
        opt.step()
        message = None
    except ValueError as err:
        message = str(err)
    return {"message": message, "unchanged": torch.equal(params, flat_params(model))}


def _worker(rank, world_size):
    del world_size
    return {
        name: {
            "run": run(make, rank),
            # rank 1 makes no backward pass at a warmup and at a compressed update
            "one_rank_silent": run(make, rank, silent_rank=1, silent_updates=(1, 4)),
            "start_check": _start_check_after_no_op(rank, name),
        }
        for name, make in MAKERS.items()
    }


@pytest.fixture(scope="module")
def results():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_distributed(_worker, 2, timeout=170)


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["run", "one_rank_silent"])
@pytest.mark.parametrize("name", MAKERS)
def test_step_without_gradients_is_a_no_op_on_two_ranks(results, name, case):
    start = flat_params(make_model())
    for out in results:
        check_run(out[name][case], start)
    first, second = (out[name][case] for out in results)
    for t, (a, b) in enumerate(zip(first["history"], second["history"], strict=True)):
        assert torch.equal(a, b), f"ranks differ after update {t + 1}"
    assert same_state(first["state"]["param_groups"], second["state"]["param_groups"])


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", MAKERS)
def test_a_rank_without_gradients_counts_as_zero_when_another_has_them(results, name):
    """Rank 1 alone made no backward pass at updates 2 and 5: both ranks updated, alike, and
    differently from the run where it did."""
    runs = [out[name] for out in results]
    for silent in (1, 4):
        for out in runs:
            assert not torch.equal(
                out["one_rank_silent"]["history"][silent], out["run"]["history"][silent]
            )
        a, b = (out["one_rank_silent"]["history"][silent] for out in runs)
        assert torch.equal(a, b)


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", MAKERS)
def test_a_no_op_first_step_leaves_the_start_check_to_the_first_update(results, name):
    for out in results:
        check = out[name]["start_check"]
        assert check["message"] is not None and "out of sync" in check["message"]
        assert check["unchanged"]
