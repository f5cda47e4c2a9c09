"""The 1-bit adapters spell out their factories' hyperparameters: same names, order, defaults."""

from __future__ import annotations

import inspect

import pytest
import torch

import fn
import fn.optim

PAIRS = {
    "onebit_adam": (fn.optim.OnebitAdam, fn.onebit_adam),
    "zero_one_adam": (fn.optim.ZeroOneAdam, fn.zero_one_adam),
    "onebit_lamb": (fn.optim.OnebitLamb, fn.onebit_lamb),
}
# keyword-only in both: the factory takes the comm and a mask pytree; the adapter takes the comm,
# masks keyed by param, its non-finite policy and max_grad_norm
LEVEL = {"local_world_size", "error_dtype"}
FACTORY_KEYWORDS = {"comm", "exp_avg_mask", "non_freeze", "safeguard", *LEVEL}
ADAPTER_KEYWORDS = {
    "comm",
    "exp_avg_mask",
    "nonfinite",
    "check_every",
    "max_grad_norm",
    "safeguard",
    *LEVEL,
}


def _positional(signature: inspect.Signature) -> list[tuple[str, object]]:
    return [
        (p.name, p.default)
        for p in signature.parameters.values()
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]


def _keyword_only(signature: inspect.Signature) -> set[str]:
    kinds = inspect.Parameter.KEYWORD_ONLY
    return {p.name for p in signature.parameters.values() if p.kind is kinds}


@pytest.mark.parametrize("name", PAIRS)
def test_adapter_hyperparameters_are_the_factory_s(name):
    adapter, factory = PAIRS[name]
    ours, theirs = inspect.signature(adapter), inspect.signature(factory)
    hyper = _positional(ours)
    assert hyper[0][0] == "params"
    hyper = hyper[1:]
    if name == "onebit_adam":
        # DeepSpeed's per-group flag; the factory takes a pytree of per-leaf flags instead
        assert hyper[-1] == ("non_freeze", False)
        assert theirs.parameters["non_freeze"].default is None
        hyper = hyper[:-1]
    assert hyper == _positional(theirs)
    assert _keyword_only(theirs) <= FACTORY_KEYWORDS
    # the per-param mode of the elementwise rules (1-bit LAMB is always per param)
    per_param = {"flatten"} if name != "onebit_lamb" else set()
    assert _keyword_only(ours) == ADAPTER_KEYWORDS | per_param
    for kw in ("comm", "exp_avg_mask"):
        assert kw in _keyword_only(theirs)
    assert ours.parameters["exp_avg_mask"].default is theirs.parameters["exp_avg_mask"].default
    assert ours.parameters["safeguard"].default is theirs.parameters["safeguard"].default
    level = "local_world_size"
    assert ours.parameters[level].default is theirs.parameters[level].default is None
    assert ours.parameters["error_dtype"].default is theirs.parameters["error_dtype"].default


@pytest.mark.parametrize("name", PAIRS)
def test_adapter_defaults_reach_the_param_group(name):
    adapter, _ = PAIRS[name]
    opt = adapter([torch.nn.Parameter(torch.ones(3))], comm=fn.collectives.Local())
    hyper = dict(_positional(inspect.signature(adapter))[1:])
    assert {k: opt.param_groups[0][k] for k in hyper} == hyper
