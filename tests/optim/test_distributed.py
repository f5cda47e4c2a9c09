"""The adapter on 2 real gloo processes (one launch): parity with the functional optimizers,
ranks in lockstep, LR schedulers, checkpoints with error feedback, a world-size change,
non-finite steps on one rank only, and mismatched models."""

from __future__ import annotations

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local, ProcessGroup, Simulated, replicate, simulate
from tests._distributed import run_distributed
from tests.optim._problem import (
    backward,
    batch,
    flat_grads,
    flat_params,
    interrupted_run,
    make_model,
    run_functional,
    states_equal,
    train,
    unflatten_like,
)

WORLD, STEPS, FREEZE = 2, 10, 4
CHECKPOINTED = {
    "onebit_adam": lambda ps: fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=4, weight_decay=0.01),
    "zero_one_adam": lambda ps: fn.optim.ZeroOneAdam(
        ps,
        lr=1e-2,
        var_freeze_step=5,
        var_update_scaler=2,
        local_step_scaler=2,
        local_step_clipper=4,
    ),
    "onebit_lamb": lambda ps: fn.optim.OnebitLamb(ps, lr=1e-2, freeze_step=4, weight_decay=0.01),
}


def _scheduled_run(model, opt, sched, rank):
    """``STEPS`` updates, ``sched`` stepped after each: param group 0 as each update saw it
    (a copy), the flat gradients and the flat params after each update."""
    groups, grads, history = [], [], []
    for t in range(STEPS):
        groups.append(dict(opt.param_groups[0]))
        opt.zero_grad()
        backward(model, rank, t)
        grads.append(flat_grads(model))
        opt.step()
        sched.step()
        history.append(flat_params(model))
    return groups, grads, history


def _onebit_adam_with_scheduler(rank, comm):
    model = make_model()
    start = flat_params(model)
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, weight_decay=0.01)
    assert isinstance(opt.comm, ProcessGroup)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    groups, grads, history = _scheduled_run(model, opt, sched, rank)
    lrs = [group["lr"] for group in groups]
    tx = fn.onebit_adam(1e-2, FREEZE, weight_decay=0.01, comm=comm)
    functional = run_functional(tx, start, grads, lrs)
    return {"start": start, "lrs": lrs, "grads": grads, "history": history, "ref": functional}


CYCLED = {  # the adapter, and the functional optimizer given the same betas at each update
    "onebit_adam": (
        lambda ps: fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=FREEZE),
        lambda betas, comm: fn.onebit_adam(1e-2, FREEZE, betas=betas, comm=comm),
    ),
    "onebit_lamb": (
        lambda ps: fn.optim.OnebitLamb(ps, lr=1e-2, freeze_step=FREEZE, weight_decay=0.01),
        lambda betas, comm: fn.onebit_lamb(1e-2, FREEZE, betas=betas, weight_decay=0.01, comm=comm),
    ),
}


def _cycled_betas(rank, comm, name):
    """OneCycleLR cycling betas (its default) past the freeze: each update rebuilds the
    transform with the scheduler's betas on the state as it is, packed momentum and all."""
    make_opt, make_tx = CYCLED[name]
    model = make_model()
    start = flat_params(model)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS)
    groups, grads, history = _scheduled_run(model, opt, sched, rank)
    schedule = [(group["lr"], group["betas"]) for group in groups]
    to_tree = unflatten_like(model) if name == "onebit_lamb" else lambda x: x  # per param
    p = to_tree(start)
    state, ref = make_tx(schedule[0][1], comm).init(p), []
    for t, ((lr, betas), g) in enumerate(zip(schedule, grads, strict=True), start=1):
        state = fn.set_hyperparams(state, lr=lr)
        updates, state = make_tx(betas, comm).update(to_tree(g), state, p, step=t)
        p = fn.apply_updates(p, updates)
        ref.append(torch.cat([x.reshape(-1) for x in fn.tree.tree_leaves(p)]))
    return {"history": history, "ref": ref, "betas": [b for _, b in schedule]}


def _adam_with_averaged_grads(rank):
    model = make_model()
    opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.adam(1e-2))
    grads, history = train(model, opt, rank, range(STEPS))
    return {"grads": grads, "history": history}


def _nonfinite_on_one_rank(rank, dtype, use_scaler):
    """Rank 1 alone gets an Inf gradient at update 6 (compressed phase): both ranks skip."""
    model = make_model(dtype=dtype)
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, nonfinite="skip")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if use_scaler else None
    unchanged = None
    for t in range(8):
        opt.zero_grad()
        if scaler is None:
            backward(model, rank, t)
        else:
            x, y = batch(rank, t, dtype)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
            scaler.scale(loss).backward()
        if t == 5:
            if rank == 1:
                model[2].weight.grad[0, 0] = float("inf")
            before, params = opt.state_dict(), flat_params(model)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if t == 5:
            errors = before["state"][0]["functional"][".worker_error"]
            unchanged = (
                opt.last_step_skipped
                and states_equal(before, opt.state_dict())
                and torch.equal(params, flat_params(model))
                and bool(errors.abs().sum() > 0)
            )
    return {"unchanged": unchanged, "final": flat_params(model), "skipped": opt.skipped_steps}


def _mismatched_models(rank):
    """Rank 1 has a narrower layer, then an extra layer: both ranks must raise."""
    width = 7 if rank == 0 else 6
    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Linear(width, 3)),
        torch.nn.Sequential(*(torch.nn.Linear(5, 5) for _ in range(2 + rank))),
    ]
    messages = []
    for model in models:
        try:
            fn.optim.OnebitAdam(model.parameters())
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
    return messages


def _worker(rank, world_size):
    comm = ProcessGroup()
    out = {"onebit_adam": _onebit_adam_with_scheduler(rank, comm)}
    out["adam"] = _adam_with_averaged_grads(rank)
    out["cycled"] = {name: _cycled_betas(rank, comm, name) for name in CYCLED}
    out["checkpoints"] = {}
    for name, make in CHECKPOINTED.items():
        for k in (2, 7):
            run = interrupted_run(make, rank, k, 12)
            out["checkpoints"][name, k] = (run["same_params"], run["same_state"])
            if name == "onebit_adam" and k == 7:
                out["w2_checkpoint"] = run["checkpoint"]
    out["skip"] = _nonfinite_on_one_rank(rank, torch.float32, False)
    out["scaler_skip"] = _nonfinite_on_one_rank(rank, torch.bfloat16, True)
    out["mismatch"] = _mismatched_models(rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout=150)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_onebit_adam_adapter_equals_functional_and_ranks_agree(results):
    runs = [r["onebit_adam"] for r in results]
    for run in runs:
        assert all(torch.equal(a, b) for a, b in zip(run["history"], run["ref"], strict=True))
    for t in range(STEPS):  # 1-bit Adam: every rank holds the same params after every step
        assert torch.equal(runs[0]["history"][t], runs[1]["history"][t]), t
    lrs = runs[0]["lrs"]
    assert lrs[0] == 1e-2 and lrs[3] == 5e-3 and lrs[9] == 1.25e-3  # StepLR reached the state
    # the functional optimizer under Simulated(2), fed both ranks' gradients and the same lrs
    comm = Simulated(WORLD)
    tx = fn.onebit_adam(1e-2, FREEZE, weight_decay=0.01, comm=comm)
    p = replicate(runs[0]["start"], comm)
    state = replicate(tx.init(runs[0]["start"]), comm)
    update = simulate(tx.update, comm)
    for t in range(STEPS):
        state = fn.set_hyperparams(state, lr=lrs[t])
        g = torch.stack([run["grads"][t] for run in runs])
        updates, state = update(g, state, p, step=t + 1)
        p = fn.apply_updates(p, updates)
        for r in range(WORLD):
            torch.testing.assert_close(p[r], runs[r]["history"][t], atol=1e-6, rtol=0)


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CYCLED))
def test_betas_changed_past_the_freeze_rebuild_the_transform_and_keep_the_state(results, name):
    runs = [r["cycled"][name] for r in results]
    assert len(set(runs[0]["betas"][FREEZE:])) > 1  # the betas changed in the compressed phase
    for run in runs:
        for t, (got, want) in enumerate(zip(run["history"], run["ref"], strict=True)):
            assert torch.equal(got, want), t
    for t in range(STEPS):
        assert torch.equal(runs[0]["history"][t], runs[1]["history"][t]), t


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_plain_transform_gets_averaged_gradients(results):
    runs = [r["adam"] for r in results]
    grads = [(a + b) / 2 for a, b in zip(runs[0]["grads"], runs[1]["grads"], strict=True)]
    want = run_functional(fn.adam(1e-2), flat_params(make_model()), grads)
    for run in runs:
        assert all(torch.equal(a, b) for a, b in zip(run["history"], want, strict=True))


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_checkpoints_resume_bit_identically_with_error_feedback(results):
    for r in results:
        for key, (same_params, same_state) in r["checkpoints"].items():
            assert same_params and same_state, key
    errors = results[0]["w2_checkpoint"]["state"][0]["functional"][".worker_error"]
    assert errors.abs().sum() > 0  # the compressed phase left error feedback to restore


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_world_size_change_resets_the_errors_with_a_warning(results):
    ckpt = results[0]["w2_checkpoint"]
    model = make_model()
    opt = CHECKPOINTED["onebit_adam"](model.parameters())
    assert isinstance(opt.comm, Local)
    with pytest.warns(UserWarning, match="world_size \\[2\\].*reset"):
        opt.load_state_dict(ckpt)
    state = opt.state_dict()["state"][0]
    saved = ckpt["state"][0]
    assert state["step"] == saved["step"] == 7
    moments = [k for k in saved["functional"] if k.startswith(".exp_avg")]  # packed or not
    assert moments and all(
        torch.equal(state["functional"][k], saved["functional"][k]) for k in moments
    )
    for field in (".worker_error", ".server_error"):  # reset: allocated, zero, when needed
        assert saved["functional"][field].any() and state["functional"][field] is None
    train(model, opt, 0, range(7, 9))
    assert torch.isfinite(flat_params(model)).all()


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["skip", "scaler_skip"])
def test_nonfinite_gradients_on_one_rank_are_skipped_by_all(results, case):
    for r in results:
        assert r[case]["unchanged"] and r[case]["skipped"] == 1
    assert torch.equal(results[0][case]["final"], results[1][case]["final"])


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_mismatched_models_are_a_clear_error_on_every_rank(results):
    for r in results:
        shapes, counts = r["mismatch"]
        assert "param group 0, param 0 differs across ranks" in shapes
        assert "(7, 5)" in shapes and "(6, 5)" in shapes
        assert "4 trainable params on rank 0 but 6 on rank 1" in counts
