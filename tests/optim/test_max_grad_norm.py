"""``max_grad_norm`` of fn.optim's 1-bit Adam and 1-bit LAMB on 2 gloo ranks (one launch):
a spike on one rank at a compressed update is clipped by one factor on every rank, bit for bit
the functional rule fed the clipped gradients (the warmup's: the averaged gradient clipped, as
``torch.nn.utils.clip_grad_norm_`` clips it), with and without ``fn.ddp.register``; a norm
that never clips changes no bit; ``clip_grad_norm_`` on ``.grad`` acts in the compressed phase;
bad values are refused on every rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fn
import fn.ddp
import fn.optim
from fn.collectives import ProcessGroup, Simulated, replicate, simulate
from tests._distributed import run_distributed
from tests.optim._problem import (
    batch,
    flat_grads,
    flat_params,
    make_model,
    run_functional,
    unflatten_like,
)

FREEZE, STEPS, CLIP = 3, 6, 0.3  # updates 1-2 warmup, 3-6 compressed
SPIKE = (1, 3)  # rank 1's gradient at update 4 is 1000 times larger
OPTIMIZERS = {
    "onebit_adam": (fn.optim.OnebitAdam, fn.onebit_adam, False),
    "onebit_lamb": (fn.optim.OnebitLamb, fn.onebit_lamb, True),
}


def _backward(net, rank, t):
    x, y = batch(rank, t)
    scale = 1000.0 if (rank, t) == SPIKE else 1.0
    (torch.nn.functional.mse_loss(net(x), y) * scale).backward()


def _run(rank, name, *, use_ddp=False, torch_clip=None, **options):
    """The params after every update and the ``.grad`` that ``step()`` read."""
    adapter = OPTIMIZERS[name][0]
    model = make_model()
    opt = adapter(model.parameters(), lr=1e-2, freeze_step=FREEZE, weight_decay=0.01, **options)
    net = model
    if use_ddp:
        net = DDP(model)
        fn.ddp.register(net, opt)
    history, grads = [], []
    for t in range(STEPS):
        opt.zero_grad()
        _backward(net, rank, t)
        if torch_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), torch_clip)
        grads.append(flat_grads(model))
        opt.step()
        history.append(flat_params(model))
    return {"history": history, "grads": grads, "start": flat_params(make_model())}


def _square(g):
    return float(g.double().square().sum())


def _factor(square_norm):
    return min(1.0, CLIP / (math.sqrt(square_norm) + 1e-6))


def _clipped(by_rank, rank):
    """Rank ``rank``'s gradient of each update as ``max_grad_norm=CLIP`` defines it: in the
    warmup the averaged gradient clipped by its norm, once compressed the local gradient
    clipped by sqrt(mean over ranks of the local squared norms); and the factors."""
    out, factors = [], []
    for t in range(STEPS):
        local = [grads[t] for grads in by_rank]
        if t + 1 < FREEZE:
            g = (local[0] + local[1]) / 2  # gloo's mean: the sum, then / 2
            factor = _factor(_square(g))
        else:
            g = local[rank]
            factor = _factor(sum(_square(x) for x in local) / len(local))
        out.append(g * factor)
        factors.append(factor)
    return out, factors


def _reference(name, model, start, grads):
    """The functional rule over the ranks (ProcessGroup) fed ``grads``, as the adapter's."""
    _, factory, per_param = OPTIMIZERS[name]
    tx = factory(lr=1e-2, freeze_step=FREEZE, weight_decay=0.01, comm=ProcessGroup())
    to_tree = unflatten_like(model) if per_param else (lambda x: x)
    return run_functional(tx, start, grads, to_tree=to_tree)


def _errors(rank):
    def error(f):
        try:
            f()
        except Exception as err:  # noqa: BLE001 (the test reads the type and message)
            return type(err).__name__, str(err)
        return None

    def build(value):
        return fn.optim.OnebitAdam(
            make_model().parameters(), freeze_step=FREEZE, max_grad_norm=value
        )

    out = {str(v): error(lambda v=v: build(v)) for v in (0, -1.0, math.inf, math.nan, True, "1")}
    out["zero_one_adam"] = error(
        lambda: fn.optim.ZeroOneAdam(make_model().parameters(), max_grad_norm=1.0)
    )
    out["ranks differ"] = error(lambda: build(1.0 + rank))
    # the setter: refused with the value kept; ranks that set different values: the next
    # step raises on every rank, nothing changed
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), freeze_step=FREEZE, max_grad_norm=1.0)

    def set_bad():
        opt.max_grad_norm = -2.0

    out["setter"] = (error(set_bad), opt.max_grad_norm)
    opt.max_grad_norm = 1.0 + rank
    before = flat_params(model)
    _backward(model, rank, 0)
    out["setter differs"] = error(opt.step)
    out["unchanged"] = torch.equal(before, flat_params(model))
    return out


def _worker(rank, world_size):
    del world_size
    out = {}
    for name in OPTIMIZERS:
        runs = {
            "none": _run(rank, name),
            "never clips": _run(rank, name, max_grad_norm=1e30),
            "never clips ddp": _run(rank, name, use_ddp=True, max_grad_norm=1e30),
            "clip": _run(rank, name, max_grad_norm=CLIP),
            "clip ddp": _run(rank, name, use_ddp=True, max_grad_norm=CLIP),
            "torch clip ddp": _run(rank, name, use_ddp=True, torch_clip=CLIP),
        }
        by_rank = [None, None]
        dist.all_gather_object(by_rank, runs["clip"]["grads"])
        clipped, factors = _clipped(by_rank, rank)
        start = runs["clip"]["start"]
        runs["reference"] = _reference(name, make_model(), start, clipped)
        # clip_grad_norm_ on .grad: the adapter takes the clipped .grad (averaged in the
        # warmup under DDP, local once compressed)
        runs["torch reference"] = _reference(
            name, make_model(), start, runs["torch clip ddp"]["grads"]
        )
        out[name] = {
            "runs": {k: v["history"] if isinstance(v, dict) else v for k, v in runs.items()},
            "clipped": clipped,
            "factors": factors,
            "local": by_rank,
        }
    out["errors"] = _errors(rank)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=150)


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_spike_is_clipped_by_one_factor_on_every_rank(results, name):
    per_rank = [r[name] for r in results]
    factors = per_rank[0]["factors"]
    assert factors[0] < 1 and factors[SPIKE[1]] < 0.01  # clipped in the warmup and at the spike
    for result in per_rank:
        runs = result["runs"]
        assert result["factors"] == factors
        assert _equal(runs["clip"], runs["reference"])  # bit for bit
        assert _equal(runs["clip ddp"], runs["clip"])
        assert _equal(runs["never clips"], runs["none"])
        assert _equal(runs["never clips ddp"], runs["none"])
        assert not torch.equal(runs["clip"][-1], runs["none"][-1])
    for run in ("clip", "clip ddp", "none"):  # the ranks' params are the same after every update
        assert _equal(per_rank[0]["runs"][run], per_rank[1]["runs"][run])


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_warmup_clips_as_clip_grad_norm_of_the_averaged_gradient(results, name):
    local = results[0][name]["local"]
    for t in range(FREEZE - 1):
        averaged = torch.nn.Parameter(torch.zeros_like(local[0][t]))
        averaged.grad = (local[0][t] + local[1][t]) / 2
        torch.nn.utils.clip_grad_norm_([averaged], CLIP)
        torch.testing.assert_close(results[0][name]["clipped"][t], averaged.grad, rtol=1e-6, atol=0)


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_clip_grad_norm_on_grad_acts_in_the_compressed_phase(results, name):
    for result in results:
        runs = result[name]["runs"]
        assert _equal(runs["torch clip ddp"], runs["torch reference"])
        assert not torch.equal(runs["torch clip ddp"][-1], runs["none"][-1])
        # each rank clipped its own local gradient at the spike: not max_grad_norm's factor
        assert not torch.equal(runs["torch clip ddp"][-1], runs["clip"][-1])


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_simulated_reference_agrees(results):
    """The rule over Simulated ranks fed every rank's clipped gradients (a loop-over-ranks
    reference; allclose: its 1-bit allreduce may round otherwise than gloo's)."""
    comm = Simulated(2)
    start = make_model()
    tx = fn.onebit_adam(lr=1e-2, freeze_step=FREEZE, weight_decay=0.01, comm=comm)
    p = replicate(flat_params(start), comm)
    state = replicate(tx.init(flat_params(start)), comm)
    update = simulate(tx.update, comm)
    for t in range(STEPS):
        g = torch.stack([r["onebit_adam"]["clipped"][t] for r in results])
        updates, state = update(g, state, p, step=t + 1)
        p = fn.apply_updates(p, updates)
        for rank, result in enumerate(results):
            got = result["onebit_adam"]["runs"]["clip"][t]
            torch.testing.assert_close(p[rank], got, atol=1e-6, rtol=0)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_bad_values_are_refused_on_every_rank(results):
    for result in results:
        errors = result["errors"]
        for value in ("0", "-1.0", "inf", "nan", "True", "1"):
            kind, message = errors[value]
            assert kind == "ValueError" and "max_grad_norm must be a positive, finite" in message
        kind, message = errors["zero_one_adam"]
        assert kind == "NotImplementedError" and "local steps" in message
        kind, message = errors["ranks differ"]
        assert kind == "ValueError" and "max_grad_norm: 1.0 on ranks [0]" in message
        (kind, message), kept = errors["setter"]
        assert kind == "ValueError" and kept == 1.0
        kind, message = errors["setter differs"]
        assert kind == "ValueError" and "out of sync" in message
        assert errors["unchanged"]
