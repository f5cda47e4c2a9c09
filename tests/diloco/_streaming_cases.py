"""The streaming runs that tests/diloco compares with ``_reference.streaming_run``: a model of
four tensors, its inner steps, and the settings by name; the same on one process and on gloo
ranks."""

from __future__ import annotations

from typing import Any

import torch

import fn.diloco
from tests.diloco import _reference

# name -> (DiLoCo's keywords, inner steps); fragments=None: strided lists, [w0, w2], [b0, b1]
SPARSELOCO = {
    "outer": "sparseloco",
    "outer_options": {"lr": 0.9, "beta": 0.9},
    "compression_options": {"k": 2, "chunk_size": 4},
}
CASES: dict[str, tuple[dict[str, Any], int]] = {
    "P2 tau0": ({"sync_every": 4, "fragments": 2}, 10),
    "P2 tau1 mix": ({"sync_every": 4, "fragments": 2, "delay": 1, "mix": 0.5, **SPARSELOCO}, 10),
    "P3 tau1": ({"sync_every": 6, "fragments": 3, "delay": 1}, 14),
    "P4 tau0 mix": ({"sync_every": 4, "fragments": 4, "mix": 0.25}, 9),
    "P4 tau1 mix": ({"sync_every": 8, "fragments": 4, "delay": 1, "mix": 0.5}, 13),
    "lists tau1": ({"sync_every": 4, "fragments": None, "delay": 1}, 9),
}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def strided(m: torch.nn.Module) -> list[list[torch.Tensor]]:
    return [[m[0].weight, m[2].weight], [m[2].bias, m[0].bias]]


def inner_optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def inner_step(m: torch.nn.Module, inner: torch.optim.Optimizer, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    torch.nn.functional.mse_loss(m(x), y).backward()
    inner.step()
    inner.zero_grad()


def params(m: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def diloco(m: torch.nn.Module, inner: torch.optim.Optimizer, **kwargs: Any) -> fn.diloco.DiLoCo:
    if kwargs.get("fragments", 1) is None:
        kwargs = {**kwargs, "fragments": strided(m)}
    return fn.diloco.DiLoCo(m, inner, **kwargs)


def train(
    rank: int, kwargs: dict[str, Any], start: int, stop: int, state: tuple | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, fn.diloco.DiLoCo]:
    """A worker after inner steps ``start`` to ``stop - 1``, having loaded ``state`` (the model's,
    the inner optimizer's and DiLoCo's state dicts) first."""
    m = model()
    inner = inner_optimizer(m)
    d = diloco(m, inner, **kwargs)
    if state is not None:
        m.load_state_dict(state[0])
        inner.load_state_dict(state[1])
        d.load_state_dict(state[2])
    for step in range(start, stop):
        inner_step(m, inner, rank, step)
    return m, inner, d


def run(
    rank: int, kwargs: dict[str, Any], steps: int, group: Any = None
) -> list[list[torch.Tensor]]:
    """This rank's parameters after every inner step, under ``fn.diloco.DiLoCo`` over
    ``group``."""
    m = model()
    inner = inner_optimizer(m)
    d = diloco(m, inner, group=group, **kwargs)
    out = []
    for step in range(steps):
        inner_step(m, inner, rank, step)
        out.append(params(m))
    d.remove()
    return out


def reference(
    world_size: int, kwargs: dict[str, Any], steps: int
) -> list[list[list[torch.Tensor]]]:
    """Every worker's parameters after every inner step, from ``_reference.streaming_run``."""
    models = [model() for _ in range(world_size)]
    inners = [inner_optimizer(m) for m in models]
    # the tensors hold 12, 3, 6 and 2 values: runs balanced by count, or strided()
    fragments = {
        2: [[0], [1, 2, 3]],
        3: [[0], [1], [2, 3]],
        4: [[0], [1], [2], [3]],
        None: [[0, 2], [1, 3]],
    }[kwargs["fragments"]]
    if kwargs.get("outer") == "sparseloco":
        outer = _reference.sparseloco_outer(0.9, 0.9, 2, 4)
    else:
        outer = _reference.nesterov_outer(0.7, 0.9)
    workers = [list(m.parameters()) for m in models]
    return _reference.streaming_run(
        workers,
        lambda r, t: inner_step(models[r], inners[r], r, t),
        steps=steps,
        sync_every=kwargs["sync_every"],
        fragments=fragments,
        delay=kwargs.get("delay", 0),
        mix=kwargs.get("mix", 0.0),
        outer=outer,
    )
