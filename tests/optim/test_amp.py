"""Mixed precision: bf16 params with fp32 masters, torch.autocast and torch.amp.GradScaler."""

from __future__ import annotations

import torch

import fn.optim
from tests.optim._problem import batch, flat_params, make_model, states_equal

STEPS = 8


def make_opt(params):
    return fn.optim.OnebitAdam(params, lr=1e-2, freeze_step=3, weight_decay=0.01)


def loss_of(model, t):
    x, y = batch(0, t, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return torch.nn.functional.mse_loss(model(x).float(), y.float())


def run(scaler=None, unscale_first=False, inf_at=None):
    model = make_model(dtype=torch.bfloat16)
    opt = make_opt(model.parameters())
    skipped = []
    for t in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, t)
        if scaler is None:
            loss.backward()
            opt.step()
            continue
        scaler.scale(loss).backward()
        if t == inf_at:
            model[0].weight.grad[1, 2] = float("inf")
            state, params, scale = opt.state_dict(), flat_params(model), scaler.get_scale()
        if unscale_first:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
        scaler.step(opt)
        scaler.update()
        if t == inf_at:
            skipped.append(opt.last_step_skipped)
            assert states_equal(state, opt.state_dict())  # errors, moments, step, master
            assert torch.equal(flat_params(model), params)
            assert scaler.get_scale() == scale / 2
    return model, opt, skipped


def test_bf16_params_keep_an_fp32_master_and_fp32_state():
    model, opt, _ = run()
    flat = opt._groups[0].flat
    assert flat.master.dtype == torch.float32 and flat.model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.equal(flat_params(model), flat.master.to(torch.bfloat16))
    for v in opt.state_dict()["state"][0]["functional"].values():
        assert v is None or v.dtype in (torch.float32, torch.int64, torch.uint8)


def test_grad_scaler_steps_equal_unscaled_steps():
    # the scale is a power of two, so unscaling is exact: the trajectories agree bit for bit
    plain, plain_opt, _ = run()
    for unscale_first in (False, True):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        scaled, scaled_opt, _ = run(scaler, unscale_first)
        assert torch.equal(flat_params(scaled), flat_params(plain))
        assert states_equal(scaled_opt.state_dict(), plain_opt.state_dict())


def test_an_overflow_step_is_skipped_with_all_state_untouched():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    model, opt, skipped = run(scaler, inf_at=5)
    assert skipped == [True] and opt.skipped_steps == 1
    assert opt.state_dict()["state"][0]["step"] == STEPS - 1
    assert torch.isfinite(flat_params(model)).all()


def test_writing_the_params_refreshes_the_master():
    model, opt, _ = run()
    with torch.no_grad():
        model[0].weight.fill_(0.5)
    opt.zero_grad()
    loss_of(model, 0).backward()
    opt._groups[0].flat.check_params()
    assert torch.all(opt._groups[0].flat.master[:35] == 0.5)


def step_after(write):
    """A trained bf16 model, ``write(param)`` applied to every param, then one more step."""
    model, opt, _ = run()
    for p in model.parameters():
        write(p)
    opt.zero_grad()
    loss_of(model, STEPS).backward()
    opt.step()
    return flat_params(model), opt.state_dict()


def test_a_write_through_data_is_kept_like_a_tracked_write():
    # p.data writes do not bump p._version; the next step must still start from the written values
    def tracked(p):
        with torch.no_grad():
            p.zero_()

    tracked_params, tracked_state = step_after(tracked)
    data_params, data_state = step_after(lambda p: p.data.zero_())
    assert torch.equal(data_params, tracked_params)
    assert states_equal(data_state, tracked_state)
    assert not torch.equal(data_params, step_after(lambda p: None)[0])


def test_a_partial_write_refreshes_the_master_only_where_the_params_changed():
    model, opt, _ = run()
    flat = opt._groups[0].flat
    before = flat.master.clone()
    assert not torch.equal(before, before.to(torch.bfloat16).float())  # the master is finer
    for p in model.parameters():
        p.data.clamp_(-0.1, 0.1)
    after = flat_params(model)
    changed = after != before.to(torch.bfloat16)
    assert changed.any() and not changed.all()
    flat.check_params()
    assert torch.equal(flat.master, torch.where(changed, after.float(), before))


def test_state_dict_takes_in_writes_through_data():
    model, opt, _ = run()
    for p in model.parameters():
        p.data.mul_(0.5)
    master = opt.state_dict()["state"][0]["master"]
    assert torch.equal(master.to(torch.bfloat16), flat_params(model))
