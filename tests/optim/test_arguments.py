"""Malformed ``betas``, ``lr`` and ``eps`` in every fn.optim constructor (OnebitAdam, OnebitLamb,
ZeroOneAdam, FunctionalOptimizer with a factory), in ``add_param_group`` and in a group changed
between steps: a ValueError naming the setting, with nothing changed (the params' values and
storage, the groups, the state); on 2 gloo ranks every rank raises the same error and training
then goes on with the ranks identical."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

import fn
import fn.optim
from fn.collectives import Local
from tests._distributed import run_distributed
from tests.optim._problem import backward, flat_params, make_model, save_and_load, states_equal

NAN, INF = float("nan"), float("inf")

CONSTRUCTORS = {
    "OnebitAdam": lambda ps, comm, **kw: fn.optim.OnebitAdam(ps, comm=comm, freeze_step=3, **kw),
    "OnebitLamb": lambda ps, comm, **kw: fn.optim.OnebitLamb(ps, comm=comm, freeze_step=3, **kw),
    "ZeroOneAdam": lambda ps, comm, **kw: fn.optim.ZeroOneAdam(ps, comm=comm, **kw),
    "FunctionalOptimizer(fn.adamw)": lambda ps, comm, **kw: fn.optim.FunctionalOptimizer(
        ps, fn.adamw, comm, defaults=kw
    ),
    "FunctionalOptimizer(fn.lamb)": lambda ps, comm, **kw: fn.optim.FunctionalOptimizer(
        ps, fn.lamb, comm, defaults=kw, flatten=False
    ),
}
BAD = [("betas", v) for v in [(0.9,), (0.9, 0.99, 0.5), "ab", None, ("a", 0.9), (NAN, 0.9)]]
BAD += [("betas", (0.9, 1.0)), ("betas", 0.9)]
BAD += [(key, v) for key in ("lr", "eps") for v in ["0.1", None, NAN, -1e-3, INF, True]]


def _message(make, comm, key, value):
    """The ValueError's message of building an optimizer with ``key=value`` (``None``: built),
    and whether the params were left as they were (values and storage)."""
    model = make_model()
    before = [(p.detach().clone(), p.data_ptr()) for p in model.parameters()]
    message = None
    try:
        make(model.parameters(), comm, **{key: value})
    except ValueError as err:
        message = str(err)
    untouched = all(
        torch.equal(p.detach(), x) and p.data_ptr() == ptr
        for p, (x, ptr) in zip(model.parameters(), before, strict=True)
    )
    return message, untouched


def _names_the_setting(message, key):
    return message is not None and (f"{key} must be" in message or f"{key}[" in message)


@pytest.mark.parametrize("key, value", BAD, ids=repr)
@pytest.mark.parametrize("name", CONSTRUCTORS)
def test_constructor_names_the_malformed_setting_and_changes_nothing(name, key, value):
    message, untouched = _message(CONSTRUCTORS[name], Local(), key, value)
    assert _names_the_setting(message, key), message
    assert "unpack" not in message and "not supported between" not in message
    assert untouched


@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])
def test_error_dtype_is_refused_with_one_prefix(name):
    message, untouched = _message(CONSTRUCTORS[name], Local(), "error_dtype", torch.int8)
    factory = {"OnebitAdam": "onebit_adam", "OnebitLamb": "onebit_lamb"}.get(name, "zero_one_adam")
    assert message == (
        f"{factory}: error_dtype must be one of torch.float32, torch.bfloat16, torch.float16, "
        "got torch.int8"
    )
    assert untouched


def test_short_betas_no_longer_fail_to_unpack():
    model = make_model()
    with pytest.raises(ValueError, match=r"betas must be a pair \(b1, b2\).*got \(0\.9,\)"):
        fn.optim.OnebitAdam(model.parameters(), betas=(0.9,), comm=Local())


@pytest.mark.parametrize("key, value", [("betas", (0.9,)), ("eps", None), ("lr", "0.1")])
def test_add_param_group_with_a_malformed_setting_changes_nothing(key, value):
    model = make_model()
    first, second = list(model[0].parameters()), list(model[2].parameters())
    opt = fn.optim.OnebitAdam(first, lr=1e-2, freeze_step=3, comm=Local())
    for p in first:
        p.grad = torch.ones_like(p)
    opt.step()
    before = save_and_load(opt.state_dict())
    ptrs = [p.data_ptr() for p in second]
    with pytest.raises(ValueError, match=rf"\b{key}\b"):
        opt.add_param_group({"params": second, key: value})
    assert len(opt.param_groups) == 1 and len(opt.state_dict()["param_groups"]) == 1
    assert states_equal(before, opt.state_dict())
    assert [p.data_ptr() for p in second] == ptrs


def test_a_malformed_setting_written_into_a_group_fails_the_step_by_name():
    model = make_model()
    opt = fn.optim.OnebitLamb(model.parameters(), lr=1e-2, freeze_step=3, comm=Local())
    opt.zero_grad()
    backward(model, 0, 0)
    opt.step()
    params, state = flat_params(model), save_and_load(opt.state_dict())
    opt.param_groups[0]["betas"] = (0.9,)
    opt.zero_grad()
    backward(model, 0, 1)
    with pytest.raises(
        ValueError, match=r"param group 0 sets betas=\(0\.9,\).*betas must be a pair"
    ):
        opt.step()
    assert torch.equal(flat_params(model), params) and states_equal(state, opt.state_dict())
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    opt.step()  # the same gradients: the step now goes through
    assert not torch.equal(flat_params(model), params)


def _worker(rank, world_size):
    """Every bad setting of every constructor on both ranks (each must raise, none hang), then
    a few OnebitAdam updates."""
    del world_size
    comm = fn.collectives.ProcessGroup()
    messages = {
        (name, key, repr(value)): _message(make, comm, key, value)
        for name, make in CONSTRUCTORS.items()
        for key, value in BAD
    }
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    history = []
    for t in range(4):
        opt.zero_grad()
        backward(model, rank, t)
        opt.step()
        history.append(flat_params(model))
    return {"messages": messages, "history": history}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=150)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_bad_settings_raise_the_same_error_on_every_rank_and_training_goes_on(results):
    first, second = results
    assert first["messages"].keys() == second["messages"].keys()
    for case, (message, untouched) in first["messages"].items():
        assert _names_the_setting(message, case[1]), (case, message)
        assert untouched, case
        assert second["messages"][case] == (message, untouched), case
    for t, (a, b) in enumerate(zip(first["history"], second["history"], strict=True)):
        assert torch.equal(a, b), f"ranks differ after update {t + 1}"
    start = flat_params(make_model())
    moved = [start, *first["history"]]
    assert all(not torch.equal(x, y) for x, y in pairwise(moved))
