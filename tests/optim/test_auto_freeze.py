"""``freeze_step="auto"`` through ``fn.optim``: on 2 gloo ranks the switch is the same on every
rank and a run resumes bit for bit across it (own ``state_dict()`` and DCP ``PerRankState``);
checkpoints of a fixed ``freeze_step`` and an automatic one do not load into each other; the
never-compressed warning follows ``max_updates``; ``exp_avg_mask="auto"`` equals the hand-made
mask bit for bit."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fn.optim
from fn.collectives import Local
from tests._distributed import run_distributed
from tests.optim._problem import (
    flat_params,
    kill_hidden_unit,
    make_model,
    save_and_load,
    states_equal,
    train,
)

STEPS = 9
AUTO = fn.AutoFreeze(min_updates=2, max_updates=5, tolerance=0.05)
OPTIMIZERS = {
    "onebit_adam": lambda m: fn.optim.OnebitAdam(
        m.parameters(), lr=1e-2, freeze_step=AUTO, exp_avg_mask="auto"
    ),
    "onebit_lamb": lambda m: fn.optim.OnebitLamb(m.parameters(), lr=1e-2, freeze_step=AUTO),
}


def _freeze_at(opt) -> int:
    return int(opt._groups[0].state.auto.freeze_at)


def _worker(rank: int, world_size: int, root: str) -> dict:
    del world_size
    warnings.simplefilter("ignore", RuntimeWarning)  # the frozen-variance report
    out = {}
    for name, make in OPTIMIZERS.items():
        model = make_model()
        opt = make(model)
        saved, decided = {}, []
        for t in range(STEPS):
            train(model, opt, rank, range(t, t + 1))
            decided.append(_freeze_at(opt))
            if t + 1 in (2, 4, 6):
                where = f"{root}/{name}-{t + 1}"
                dcp.save({"optim": fn.optim.PerRankState(opt)}, checkpoint_id=where)
                weights = copy.deepcopy(model.state_dict())
                saved[t + 1] = (weights, save_and_load(opt.state_dict()), where)
        gathered = [None, None]
        dist.all_gather_object(gathered, (decided, flat_params(model)))
        out[name, "ranks agree"] = gathered[0][0] == gathered[1][0] and torch.equal(
            gathered[0][1], gathered[1][1]
        )
        out[name, "decided"] = decided
        full_params, full_state = flat_params(model), opt.state_dict()
        for k, (weights, state_dict, where) in saved.items():
            for path in ("own", "dcp"):
                resumed = make_model(seed=1)
                resumed.load_state_dict(weights)
                resumed_opt = make(resumed)
                if path == "own":
                    resumed_opt.load_state_dict(state_dict)
                else:
                    dcp.load({"optim": fn.optim.PerRankState(resumed_opt)}, checkpoint_id=where)
                train(resumed, resumed_opt, rank, range(k, STEPS))
                out[name, path, k] = torch.equal(flat_params(resumed), full_params) and (
                    states_equal(resumed_opt.state_dict(), full_state)
                )
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_switch_is_the_same_on_every_rank_and_resumes_bit_for_bit(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path), timeout=240)
    for name in OPTIMIZERS:
        for rank_results in results:
            decided = rank_results[name, "decided"]
            assert rank_results[name, "ranks agree"]
            switch = decided[-1]
            # undecided (0) until the end of update switch - 1, then fixed
            assert AUTO.min_updates < switch <= AUTO.max_updates + 1
            assert decided == [0] * (switch - 2) + [switch] * (STEPS - switch + 2)
            for k in (2, 4, 6):
                for path in ("own", "dcp"):
                    assert rank_results[name, path, k], (name, path, k)


def test_checkpoints_of_fixed_and_auto_freeze_steps_do_not_load_into_each_other():
    model = make_model()
    auto = fn.optim.OnebitAdam(model.parameters(), freeze_step="auto", comm=Local())
    fixed = fn.optim.OnebitAdam(model.parameters(), freeze_step=5, comm=Local())
    for opt in (auto, fixed):
        train(model, opt, 0, range(2))
    for loading, checkpoint in ((auto, fixed.state_dict()), (fixed, auto.state_dict())):
        before = save_and_load(loading.state_dict())
        with pytest.raises(ValueError, match="automatic switch and a fixed one"):
            loading.load_state_dict(save_and_load(checkpoint))
        assert states_equal(loading.state_dict(), before)


def test_never_compressed_warning_follows_max_updates():
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), freeze_step=AUTO, comm=Local())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not opt.warn_if_never_compressed(AUTO.max_updates + 1)
    with pytest.warns(UserWarning, match="max_updates"):
        assert opt.warn_if_never_compressed(AUTO.max_updates)


def test_a_checkpoint_of_the_earlier_criterion_is_refused():
    """A checkpoint whose automatic switch kept ``auto.drift`` (fn's earlier criterion) cannot
    continue here (it lacks ``auto.recent_energy``): refused by name, nothing loaded."""
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), freeze_step="auto", comm=Local())
    train(model, opt, 0, range(2))
    old = save_and_load(opt.state_dict())
    functional = old["state"][0]["functional"]
    functional[".auto.drift"] = functional.pop(".auto.recent_energy")
    before = save_and_load(opt.state_dict())
    with pytest.raises(ValueError, match="auto.drift"):
        opt.load_state_dict(old)
    assert states_equal(opt.state_dict(), before)


def _mask_worker(rank: int, world_size: int) -> dict:
    del world_size
    warnings.simplefilter("ignore", RuntimeWarning)  # the frozen-variance report
    out = {}
    for name, adapter in (("adam", fn.optim.OnebitAdam), ("lamb", fn.optim.OnebitLamb)):
        for freeze_step in (4, AUTO):
            for mask in ("auto", "hand", None):
                model = make_model()
                masks = kill_hidden_unit(model)
                exp_avg_mask = masks if mask == "hand" else mask
                opt = adapter(
                    model.parameters(), lr=1e-2, freeze_step=freeze_step, exp_avg_mask=exp_avg_mask
                )
                train(model, opt, rank, range(STEPS))
                out[name, str(freeze_step), mask] = (flat_params(model), opt.state_dict())
    return out


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_auto_mask_equals_the_hand_made_mask_on_two_ranks():
    """fn.optim's adapters with exp_avg_mask="auto" equal the same elements masked by hand, bit
    for bit (params and state, fixed and automatic freeze), and the mask changes the run."""
    for out in run_distributed(_mask_worker, 2, timeout=180):
        for name in ("adam", "lamb"):
            for freeze_step in ("4", str(AUTO)):
                auto, hand, unmasked = (out[name, freeze_step, m] for m in ("auto", "hand", None))
                assert torch.equal(auto[0], hand[0]), (name, freeze_step)
                assert not torch.equal(auto[0], unmasked[0]), (name, freeze_step)
                # the state both runs keep (the auto run also keeps its zero-gradient records)
                a, h = (s["state"][0]["functional"] for s in (auto[1], hand[1]))
                shared = [k for k in h if not k.startswith((".auto", ".exp_avg_mask"))]
                assert shared and all(k in a for k in shared), (name, sorted(a), sorted(h))
                for k in shared:
                    same = torch.equal(a[k], h[k]) if torch.is_tensor(h[k]) else a[k] == h[k]
                    assert same, (name, freeze_step, k)
