"""A small MLP regression problem shared by the transform tests."""

from __future__ import annotations

import torch


def make_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_data(steps: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(steps, 32, 6, generator=gen), torch.randn(steps, 32, 3, generator=gen)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def loss_fn(model, params, x, y):
    return torch.nn.functional.mse_loss(torch.func.functional_call(model, params, (x,)), y)


def grads_of(model, params, x, y):
    return torch.func.grad(lambda p: loss_fn(model, p, x, y))(params)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].detach().double()).abs().max().item() for k in a)
