"""Functional states through ``torch.save`` and ``torch.load`` with torch's default
``weights_only=True``: every class a public transform's state holds is registered as a safe
global by ``import fn``, and reachable at its module path."""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

import fn
import fn.diloco
from fn.base import CompressedOptimizer, GradientTransformation
from fn.collectives import (
    Local,
    cast_allreduce,
    dense_allreduce,
    loco_allreduce,
    onebit_allreduce,
    quantized_allreduce,
    topk_allreduce,
)
from tests._imports import missing_for_module

ROOT = Path(__file__).resolve().parent.parent
UPDATES = 3  # the 1-bit family below compresses from update 2 on (0/1 Adam: local steps at 3)


def _onebit_adam() -> CompressedOptimizer:
    return fn.onebit_adam(lr=1e-2, freeze_step=2, comm=Local())


def _onebit_lamb() -> CompressedOptimizer:
    return fn.onebit_lamb(lr=1e-2, freeze_step=2, comm=Local())


def _zero_one_adam() -> CompressedOptimizer:
    return fn.zero_one_adam(lr=1e-2, var_freeze_step=2, comm=Local())


# Every public factory of a transform or optimizer, with arguments that give it a full state.
FACTORIES: dict[str, Callable[[], GradientTransformation | CompressedOptimizer]] = {
    "adam": lambda: fn.adam(lr=1e-2, weight_decay=0.1),
    "adamw": lambda: fn.adamw(lr=1e-2),
    "add_decayed_weights": lambda: fn.add_decayed_weights(0.1),
    "chain": lambda: fn.chain(fn.trace(0.9), fn.scale_by_learning_rate(1e-2)),
    "identity": fn.identity,
    "lamb": lambda: fn.lamb(lr=1e-2, weight_decay=0.1),
    "masked": lambda: fn.masked(fn.adam(lr=1e-2), {"w": True, "b": False}),
    "onebit_adam": _onebit_adam,
    "onebit_adam_sharded": lambda: fn.transforms.onebit_adam_sharded(lr=1e-2, freeze_step=2),
    "onebit_lamb": _onebit_lamb,
    "onebit_lamb_sharded": lambda: fn.transforms.onebit_lamb_sharded(
        lr=1e-2, freeze_step=2, comm=Local()
    ),
    "scale_by_adam": fn.scale_by_adam,
    "scale_by_learning_rate": lambda: fn.scale_by_learning_rate(lambda count: 1e-2 / (1 + count)),
    "scale_by_trust_ratio": fn.scale_by_trust_ratio,
    "set_to_zero": fn.set_to_zero,
    "sgd": lambda: fn.sgd(lr=1e-2, momentum=0.9, nesterov=True),
    "staged": lambda: fn.staged(_onebit_adam()),
    "stateless": lambda: fn.stateless(lambda updates, params: updates),
    "stateless_with_tree_map": lambda: fn.stateless_with_tree_map(lambda g, p: 2 * g),
    "trace": lambda: fn.trace(0.9),
    "zero_one_adam": _zero_one_adam,
    "dense_allreduce": lambda: dense_allreduce(comm=Local()),
    "loco_allreduce": lambda: loco_allreduce(comm=Local(), error_dtype=torch.int8),
    "onebit_allreduce": lambda: onebit_allreduce(comm=Local()),
    "quantized_allreduce": lambda: quantized_allreduce(comm=Local()),
    "cast_allreduce": lambda: cast_allreduce(torch.bfloat16, comm=Local()),
    "topk_allreduce": lambda: topk_allreduce(4, 16, comm=Local(), decay=0.9),
    "compression": lambda: fn.diloco.compression("loco4", comm=Local()),
    "nesterov": lambda: fn.diloco.nesterov(fn.diloco.compression("onebit", comm=Local())),
    "sparseloco": lambda: fn.diloco.sparseloco(k=4, chunk_size=16, comm=Local()),
    # staged() of each compressed optimizer: its counter drives the schedule
    "staged(onebit_lamb)": lambda: fn.staged(_onebit_lamb()),
    "staged(zero_one_adam)": lambda: fn.staged(_zero_one_adam()),
    "loco_allreduce(fp32 errors)": lambda: loco_allreduce(comm=Local()),
    # the state that freeze_step="auto" and exp_avg_mask="auto" decide in (fn.transforms.AutoState)
    "onebit_adam(auto)": lambda: fn.onebit_adam(
        lr=1e-2, freeze_step=fn.AutoFreeze(1, 2), exp_avg_mask="auto", comm=Local()
    ),
}


def _public_factories() -> set[str]:
    """The names of the functions that fn's packages export and that return a transform."""
    returns = {GradientTransformation, CompressedOptimizer}
    returns |= {cls.__name__ for cls in returns}  # annotations under `from __future__ ...`
    packages = [fn] + [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(fn.__path__, "fn.", onerror=lambda name: None)
        if info.ispkg and info.name != "fn.app" and not missing_for_module(info.name)
    ]
    return {
        name
        for package in packages
        for name in getattr(package, "__all__", [])
        if inspect.isfunction(obj := getattr(package, name))
        and inspect.signature(obj).return_annotation in returns
    }


def _states(name: str) -> list[object]:
    """The init state of ``FACTORIES[name]`` and its state after each of ``UPDATES`` updates."""
    tx = FACTORIES[name]()
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(300, generator=gen), "b": torch.randn(3, generator=gen)}
    states = [tx.init(params)]
    for t in range(1, UPDATES + 1):
        grads = {k: 1 + torch.rand(p.shape, generator=gen) for k, p in params.items()}
        step = {"step": t} if isinstance(tx, CompressedOptimizer) else {}
        updates, state = tx.update(grads, states[-1], params, **step)
        params = fn.apply_updates(params, updates)
        states.append(state)
    return states


def _classes(tree: object) -> set[type]:
    """The classes of every node and leaf of ``tree``."""
    found = {type(tree)}
    if not pytree.tree_is_leaf(tree):
        for child in pytree.tree_flatten(tree, is_leaf=lambda x: x is not tree)[0]:
            found |= _classes(child)
    return found


def _round_trip(state: object, path: Path) -> object:
    torch.save(state, path)
    return torch.load(path)  # torch's default: weights_only=True


def _assert_equal(loaded: object, state: object) -> None:
    leaves, spec = pytree.tree_flatten(state)
    loaded_leaves, loaded_spec = pytree.tree_flatten(loaded)
    assert loaded_spec == spec
    for got, want in zip(loaded_leaves, leaves, strict=True):
        assert type(got) is type(want)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want)
        else:
            assert got == want


def test_the_table_names_every_public_factory():
    assert _public_factories() <= set(FACTORIES)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_classes_are_safe_globals(name):
    """Every class in any state is one torch.load allows: a builtin container or number, a
    tensor, or a class fn registered."""
    allowed = {tuple, list, dict, type(None), bool, int, float, torch.Tensor}
    allowed |= set(torch.serialization.get_safe_globals())
    found = set().union(*(_classes(state) for state in _states(name)))
    assert found - allowed == set()


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_states_load_with_weights_only(name, tmp_path):
    for t, state in enumerate(_states(name)):
        loaded = _round_trip(state, tmp_path / f"state{t}.pt")
        _assert_equal(loaded, state)


def test_registered_classes_are_reachable_at_their_module_path():
    """``torch.serialization.add_safe_globals([<module path>.<class>])``, as torch's error message
    suggests, names the class itself (no function of the same name hides its module)."""
    ours = [c for c in torch.serialization.get_safe_globals() if c.__module__.startswith("fn.")]
    assert fn.OnebitAdamState in ours and fn.collectives.ErrorFeedback in ours
    for cls in ours:
        parts = f"{cls.__module__}.{cls.__qualname__}".split(".")
        assert functools.reduce(getattr, parts[1:], fn) is cls


def test_a_fresh_process_loads_a_state_after_import_fn(tmp_path):
    path = tmp_path / "state.pt"
    torch.save(_states("staged")[-1], path)
    code = f"import torch, fn; print(type(torch.load({str(path)!r}).inner).__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OnebitAdamState"
