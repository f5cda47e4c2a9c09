"""The torch.optim adapter under Local: parity with torch.optim and with the functional API,
flat buffers, param groups, LR schedulers, policies."""

from __future__ import annotations

import warnings

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local, Simulated
from tests.optim._problem import (
    backward,
    flat_grads,
    flat_params,
    make_model,
    run_functional,
    train,
    unflatten_like,
)

STEPS = 12


def _torch_run(model, opt, steps):
    for t in range(steps):
        opt.zero_grad()
        backward(model, 0, t)
        opt.step()
    return flat_params(model)


@pytest.mark.parametrize(
    "make_fn,make_torch",
    [
        (lambda: fn.adam(1e-2), lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False)),
        (
            lambda: fn.sgd(0.05, momentum=0.9),
            lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
        ),
    ],
    ids=["adam", "sgd"],
)
def test_functional_optimizer_matches_torch_optim(make_fn, make_torch):
    ours, ref = make_model(), make_model()
    start = flat_params(ours)
    got = _torch_run(ours, fn.optim.FunctionalOptimizer(ours.parameters(), make_fn()), 40)
    want = _torch_run(ref, make_torch(ref.parameters()), 40)
    assert (got - start).abs().max() > 1e-2
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_param_groups_lr_and_factory_hyperparameters_match_torch_adamw():
    ours, ref = make_model(), make_model()

    def groups(model, **extra):
        w1, b1, w2, b2 = model.parameters()
        return [
            {"params": [w1, w2], "weight_decay": 0.1, **extra},
            {"params": [b1, b2], "lr": 3e-2, "weight_decay": 0.0},
        ]

    opt = fn.optim.FunctionalOptimizer(
        groups(ours), fn.adamw, defaults=dict(lr=1e-2, weight_decay=0.01)
    )
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-2]
    got = _torch_run(ours, opt, 30)
    want = _torch_run(ref, torch.optim.AdamW(groups(ref), lr=1e-2, foreach=False), 30)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_params_become_views_of_one_buffer_and_frozen_params_are_left_out():
    model = make_model()
    frozen = model[2].bias
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.sgd(0.1))
    trainable = opt.param_groups[0]["params"]
    assert len(trainable) == 3 and all(p is not frozen for p in trainable)
    buffer = opt._groups[0].flat.master
    offset = 0
    for p in trainable:
        assert p.data_ptr() == buffer.data_ptr() + offset * buffer.element_size()
        offset += p.numel()
    assert offset == buffer.numel()
    for t in range(3):
        opt.zero_grad()
        backward(model, 0, t)
        opt.step()
    assert torch.equal(frozen, before)
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in trainable]), buffer)


def _onebit_cases(model):
    """(adapter, functional transform, flatten) for the three optimizers, under Local."""
    w1 = model[0].weight
    mask = (torch.arange(7) % 2).float()[:, None]  # zero the momentum of every other row
    return {
        "onebit_adam": (
            lambda ps: fn.optim.OnebitAdam(
                ps, lr=1e-2, freeze_step=5, weight_decay=0.01, exp_avg_mask={w1: mask}
            ),
            lambda flat_mask: fn.onebit_adam(
                1e-2, 5, weight_decay=0.01, comm=Local(), exp_avg_mask=flat_mask
            ),
            True,
        ),
        "zero_one_adam": (
            lambda ps: fn.optim.ZeroOneAdam(
                ps, lr=1e-2, var_freeze_step=6, var_update_scaler=2, local_step_scaler=2
            ),
            lambda flat_mask: fn.zero_one_adam(
                1e-2, var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, comm=Local()
            ),
            True,
        ),
        "onebit_lamb": (
            lambda ps: fn.optim.OnebitLamb(ps, lr=1e-2, freeze_step=5, weight_decay=0.01),
            lambda flat_mask: fn.onebit_lamb(1e-2, 5, weight_decay=0.01, comm=Local()),
            False,
        ),
    }


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_adapter_matches_functional_with_lr_scheduler(name):
    model = make_model()
    make_opt, make_tx, flatten = _onebit_cases(model)[name]
    start = flat_params(model)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    lrs, grads = [], []
    for t in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        backward(model, 0, t)
        grads.append(flat_grads(model))
        opt.step()
        sched.step()
    assert lrs[0] == 1e-2 and lrs[-1] == 1e-2 * 0.5**2
    # the functional run, fed the adapter's gradients and learning rates
    flat_mask = None
    if name == "onebit_adam":
        flat_mask = torch.ones_like(start)
        flat_mask[:35] = (torch.arange(7) % 2).float()[:, None].expand(7, 5).reshape(-1)
    to_tree = (lambda x: x) if flatten else unflatten_like(model)
    want = run_functional(make_tx(flat_mask), start, grads, lrs, to_tree)[-1]
    assert torch.equal(flat_params(model), want)
    # and the schedule mattered: a constant lr ends elsewhere
    other = run_functional(make_tx(flat_mask), start, grads, [1e-2] * STEPS, to_tree)[-1]
    assert not torch.equal(other, want)


def test_group_hyperparameter_change_rebuilds_the_transform_and_keeps_state():
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    for t in range(4):
        opt.zero_grad()
        backward(model, 0, t)
        opt.step()
    before = opt.state_dict()["state"][0]["functional"][".exp_avg_sq"].clone()
    opt.param_groups[0]["freeze_step"] = 100  # back to warmup: v moves again
    opt.zero_grad()
    backward(model, 0, 4)
    opt.step()
    after = opt.state_dict()["state"][0]
    assert after["step"] == 5 and not torch.equal(after["functional"][".exp_avg_sq"], before)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_gradients_change_nothing(policy):
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, nonfinite=policy)
    train(model, opt, 0, range(3))
    state, params = opt.state_dict(), flat_params(model)
    opt.zero_grad()
    backward(model, 0, 3)
    model[2].weight.grad[0, 0] = float("nan")
    if policy == "raise":
        with pytest.raises(ValueError, match="non-finite"):
            opt.step()
    else:
        opt.step()
        assert opt.last_step_skipped and opt.skipped_steps == 1
    after = opt.state_dict()
    assert after["state"][0]["step"] == 3
    for k, v in state["state"][0]["functional"].items():
        w = after["state"][0]["functional"][k]
        assert (v is None and w is None) or torch.equal(v, w), k
    assert torch.equal(flat_params(model), params)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_one_nonfinite_element_among_many_is_caught(bad):
    model = torch.nn.Linear(300, 300)
    opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.adam(1e-2))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    model.weight.grad[123, 45] = bad
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()


def test_finite_gradients_whose_sum_overflows_are_not_nonfinite():
    # The check sums each group first; an overflowing sum of finite values must not count.
    model = torch.nn.Linear(4, 2)
    opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.sgd(1e-40), nonfinite="raise")
    for p in model.parameters():
        p.grad = torch.full_like(p, 3e38)
    before = flat_params(model)
    opt.step()
    assert not opt.last_step_skipped
    assert torch.isfinite(flat_params(model)).all() and not torch.equal(flat_params(model), before)


def test_none_grads_count_as_zero_and_empty_params_give_no_nan():
    model = make_model()
    empty = torch.nn.Parameter(torch.zeros(0, 3))
    lonely = torch.nn.Parameter(torch.zeros(0))
    groups = [{"params": [*model.parameters(), empty]}, {"params": [lonely]}]
    for make in (
        lambda g: fn.optim.OnebitAdam(g, lr=1e-2, freeze_step=2, weight_decay=0.1),
        lambda g: fn.optim.ZeroOneAdam(g, lr=1e-2, var_freeze_step=2),
        lambda g: fn.optim.OnebitLamb(g, lr=1e-2, freeze_step=2, weight_decay=0.1),
        lambda g: fn.optim.FunctionalOptimizer(g, fn.lamb(1e-2), flatten=False),
    ):
        model = make_model()
        groups = [{"params": [*model.parameters(), empty]}, {"params": [lonely]}]
        opt = make(groups)
        for t in range(4):
            opt.zero_grad()
            backward(model, 0, t)
            model[2].bias.grad = None  # no gradient this step: a zero gradient
            opt.step()
        assert torch.isfinite(flat_params(model)).all()
        for record in opt.state_dict()["state"].values():
            for v in record["functional"].values():
                assert v is None or torch.isfinite(v.float()).all()


def test_zero_grad_for_a_none_grad_param_equals_an_explicit_zero():
    a, b = make_model(), make_model()
    opt_a = fn.optim.OnebitAdam(a.parameters(), lr=1e-2, freeze_step=2)
    opt_b = fn.optim.OnebitAdam(b.parameters(), lr=1e-2, freeze_step=2)
    for t in range(4):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            backward(model, 0, t)
        a[0].bias.grad = None
        b[0].bias.grad.zero_()
        opt_a.step()
        opt_b.step()
    assert torch.equal(flat_params(a), flat_params(b))


def test_bad_arguments():
    model = make_model()
    with pytest.raises(TypeError, match="one rank per process"):
        fn.optim.OnebitAdam(model.parameters(), comm=Simulated(2))
    with pytest.raises(ValueError, match="only takes a per-group lr"):
        fn.optim.FunctionalOptimizer(
            [{"params": list(model.parameters()), "weight_decay": 0.1}], fn.adam(1e-3)
        )
    with pytest.raises(ValueError, match="nonfinite"):
        fn.optim.OnebitAdam(model.parameters(), nonfinite="ignore")
    with pytest.raises(ValueError, match="share dtype and device"):
        fn.optim.FunctionalOptimizer(
            [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2).double())],
            fn.sgd(0.1),
        )
    with pytest.raises(ValueError, match="does not broadcast"):
        fn.optim.OnebitAdam(model.parameters(), exp_avg_mask={model[0].weight: torch.ones(3)})
    with pytest.raises(ValueError, match="not trainable params"):
        fn.optim.OnebitAdam(model[0].parameters(), exp_avg_mask={model[2].bias: torch.ones(3)})


ADAPTERS = {
    "FunctionalOptimizer": lambda params: fn.optim.FunctionalOptimizer(params, fn.adam(1e-2)),
    "OnebitAdam": fn.optim.OnebitAdam,
    "ZeroOneAdam": fn.optim.ZeroOneAdam,
    "OnebitLamb": fn.optim.OnebitLamb,
}


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_params_on_the_meta_device_are_an_error_naming_the_param_and_the_fix(name):
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ValueError, match=r"param group 0, param 0 \('0.weight'\).*meta device"):
        ADAPTERS[name](model.named_parameters())
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"model.to_empty\(device=\.\.\.\) and its init"):
        ADAPTERS[name](
            [
                {"params": [model[0].weight]},
                {"params": [torch.nn.Parameter(torch.ones(2, device="meta"))]},
            ]
        )


def test_a_param_group_on_the_meta_device_is_not_added():
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    with pytest.raises(ValueError, match="param group 1, param 1 of shape \\(3,\\) is on the meta"):
        opt.add_param_group(
            {
                "params": [
                    torch.nn.Parameter(torch.ones(2)),
                    torch.nn.Parameter(torch.ones(3, device="meta")),
                ]
            }
        )
    assert len(opt.param_groups) == 1
    opt.zero_grad()
    backward(model, 0, 0)
    opt.step()


@pytest.mark.parametrize("name", ["OnebitAdam", "ZeroOneAdam", "OnebitLamb"])
def test_exp_avg_mask_of_another_form_is_a_type_error_naming_the_form(name):
    model = make_model()
    w = model[0].weight
    mask = torch.ones_like(w)
    wrong = [
        ([(w, mask)], "got list"),  # pairs
        ([mask, mask, mask], "got list"),  # masks in the params' order
        (mask, "got Tensor"),
        ({"0.weight": mask}, "got a key of type str"),  # names
        ({w: mask.tolist()}, "got a value of type list"),
    ]
    for form, message in wrong:
        with pytest.raises(TypeError, match=f"mapping {{param: mask}}.*{message}"):
            ADAPTERS[name](model.parameters(), exp_avg_mask=form)
    with pytest.raises(ValueError, match="does not broadcast to its param's shape"):
        ADAPTERS[name](model.parameters(), exp_avg_mask={w: torch.ones(3, 3)})
    with pytest.raises(ValueError, match="not trainable params of this optimizer"):
        ADAPTERS[name](model[2].parameters(), exp_avg_mask={w: mask})
    ADAPTERS[name](model.parameters(), exp_avg_mask={w: mask})


def test_default_comm_is_local_without_torch_distributed():
    model = make_model()
    assert isinstance(fn.optim.OnebitAdam(model.parameters()).comm, Local)


def test_a_fixed_transform_refuses_a_hyperparameter_set_in_its_group_later():
    """Set after the build (a weight-decay schedule), the transform ignored it silently; now
    step() raises with nothing changed, and a scheduler's own keys (OneCycleLR's max_lr) pass."""
    model = make_model()
    opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.adam(1e-2))
    backward(model, 0, 0)
    before = flat_params(model)
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(ValueError, match=r"sets \['weight_decay'\], but a fixed transform"):
        opt.step()
    assert torch.equal(flat_params(model), before) and opt.group_runtimes[0].step == 0
    del opt.param_groups[0]["weight_decay"]
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4, cycle_momentum=False)
    opt.step()
    assert not torch.equal(flat_params(model), before)


def _warmup(count):
    return 1e-3 * (count + 1)


def _step_or_refuse(model, opt, t):
    """One step; the error it raises (then with nothing changed), else ``None``."""
    opt.zero_grad()
    backward(model, 0, t)
    before, count = flat_params(model), opt.group_runtimes[0].step
    try:
        opt.step()
    except ValueError as err:
        assert torch.equal(flat_params(model), before) and opt.group_runtimes[0].step == count
        return err
    return None


@pytest.mark.parametrize("when", ["before the first step", "after two steps", "at the build"])
def test_a_group_lr_that_a_scheduling_transform_ignores_is_refused(when):
    """fn.adam(lr=schedule) replaces the lr written into its state at every update: a group lr
    set by a user or a torch scheduler was ignored silently; now step() raises within one
    update of it, with nothing changed, while a run that leaves the lr alone trains."""
    model = make_model()
    group = {"params": list(model.parameters())}
    if when == "at the build":
        group["lr"] = 0.5
    opt = fn.optim.FunctionalOptimizer([group], fn.adam(_warmup))
    errors = []
    for t in range(5):
        if t == {"before the first step": 0, "after two steps": 2}.get(when):
            opt.param_groups[0]["lr"] = 0.25
        errors.append(_step_or_refuse(model, opt, t))
    first = next(t for t, err in enumerate(errors) if err is not None)
    assert first <= 2  # the update given the lr, or the next one
    assert "schedules its own learning rate" in str(errors[first])
    assert all(err is not None for err in errors[first:])  # the same until the lr is put back


def test_a_scheduling_transform_left_alone_and_a_driven_constant_lr_train():
    """Neither a schedule whose group lr nobody sets nor a constant lr that a torch scheduler
    drives (every step) is refused, also across a reset and a checkpoint load."""
    models = make_model(), make_model()
    scheduled = fn.optim.FunctionalOptimizer(models[0].parameters(), fn.adam(_warmup))
    driven = fn.optim.FunctionalOptimizer(models[1].parameters(), fn.adam(1e-2))
    sched = torch.optim.lr_scheduler.StepLR(driven, step_size=1, gamma=0.5)
    for t in range(4):
        for model, opt in zip(models, (scheduled, driven), strict=True):
            assert _step_or_refuse(model, opt, t) is None
        sched.step()
        if t == 1:
            scheduled.load_state_dict(scheduled.state_dict())
            driven.reset_state()
    assert fn.get_hyperparam(scheduled.group_runtimes[0].state, "lr") == _warmup(3)
    assert fn.get_hyperparam(driven.group_runtimes[0].state, "lr") == 1e-2 * 0.5**3
    assert driven.group_runtimes[0].step == 2  # reset after its second update


def test_add_param_group_builds_its_buffer_and_a_bad_group_is_not_added():
    model = make_model()
    w1, b1, w2, b2 = model.parameters()
    opt = fn.optim.FunctionalOptimizer([w1, b1], fn.adam(1e-2))
    with pytest.raises(ValueError, match="only takes a per-group lr"):
        opt.add_param_group({"params": [w2], "eps": 1e-3})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [w2, b2], "lr": 1e-3})
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-3]
    before = flat_params(model)
    opt.zero_grad()
    backward(model, 0, 0)
    opt.step()
    moved = (flat_params(model) - before).abs()
    assert moved[:42].max() > 5e-3 and 0 < moved[42:].max() < 2e-3  # lr 1e-2 vs 1e-3


def test_tensor_lr_equals_float_lr_with_a_scheduler():
    """A one-element tensor lr (as torch.optim takes it; schedulers write it in place) gives
    the float lr's updates bit for bit, and the state never aliases the tensor."""
    runs = {}
    for kind in ("float", "tensor"):
        model = make_model()
        lr = 1e-2 if kind == "float" else torch.tensor(1e-2)
        local = fn.collectives.Local()
        opt = fn.optim.OnebitAdam(model.parameters(), lr=lr, freeze_step=3, comm=local)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            train(model, opt, 0, range(6), scheduler=sched)
        runs[kind] = (flat_params(model), opt.state_dict())
    assert torch.equal(runs["float"][0], runs["tensor"][0])
    lr_in_state = runs["tensor"][1]["state"][0]["functional"][".lr"]
    assert isinstance(runs["tensor"][1]["param_groups"][0]["lr"], torch.Tensor)
    assert torch.equal(lr_in_state, runs["float"][1]["state"][0]["functional"][".lr"])


@pytest.mark.parametrize("lr", [torch.tensor([1e-2, 1e-3]), torch.tensor(1), torch.tensor(-0.1)])
def test_a_tensor_lr_that_is_no_learning_rate_is_refused(lr):
    model = make_model()
    with pytest.raises(ValueError, match="one-element floating-point tensor"):
        fn.optim.OnebitAdam(model.parameters(), lr=lr, comm=fn.collectives.Local())


@pytest.mark.parametrize("cls", ["FunctionalOptimizer", "OnebitAdam"])
def test_the_state_dict_hooks_of_torch_optim_run(cls):
    """torch.optim.Optimizer's register_(load_)state_dict_pre/post_hook, in torch's order; a
    pre-hook's returned dict is the one loaded, a post-hook's the one returned."""
    model = make_model()
    if cls == "OnebitAdam":
        opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    else:
        opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.adam(1e-2))
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": calls.append("save post")})
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: calls.append("load pre") or {k: v for k, v in sd.items() if k != "tag"}
    )
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    saved = opt.state_dict()
    assert "tag" in saved
    opt.load_state_dict(saved)  # the pre-hook takes the tag out again
    assert calls == ["save pre", "save post", "load pre", "load post"]
