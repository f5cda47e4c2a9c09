"""The adapter's double buffering: it donates the state from two steps back and its gradient
buffer, with the results of the pure functional loop bit for bit, never writing a state handed
out by ``state_dict()``, and without fresh full-size tensors in steady state."""

from __future__ import annotations

import copy
import resource
import warnings

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local
from tests._distributed import run_distributed
from tests._mirror import Mirror, bits, same_bits
from tests.optim._problem import (
    backward,
    flat_grads,
    flat_params,
    make_model,
    run_functional,
    unflatten_like,
)

TRANSFORMS = {
    "adam": lambda: fn.adam(1e-2),
    "adam-l2": lambda: fn.adam(1e-2, weight_decay=0.01),
    "adamw": lambda: fn.adamw(1e-2),
    "adam-foreach": lambda: fn.adam(1e-2, implementation="foreach"),
    "sgd-momentum": lambda: fn.sgd(0.1, momentum=0.9),
    "sgd-nesterov": lambda: fn.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "lamb": lambda: fn.lamb(1e-2, weight_decay=0.01),
}
STEPS = 6


def _leaves(tree):
    return [x for x in fn.tree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _train(opt, model, rank, steps):
    grads, history = [], []
    for t in range(steps):
        opt.zero_grad()
        backward(model, rank, t)
        grads.append(flat_grads(model))
        opt.step()
        history.append(flat_params(model))
    return grads, history


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_adapter_donates_and_equals_the_pure_loop(name, flatten):
    model = make_model()
    start = flat_params(model)
    opt = fn.optim.FunctionalOptimizer(
        model.parameters(), TRANSFORMS[name](), comm=Local(), flatten=flatten
    )
    runtime = opt._groups[0]
    initial = {id(x) for x in _leaves(runtime.state) if x.numel() > 1}
    grads, history = _train(opt, model, 0, 2)
    # update 2 wrote its state into the initial state's tensors (the spare)
    assert initial & {id(x) for x in _leaves(runtime.state)}
    more_grads, more_history = _train(opt, model, 0, STEPS - 2)
    to_tree = (lambda x: x) if flatten else unflatten_like(model)
    ref = run_functional(TRANSFORMS[name](), start, grads + more_grads, to_tree=to_tree)
    # fn.adamw's fast step is torch.optim.AdamW(fused=True)'s: the pure loop's params wherever
    # every step so far moved a param by less than half of it (see fn.update_and_apply)
    same, before = torch.ones_like(start, dtype=torch.bool), start
    for t, (got, want) in enumerate(zip(history + more_history, ref, strict=True)):
        if name == "adamw":
            same &= (want - before).abs() < before.abs() / 2
            got, want, before = got[same], want[same], want
        assert torch.equal(got, want), f"step {t + 1} differs from the pure functional loop"


def test_state_dict_is_never_written_by_later_steps():
    """The exported tensors (the frozen variance too) stay as they were, and so does a loaded
    checkpoint's state."""
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2, comm=Local())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the unsafe-variance warning
        _train(opt, model, 0, 3)
        saved = opt.state_dict()
        copies = [x.clone() for x in _leaves(saved)]
        _train(opt, model, 0, 4)
        assert all(torch.equal(a, b) for a, b in zip(copies, _leaves(saved), strict=True))
        loaded = {k: v for k, v in saved.items()}
        opt.load_state_dict(loaded)
        _train(opt, model, 0, 3)
        assert all(torch.equal(a, b) for a, b in zip(copies, _leaves(saved), strict=True))


def test_failed_step_after_donation_leaves_the_state_intact():
    model = make_model()
    opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.adam(1e-2), comm=Local())
    _train(opt, model, 0, 3)
    before = [x.clone() for x in _leaves(opt._groups[0].state)]
    params = flat_params(model)
    opt.zero_grad()
    backward(model, 0, 3)
    next(iter(model.parameters())).grad[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        opt.step()
    after = _leaves(opt._groups[0].state)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(flat_params(model), params)


def _minor_faults_of_steps(opt, steps):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        opt.step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


PAGES_OF_ONE_BUFFER = (1 << 22) * 4 // 4096


def test_adam_steady_state_allocates_no_full_size_tensor():
    """After 2 warm steps, 3 steps of FunctionalOptimizer(fn.adam) on a 2^22-element param
    fault in fewer pages than a quarter of one 2^22 fp32 buffer."""
    param = torch.nn.Parameter(torch.randn(1 << 22) * 0.02)
    param.grad = torch.randn(1 << 22) * 1e-3  # kept: backward would allocate a new one
    opt = fn.optim.FunctionalOptimizer([param], fn.adam(1e-3), comm=Local())
    _minor_faults_of_steps(opt, 2)
    faults = _minor_faults_of_steps(opt, 3)
    assert faults < PAGES_OF_ONE_BUFFER // 4, f"{faults} minor page faults in 3 steps"


ONEBIT = {
    "onebit_adam": lambda ps: fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=3, weight_decay=0.01),
    "zero_one_adam": lambda ps: fn.optim.ZeroOneAdam(
        ps, lr=1e-2, var_freeze_step=4, var_update_scaler=2, local_step_scaler=2
    ),
    "onebit_lamb": lambda ps: fn.optim.OnebitLamb(ps, lr=1e-2, freeze_step=3),
}
FACTORIES = {
    "onebit_adam": lambda comm: fn.onebit_adam(1e-2, 3, weight_decay=0.01, comm=comm),
    "zero_one_adam": lambda comm: fn.zero_one_adam(
        1e-2, var_freeze_step=4, var_update_scaler=2, local_step_scaler=2, comm=comm
    ),
    "onebit_lamb": lambda comm: fn.onebit_lamb(1e-2, 3, comm=comm),
}


def _onebit_family(rank, world_size):
    from fn.collectives import ProcessGroup

    warnings.simplefilter("ignore", RuntimeWarning)
    out = {}
    for name, make in ONEBIT.items():
        model = make_model()
        start = flat_params(model)
        opt = make(model.parameters())
        grads, history = _train(opt, model, rank, 8)
        to_tree = (lambda x: x) if opt.flatten else unflatten_like(model)
        ref = run_functional(FACTORIES[name](ProcessGroup()), start, grads, to_tree=to_tree)
        out[name] = [torch.equal(a, b) for a, b in zip(history, ref, strict=True)]
    return out


@pytest.mark.timeout(300)
def test_onebit_family_adapters_equal_the_pure_loop_on_two_ranks():
    """Warmup and compressed phases: the donating adapter gives the pure loop's params."""
    for rank, result in enumerate(run_distributed(_onebit_family, 2, timeout=280)):
        for name, same in result.items():
            assert all(same), f"{name} on rank {rank}: steps {same} equal to the pure loop"


FAULTY = {
    "adam": lambda ps, comm: fn.optim.FunctionalOptimizer(ps, fn.adam(1e-2), comm=comm),
    "sgd-unflattened": lambda ps, comm: fn.optim.FunctionalOptimizer(
        ps, fn.sgd(0.1, momentum=0.9), comm=comm, flatten=False
    ),
    "onebit_adam": lambda ps, comm: fn.optim.OnebitAdam(ps, lr=1e-2, freeze_step=2, comm=comm),
    "zero_one_adam": lambda ps, comm: fn.optim.ZeroOneAdam(
        ps, lr=1e-2, var_freeze_step=2, var_update_scaler=1, local_step_scaler=2, comm=comm
    ),
    "onebit_lamb": lambda ps, comm: fn.optim.OnebitLamb(ps, lr=1e-2, freeze_step=2, comm=comm),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the unsafe-variance warning
@pytest.mark.parametrize("name", list(FAULTY))
def test_a_step_failing_in_any_collective_changes_nothing(name):
    """On two (mirrored) ranks, every step is first run with its collective call k failing, for
    every k: state_dict() and the params stay as they were; the retried steps give the
    uninterrupted run's params; a state_dict taken earlier is never written; after
    load_state_dict the run goes on as the uninterrupted one."""
    comm = Mirror()
    model, reference = make_model(), make_model()

    def groups(m):  # a failure in the second group's update must not commit the first's
        ps = list(m.parameters())
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}]

    opt = FAULTY[name](groups(model), comm)
    ref_opt = FAULTY[name](groups(reference), Mirror())
    for t in range(6):
        for m in (model, reference):
            m.zero_grad()
            backward(m, 0, t)
        ref_opt.step()
        held = opt.state_dict()
        held_bits, params = bits(held), flat_params(model)
        for fail_at in range(1, 100):
            comm.calls, comm.fail_at = 0, fail_at
            try:
                opt.step()
                break  # fail_at is past the step's last collective call
            except ConnectionError:
                pass
            finally:
                comm.fail_at = None
            now = opt.state_dict()
            assert same_bits(now, held_bits), f"step {t}, call {fail_at}: state changed"
            assert [r["step"] for r in now["state"].values()] == [
                r["step"] for r in held["state"].values()
            ]
            assert torch.equal(flat_params(model), params), f"step {t}, call {fail_at}"
        assert torch.equal(flat_params(model), flat_params(reference)), f"step {t} differs"
        if t == 1:
            first_held, first_bits = held, held_bits
    assert same_bits(bits(first_held), first_bits), "an exported tensor was written"
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for t in range(6, 9):
        for m in (model, reference):
            m.zero_grad()
            backward(m, 0, t)
        opt.step()
        ref_opt.step()
        assert torch.equal(flat_params(model), flat_params(reference)), f"step {t} differs"


FUSED_ONEBIT_SETTINGS = {
    "decay": dict(weight_decay=0.01),
    "exact": dict(safeguard=False),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the unsafe-variance warning
@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("name", list(FUSED_ONEBIT_SETTINGS))
def test_onebit_adam_compressed_steps_add_to_the_params_in_place(name, flatten, monkeypatch):
    """On two (mirrored) ranks the adapter's compressed steps take fn.onebit_adam's fused step
    (fn.kernels.adam_apply on the params), with the pure functional loop's params."""
    calls = []
    original = fn.kernels.adam_apply
    monkeypatch.setattr(
        fn.kernels, "adam_apply", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    model = make_model()
    start = flat_params(model)
    opt = fn.optim.OnebitAdam(
        model.parameters(),
        lr=1e-2,
        freeze_step=3,
        comm=Mirror(),
        flatten=flatten,
        **FUSED_ONEBIT_SETTINGS[name],
    )
    grads, history = _train(opt, model, 0, STEPS)
    assert calls, "the compressed steps did not add to the params in place"
    to_tree = (lambda x: x) if flatten else unflatten_like(model)
    tx = fn.onebit_adam(1e-2, 3, comm=Mirror(), **FUSED_ONEBIT_SETTINGS[name])
    ref = run_functional(tx, start, grads, to_tree=to_tree)
    for t, (got, want) in enumerate(zip(history, ref, strict=True)):
        assert torch.equal(got, want), f"step {t + 1} differs from the pure functional loop"
