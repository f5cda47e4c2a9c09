"""fn.transforms.hyperparameters: a class's signature built from its factory's, and its
arguments bound to it."""

from __future__ import annotations

import inspect

import pytest
import torch

import fn
import fn.fsdp
import fn.optim
from fn.transforms.hyperparameters import bind_arguments, signature_with

KEYWORD = inspect.Parameter.KEYWORD_ONLY
POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD


def factory(lr=1e-3, betas=(0.9, 0.999), *, comm, mask=None):
    del lr, betas, comm, mask


def test_own_parameters_take_the_factory_s_places_and_the_rest_follow_their_kind():
    signature = signature_with(
        factory,
        "params",
        inspect.Parameter("extra", POSITIONAL, default=0),
        inspect.Parameter("comm", KEYWORD, default=None),
        inspect.Parameter("mask", POSITIONAL, default=1),
    )
    # mask in the factory's place, then the class's new one; comm stays keyword-only
    expected = "(params, lr=0.001, betas=(0.9, 0.999), mask=1, extra=0, *, comm=None)"
    assert str(signature) == expected
    assert str(signature_with(factory, "model", leave_out=("comm", "mask"))) == (
        "(model, lr=0.001, betas=(0.9, 0.999))"
    )


def test_bound_arguments_fill_defaults_and_bad_arguments_name_the_class():
    signature = signature_with(factory, "params", leave_out=("comm",))
    assert bind_arguments("C", signature, ([1], 0.5), {"mask": 2}) == {
        "params": [1],
        "lr": 0.5,
        "betas": (0.9, 0.999),
        "mask": 2,
    }
    with pytest.raises(TypeError, match="^C: .*'lrr'"):
        bind_arguments("C", signature, ([1],), {"lrr": 0.5})
    with pytest.raises(TypeError, match="^C: too many positional"):
        bind_arguments("C", signature, ([1], 1, 2, 3), {})


FSDP_FACES = {
    fn.fsdp.OnebitAdam: fn.onebit_adam,
    fn.fsdp.OnebitLamb: fn.onebit_lamb,
}


@pytest.mark.parametrize("face", FSDP_FACES, ids=lambda c: c.__name__)
def test_fsdp_optimizers_take_their_factory_s_hyperparameters(face):
    ours = inspect.signature(face).parameters
    theirs = inspect.signature(FSDP_FACES[face]).parameters
    assert list(ours)[0] == "model"
    assert "comm" not in ours and ours["nonfinite"].default == "raise"
    for name, parameter in theirs.items():
        if name not in ("comm", "exp_avg_mask", "non_freeze"):
            assert ours[name].default == parameter.default, name
            assert ours[name].kind is parameter.kind, name


def test_optim_adapters_take_positional_hyperparameters_in_the_factory_s_order():
    param = torch.nn.Parameter(torch.ones(3))
    opt = fn.optim.OnebitAdam([param], 0.5, 7, (0.8, 0.9), comm=fn.collectives.Local())
    group = opt.param_groups[0]
    assert (group["lr"], group["freeze_step"], group["betas"]) == (0.5, 7, (0.8, 0.9))
    with pytest.raises(TypeError, match=r"^fn\.optim\.OnebitLamb: .*'freeze'"):
        fn.optim.OnebitLamb([param], freeze=3)
