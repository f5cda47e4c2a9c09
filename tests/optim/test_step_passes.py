"""What one ``step()`` does beyond the functional donated step it wraps: ``OnebitAdam`` makes no
non-finite gradient pass of its own (its updates reject non-finite gradients on every rank
before writing), and the last param group's update goes into its params
through ``fn.update_and_apply``; with several groups and non-finite gradients anywhere, nothing
changes."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local
from tests._mirror import Mirror, same_bits
from tests.optim._problem import backward, flat_params, make_model, run_functional, train


def _two_groups(model: torch.nn.Module) -> list[dict]:
    return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 3e-3}]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the unsafe-variance warning
@pytest.mark.parametrize("compressed", [False, True])
def test_onebit_adam_step_makes_no_gradient_pass_of_its_own(compressed, monkeypatch):
    """On two mirrored ranks, an OnebitAdam step gives the non-finite count no gradients to
    scan (FunctionalOptimizer(fn.adam) gives it all) and issues the collectives of the
    functional donated update of its one flat leaf plus the count's allreduce (and, at the
    first step, the check that the ranks start in sync), with its params."""
    counted = []

    def vote_on_gradients(comm, grads, *args, **kwargs):
        counted.append(len(grads))
        return real_count(comm, grads, *args, **kwargs)

    real_count = fn.optim._adapter.vote_on_gradients
    monkeypatch.setattr(fn.optim._adapter, "vote_on_gradients", vote_on_gradients)
    model = make_model()
    comm = Mirror()
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, comm=comm)
    tx = fn.onebit_adam(1e-2, 3, comm=comm)
    p = flat_params(model)
    state = tx.init(p)
    for t in range(4 if compressed else 1):
        opt.zero_grad()
        backward(model, 0, t)
        g = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
        comm.calls = 0
        opt.step()
        adapter_calls = comm.calls
        comm.calls = 0
        updates, state = tx.update(g, state, p, step=t + 1, donate=True)
        p = fn.apply_updates(p, updates, donate=True)
        # the first step compares the ranks and looks for gradients averaged before it (an
        # all_gather each)
        start_check = 2 if t == 0 else 0
        expected = comm.calls + 1 + start_check
        assert adapter_calls == expected, f"update {t + 1}: {adapter_calls}, {comm.calls}"
        assert torch.equal(flat_params(model), p), f"update {t + 1} differs"
    assert counted == [0] * len(counted)
    adam = fn.optim.FunctionalOptimizer(make_model().parameters(), fn.adam(1e-2), comm=comm)
    for q in adam.param_groups[0]["params"]:
        q.grad = torch.ones_like(q)
    adam.step()
    assert counted[-1] == 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("update", [2, 5])  # a warmup and a compressed update
@pytest.mark.parametrize("bad_group", [0, 1])
def test_onebit_adam_nonfinite_gradient_in_any_group_changes_nothing(
    bad_group, update, policy, flatten
):
    """Two groups on two mirrored ranks (the donated, fused compressed path): a NaN or Inf
    gradient in either group raises or skips, and leaves params, state and gradients bitwise
    as they were; the next steps equal an uninterrupted run's."""
    model, reference = make_model(), make_model()
    opt, ref_opt = (
        fn.optim.OnebitAdam(
            _two_groups(m),
            lr=1e-2,
            freeze_step=3,
            comm=Mirror(),
            nonfinite=policy,
            flatten=flatten,
        )
        for m in (model, reference)
    )
    for t in range(update - 1):
        train(model, opt, 0, range(t, t + 1))
        train(reference, ref_opt, 0, range(t, t + 1))
    for bad in (float("nan"), float("inf")):
        opt.zero_grad()
        backward(model, 0, 99)
        list(model.parameters())[2 * bad_group].grad[0, 0] = bad
        held = copy.deepcopy(opt.state_dict())
        params = flat_params(model)
        grads = [q.grad.clone() for q in model.parameters()]
        if policy == "raise":
            with pytest.raises(ValueError, match=f"param group {bad_group}.*non-finite"):
                opt.step()
        else:
            opt.step()
            assert opt.last_step_skipped
        assert same_bits(opt.state_dict(), held)
        assert torch.equal(flat_params(model), params)
        assert same_bits([q.grad for q in model.parameters()], grads)
    assert opt.skipped_steps == (2 if policy == "skip" else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        train(model, opt, 0, range(update - 1, update + 2))
        train(reference, ref_opt, 0, range(update - 1, update + 2))
    assert torch.equal(flat_params(model), flat_params(reference))


TRANSFORMS = {
    "adam": lambda lr: fn.adam(lr),
    "adamw": lambda lr: fn.adamw(lr, weight_decay=0.01),
    "sgd-momentum": lambda lr: fn.sgd(lr, momentum=0.9),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_groups_with_their_own_lr_equal_the_pure_loops(name):
    """The first group's update is added at the commit, the last one's in its update
    (fn.update_and_apply): both give the pure functional loop's params of their group."""
    model = make_model()
    start = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in model[::2]]
    opt = fn.optim.FunctionalOptimizer(
        _two_groups(model), TRANSFORMS[name], defaults=dict(lr=1e-2), comm=Local()
    )
    grads, history = train(model, opt, 0, range(6))
    cut = start[0].numel()
    for index, (lr, lo, hi) in enumerate(((1e-2, 0, cut), (3e-3, cut, None))):
        ref = run_functional(TRANSFORMS[name](lr), start[index], [g[lo:hi] for g in grads])
        for t, (got, want) in enumerate(zip(history, ref, strict=True)):
            assert torch.equal(got[lo:hi], want), f"group {index}, step {t + 1}"
