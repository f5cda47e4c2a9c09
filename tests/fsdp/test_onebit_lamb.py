"""fn.fsdp.OnebitLamb on 2 gloo ranks: bit for bit against a loop-over-ranks reference of the rule
in docs/algorithms.md ("1-bit Adam and 1-bit LAMB on FSDP2"), written here, with a param that one
rank holds no element of; and its bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import fn
import fn.fsdp
from tests._distributed import run_distributed
from tests.fsdp import test_onebit
from tests.fsdp.test_onebit import (
    BETAS,
    EPS,
    LR,
    MASKS,
    RUNS,
    STEPS,
    WORLD,
    _refusal,
    batch,
    car,
    from_x,
    full_params,
    lr_at,
    masks_of,
    sqrt_rn,
    to_x,
)
from tests.fsdp.test_onebit import Net as AdamNet

FREEZE = 3  # updates 1 and 2 warm up (2 fixes the scaling), 3 is the freeze
MIN_COEFF, MAX_COEFF, COEFF_BETA = 0.01, 10.0, 0.9
FACTOR_MIN, FACTOR_MAX, THRESHOLD = 0.5, 4.0, 0.1


class Net(AdamNet):
    """The Adam test's model and a one-element ``gate`` in the root's group: rank 1 holds none
    of it (FSDP2 pads dim 0 to W rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gate


MODULES = [["block.weight", "block.bias"], ["head.weight", "head.bias", "scale", "gate"]]
ORDER = [k for names in MODULES for k in names]
# The optimizer's leaf order (its FSDP2 modules as named_modules lists them, the root's group
# first), in which the scaling's fp32 mean adds the leaves: another order may round otherwise.
LEAF_ORDER = [k for names in MODULES[::-1] for k in names]


def build(**kwargs: Any) -> nn.Module:
    """The Adam test's ``build`` of this ``Net``."""
    return test_onebit.build(net=Net, **kwargs)


def optimizer(
    model: nn.Module,
    weight_decay: float = 0.0,
    freeze_step: int = FREEZE,
    masked: bool = False,
    error_dtype: torch.dtype = torch.float32,
):
    return fn.fsdp.OnebitLamb(
        model,
        lr=LR,
        freeze_step=freeze_step,
        betas=BETAS,
        eps=EPS,
        weight_decay=weight_decay,
        exp_avg_mask=masks_of(model) if masked else None,
        error_dtype=error_dtype,
    )


# ----------------------------------------------------------------------------- the reference


def shards(x: torch.Tensor) -> list[torch.Tensor]:
    rows = -(-x.shape[0] // WORLD)
    return [x[j * rows : (j + 1) * rows] for j in range(WORLD)]


def norm(x: torch.Tensor) -> torch.Tensor:
    """The norm over the ranks: each shard's fp64 sum of squares, summed in rank order."""
    sums = torch.stack([s.double().square().sum() for s in shards(x)])
    return sums.sum(0).sqrt().float()


def trust(p_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    ratio = p_norm / u_norm if p_norm != 0 and u_norm != 0 else torch.tensor(1.0)
    return ratio.clamp(MIN_COEFF, MAX_COEFF)


class Reference:
    def __init__(
        self,
        params: dict[str, torch.Tensor],
        weight_decay: float,
        masked: bool = False,
        error_dtype: str = "float32",
    ) -> None:
        self.masks = MASKS if masked else {}
        self.error_dtype = getattr(torch, error_dtype)
        self.p = {k: v.clone() for k, v in params.items()}
        zeros = {k: torch.zeros_like(v) for k, v in params.items()}
        self.m, self.v, self.fresh = dict(zeros), dict(zeros), dict(zeros)
        self.r = {k: torch.tensor(0.0) for k in params}
        self.last = {k: torch.tensor(1.0) for k in params}
        self.s = {k: torch.tensor(1.0) for k in params}
        self.wd = weight_decay
        b1, b2 = BETAS
        self.bound = (1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2))
        self.errors = {}

    def step(self, t: int, grads: list[dict[str, torch.Tensor]]) -> None:
        b1, b2 = BETAS
        lr = torch.tensor(lr_at(t))
        if t < FREEZE:
            for k in ORDER:
                g = (grads[0][k] + grads[1][k]) / WORLD
                self.m[k] = b1 * self.m[k] + (1 - b1) * g
                self.v[k] = b2 * self.v[k] + ((1 - b2) * g) * g
                if t == FREEZE - 1:
                    self.fresh[k] = self.v[k]
                u = self.m[k] / (sqrt_rn(self.v[k]) + EPS)
                if self.wd > 0:
                    u = u + self.wd * self.p[k]
                ratio = trust(norm(self.p[k]), norm(u))
                if ratio != 1:
                    self.r[k] = COEFF_BETA * self.r[k] + (1 - COEFF_BETA) * ratio
                self.p[k] = self.p[k] + -(lr * ratio) * u
            if t == FREEZE - 1:  # the scaling, from the momenta the warmup leaves
                rms = {k: norm(self.m[k]) / self.m[k].numel() ** 0.5 for k in ORDER}
                mean = torch.stack([rms[k] for k in LEAF_ORDER]).mean()
                self.s = {k: mean / rms[k] if rms[k] > 0 else torch.tensor(1.0) for k in ORDER}
            return
        new = {}
        for names in MODULES:
            like = [self.p[k] for k in names]
            xs = [
                to_x([(b1 * self.m[k] + (1 - b1) * g[k]) * self.s[k] for k in names]) for g in grads
            ]
            if names[0] not in self.errors:
                dtype = self.error_dtype
                self.errors[names[0]] = (
                    [torch.zeros_like(xs[0], dtype=dtype) for _ in range(WORLD)],
                    [torch.zeros(xs[0].numel() // WORLD, dtype=dtype) for _ in range(WORLD)],
                )
            y = car(xs, *self.errors[names[0]])
            new.update(zip(names, from_x(y, like), strict=True))
        for k in ORDER:
            m = new[k] / self.s[k]
            if k in self.masks:
                m = m * self.masks[k]
            g_hat = (m - b1 * self.m[k]) / (1 - b1)
            self.fresh[k] = b2 * self.fresh[k] + ((1 - b2) * g_hat) * g_hat
            d = sqrt_rn(self.v[k]) + EPS
            u0 = (m / d).clamp(-self.bound, self.bound)
            u = u0 + self.wd * self.p[k] if self.wd > 0 else u0
            f = (d / (sqrt_rn(self.fresh[k]) + EPS)).amax()
            if self.wd > 0:
                u_norm = norm(u)
                q = (norm(u0) / u_norm).clamp(max=1.0) if u_norm != 0 else torch.tensor(1.0)
                f = f * q + (1 - q)
            f = f.clamp(max=FACTOR_MAX).clamp(min=FACTOR_MIN)
            f = torch.minimum(f, self.last[k] * (1 + THRESHOLD))
            f = torch.maximum(f, self.last[k] * (1 - THRESHOLD))
            self.last[k] = f
            self.m[k] = m
            self.p[k] = self.p[k] + -(lr * (self.r[k] * f)) * u


def local_grads(params: dict[str, torch.Tensor], rank: int, step: int) -> dict[str, torch.Tensor]:
    model = build(shard=False)
    model.load_state_dict(params)
    x, y = batch(rank, step)
    nn.functional.mse_loss(model(x), y).backward()
    return {k: p.grad for k, p in model.named_parameters()}


# ----------------------------------------------------------------------------- the workers


def _worker_train(
    rank: int, world_size: int, weight_decay: float, masked: bool, error_dtype: str
) -> dict:
    model = build()
    opt = optimizer(model, weight_decay, masked=masked, error_dtype=getattr(torch, error_dtype))
    reference = Reference(full_params(model), weight_decay, masked, error_dtype)
    history, mismatches = [], []
    for t in range(1, STEPS + 1):
        grads = [local_grads(reference.p, r, t) for r in range(world_size)]
        reference.step(t, grads)
        opt.param_groups[0]["lr"] = lr_at(t)
        opt.zero_grad()
        x, y = batch(rank, t)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        got = full_params(model)
        history.append(got)
        mismatches += [(t, k) for k in got if not torch.equal(got[k], reference.p[k])]
    return dict(
        history=history,
        mismatches=mismatches,
        moved=[not torch.equal(history[0][k], history[-1][k]) for k in history[0]],
        bytes=opt.bytes_sent,
        factors=[float(opt._state.last_factor[k]) for k in ORDER],
        leaf_order=list(opt._state.scaling_coeff),
    )


def _worker_bf16(rank: int, world_size: int) -> dict:
    model = build(policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = optimizer(model)
    start = full_params(model)
    for t in range(1, STEPS + 1):
        opt.zero_grad()
        x, y = batch(rank, t)
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
    return dict(start=start, params=full_params(model), count=opt.count)


def _worker_bad_input(rank: int, world_size: int) -> dict:
    out = {}
    coeff = 2.0 if rank == 0 else MIN_COEFF  # only rank 0 passes min_coeff > max_coeff = 1
    out["coeffs on rank 0"] = _refusal(
        lambda: fn.fsdp.OnebitLamb(build(), min_coeff=coeff, max_coeff=1.0)
    )
    out["factor differs"] = _refusal(lambda: fn.fsdp.OnebitLamb(build(), factor_max=3.0 + rank))

    def masked(model: nn.Module) -> fn.fsdp.OnebitLamb:  # rank 0: "auto", rank 1: by hand
        mask = "auto" if rank == 0 else masks_of(model)
        return fn.fsdp.OnebitLamb(model, exp_avg_mask=mask)

    out["auto mask on rank 0"] = _refusal(lambda: masked(build()))
    model = build()
    fn.fsdp.OnebitAdam(model)
    out["after adam"] = _refusal(lambda: fn.fsdp.OnebitLamb(model))
    return out


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def trained():
    runs = RUNS.items()
    return {name: run_distributed(_worker_train, WORLD, *run, timeout=240) for name, run in runs}


@pytest.mark.timeout(300)
def test_bit_for_bit_with_the_reference_and_ranks_agree(trained):
    for results in trained.values():
        for rank, result in enumerate(results):
            assert result["leaf_order"] == LEAF_ORDER
            assert result["mismatches"] == [], rank
            assert all(result["moved"])
            assert result["bytes"] > 0
            assert result["factors"] == results[0]["factors"]
            for t, params in enumerate(result["history"]):
                for k, value in params.items():
                    assert torch.equal(value, results[0]["history"][t][k]), (rank, t, k)
    # the factors moved off 1 (the compressed rule ran) and weight decay changes the result
    assert any(f != 1.0 for f in trained["plain"][0]["factors"])
    plain, wd_on = trained["plain"][0]["history"][-1], trained["weight decay"][0]["history"][-1]
    assert not torch.equal(plain["block.weight"], wd_on["block.weight"])
    masked = trained["masked"][0]["history"][-1]
    assert not torch.equal(plain["block.weight"], masked["block.weight"])


@pytest.mark.timeout(300)
def test_bf16_policy_keeps_fp32_masters_and_ranks_agree():
    results = run_distributed(_worker_bf16, WORLD, timeout=240)
    for result in results:
        assert result["count"] == STEPS
        for k, value in result["params"].items():
            assert value.dtype == torch.float32
            assert torch.equal(value, results[0]["params"][k]), k
            assert not torch.equal(value, result["start"][k]), k


@pytest.mark.timeout(300)
def test_bad_input_is_refused_on_every_rank():
    results = run_distributed(_worker_bad_input, WORLD, timeout=240)
    for out in results:
        kind, message = out["coeffs on rank 0"]
        assert kind == "ValueError"
        assert message == (  # on every rank, with rank 0's reason
            "fn.fsdp.OnebitLamb: rank(s) [0] refused the model or the settings: min_coeff (2.0) "
            "must be <= max_coeff (1.0)"
        ), message
        assert out["factor differs"][0] == "ValueError" and "different" in out["factor differs"][1]
        kind, message = out["auto mask on rank 0"]
        assert kind == "ValueError" and "different" in message, message
        assert out["after adam"][0] == "ValueError" and "already" in out["after adam"][1]
