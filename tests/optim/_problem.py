"""A small model, per-rank data and a functional reference run for the adapter tests."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import torch

import fn


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Linear(5, 7) - Tanh - Linear(7, 3): 66 params in 4 tensors."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    return model.to(dtype)


def kill_hidden_unit(model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
    """Zeroes hidden unit 0's weights of :func:`make_model`'s model (its gradients are then
    exactly 0 at every update); returns the 0/1 masks of those elements, by param."""
    with torch.no_grad():
        model[0].weight[0].zero_()
        model[0].bias[0].zero_()
        model[2].weight[:, 0].zero_()
    masks = {p: torch.ones_like(p) for p in model.parameters()}
    masks[model[0].weight][0] = 0
    masks[model[0].bias][0] = 0
    masks[model[2].weight][:, 0] = 0
    return masks


def batch(rank: int, t: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s data at update ``t`` (different on every rank and step)."""
    gen = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(8, 5, generator=gen).to(dtype), torch.randn(8, 3, generator=gen).to(dtype)


def backward(model: torch.nn.Module, rank: int, t: int) -> torch.Tensor:
    x, y = batch(rank, t, next(model.parameters()).dtype)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    steps: range,
    scheduler: Any = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Runs ``steps`` updates; returns the flat local grads and the flat params after each."""
    grads, history = [], []
    for t in steps:
        opt.zero_grad()
        backward(model, rank, t)
        grads.append(flat_grads(model))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        history.append(flat_params(model))
    return grads, history


def run_functional(
    tx: Any,
    params: Any,
    grads: list[Any],
    lrs: list[float] | None = None,
    to_tree: Callable[[torch.Tensor], Any] = lambda x: x,
) -> list[torch.Tensor]:
    """The functional loop the adapter must reproduce: ``lrs[t-1]`` set before update ``t``."""
    p = to_tree(params)
    state = tx.init(p)
    history = []
    for t, g in enumerate(grads, start=1):
        if lrs is not None:
            state = fn.set_hyperparams(state, lr=lrs[t - 1])
        updates, state = tx.update(to_tree(g), state, p, step=t)
        p = fn.apply_updates(p, updates)
        history.append(torch.cat([x.reshape(-1) for x in fn.tree.tree_leaves(p)]))
    return history


def unflatten_like(model: torch.nn.Module) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """Splits a flat tensor into per-param tensors of ``model``'s shapes."""
    shapes = [p.shape for p in model.parameters()]

    def split(flat: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], 0
        for s in shapes:
            n = s.numel()
            out.append(flat[offset : offset + n].view(s))
            offset += n
        return out

    return split


def states_equal(a: dict, b: dict) -> bool:
    """Bitwise equality of two optimizer state_dicts' functional states, steps and masters."""
    if a["state"].keys() != b["state"].keys():
        return False
    for k in a["state"]:
        ra, rb = a["state"][k], b["state"][k]
        if ra["step"] != rb["step"] or ra["functional"].keys() != rb["functional"].keys():
            return False
        for key, x in ra["functional"].items():
            y = rb["functional"][key]
            if (x is None) != (y is None) or x is not None and not torch.equal(x, y):
                return False
        if ("master" in ra) != ("master" in rb):
            return False
        if "master" in ra and not torch.equal(ra["master"], rb["master"]):
            return False
    return True


def save_and_load(obj: Any) -> Any:
    """``obj`` through ``torch.save`` and ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def interrupted_run(
    make_opt: Callable[..., torch.optim.Optimizer],
    rank: int,
    k: int,
    n: int,
    dtype: torch.dtype = torch.float32,
    optimizer_first: bool = False,
) -> dict[str, Any]:
    """An uninterrupted run of ``n`` updates, and a run stopped after ``k``, saved, loaded into a
    FRESH model (other init) and optimizer, and continued to ``n``."""
    model = make_model(dtype=dtype)
    opt = make_opt(model.parameters())
    train(model, opt, rank, range(n))
    full = (flat_params(model), opt.state_dict())

    model = make_model(dtype=dtype)
    opt = make_opt(model.parameters())
    train(model, opt, rank, range(k))
    ckpt = save_and_load({"model": model.state_dict(), "opt": opt.state_dict()})
    model = make_model(seed=7, dtype=dtype)
    opt = make_opt(model.parameters())
    if optimizer_first:
        opt.load_state_dict(ckpt["opt"])
        model.load_state_dict(ckpt["model"])
    else:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
    train(model, opt, rank, range(k, n))
    return {
        "same_params": torch.equal(full[0], flat_params(model)),
        "same_state": states_equal(full[1], opt.state_dict()),
        "checkpoint": ckpt["opt"],
    }
