"""fn.fsdp.OnebitAdam.load_adam_state on 2 gloo ranks: started from torch.optim.AdamW's state
(m, v and the step carried over, the error feedback zero, one warning), its next update is the
freeze, past freeze_step too: it reports the frozen variance (an element of v at zero: the
warning) and logs that the compressed updates start, once; every rank ends with the same params;
what it refuses, with nothing changed."""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fn
import fn.fsdp
from tests._distributed import run_distributed

ADAM_STEPS, FREEZE = 3, 2  # the start is past freeze_step: the next update is the freeze


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _backward(model: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(10 * step + rank)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local().detach().clone()


def _worker(rank: int, world_size: int) -> dict:
    del world_size
    model = _model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(ADAM_STEPS):
        adamw.zero_grad()
        _backward(model, rank, step)
        adamw.step()
    names = [n for n, _ in model.named_parameters()]
    m = {n: adamw.state[p]["exp_avg"] for n, p in model.named_parameters()}
    v = {n: adamw.state[p]["exp_avg_sq"] for n, p in model.named_parameters()}

    def started(kind: type, count: int, exp_avg: dict, exp_avg_sq: dict, **options) -> tuple:
        """A new optimizer (on a copy of the model: one fn.fsdp optimizer per model) started
        from the moments, by param name; the optimizer and what it raised."""
        copy = _model()
        copy.load_state_dict(model.state_dict())
        opt = kind(copy, lr=1e-2, freeze_step=FREEZE, **options)
        by_param = [{p: d[n] for n, p in copy.named_parameters() if n in d}
                    for d in (exp_avg, exp_avg_sq)]  # fmt: skip
        try:
            opt.load_adam_state(count, *by_param)
        except (ValueError, NotImplementedError) as error:
            return opt, copy, f"{type(error).__name__}: {error}" if opt.count == 0 else "changed"
        return opt, copy, None

    first = names[0]
    cases = {
        "missing": (fn.fsdp.OnebitAdam, ADAM_STEPS, {n: m[n] for n in names[1:]}, v, {}),
        "shape": (fn.fsdp.OnebitAdam, ADAM_STEPS, {**m, first: m[first].to_local()[:, :1]}, v, {}),
        "negative v": (fn.fsdp.OnebitAdam, ADAM_STEPS, m, {**v, first: -v[first]}, {}),
        "count": (fn.fsdp.OnebitAdam, -1, m, v, {}),
        "lamb": (fn.fsdp.OnebitLamb, ADAM_STEPS, m, v, {}),
        "auto mask": (fn.fsdp.OnebitAdam, ADAM_STEPS, m, v, {"exp_avg_mask": "auto"}),
    }
    out: dict = {"refused": {}}
    for case, (kind, count, exp_avg, exp_avg_sq, options) in cases.items():
        out["refused"][case] = started(kind, count, exp_avg, exp_avg_sq, **options)[2]
    zeroed = v[first].to_local().clone()
    zeroed.view(-1)[0] = 0  # an element whose variance froze at zero: the safeguard's warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt, model, error = started(fn.fsdp.OnebitAdam, ADAM_STEPS, m, {**v, first: zeroed})
    assert error is None, error
    state = opt.state_dict()
    out["started"] = {
        "count": opt.count,
        "warnings": [str(w.message) for w in caught if "Adam's state" in str(w.message)],
        "signed": state["signed"].tolist(),
        "m": [torch.equal(_local(state["exp_avg"][n]), _local(m[n])) for n in names],
        "v": [torch.equal(_local(state["exp_avg_sq"][n]), _local(v[n])) for n in names[1:]],
        "errors": [
            bool(x.any()) for e in state["per_rank"][f"rank{rank}"].values() for x in e.values()
        ],
    }
    out["told"] = []  # by update: what was logged and warned about the freeze
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("fn")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    for step in range(ADAM_STEPS, ADAM_STEPS + 2):
        opt.zero_grad()
        _backward(model, rank, step)
        records.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        out["told"].append(([r for r in records if "froze" in r or "start" in r], warned))
    logger.removeHandler(handler)
    state = opt.state_dict()
    out["trained"] = {
        "count": opt.count,
        "signed": state["signed"].tolist(),
        "params": {k: p.full_tensor() for k, p in model.named_parameters()},
    }
    return out


def test_onebit_adam_starts_from_adamw_and_refuses_what_it_cannot_take():
    results = run_distributed(_worker, 2, timeout=240)
    for rank, result in enumerate(results):
        refused = result["refused"]
        assert refused["missing"].startswith("ValueError") and "no exp_avg" in refused["missing"]
        assert refused["shape"].startswith("ValueError") and "shard shape" in refused["shape"]
        assert (
            refused["negative v"].startswith("ValueError") and "negative" in refused["negative v"]
        )
        assert refused["count"].startswith("ValueError") and "count" in refused["count"]
        assert refused["lamb"].startswith("NotImplementedError: fn.fsdp.OnebitLamb")
        assert (
            refused["auto mask"].startswith("NotImplementedError")
            and "auto" in refused["auto mask"]
        )
        started = result["started"]
        assert started["count"] == ADAM_STEPS and all(started["m"]) and all(started["v"])
        assert started["signed"] == [0, 0] and started["errors"] == [False] * 4
        assert len(started["warnings"]) == 1 and "starts at zero" in started["warnings"][0]
        (logged, warned), (logged_after, warned_after) = result["told"]
        name = "onebit_adam_sharded"
        assert logged == [f"{name}: compressed updates start at update {ADAM_STEPS + 1}"], logged
        assert len(warned) == 1 and warned[0].startswith(f"{name}: the variance froze with "), (
            warned
        )
        assert " 0 of " not in warned[0] and " at zero" in warned[0], warned
        assert logged_after == [] and warned_after == [], (logged_after, warned_after)
        trained = result["trained"]
        assert trained["count"] == ADAM_STEPS + 2 and trained["signed"] == [1, 1], rank
        for name, value in trained["params"].items():
            assert bool(value.isfinite().all()), name
            assert torch.equal(value, results[0]["trained"]["params"][name]), (rank, name)
