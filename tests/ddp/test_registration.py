"""fn.ddp.register on real gloo processes: a DDP run equals the same run without DDP, per step
kind of each 1-bit optimizer; DDP sends nothing in compressed steps; a NaN on one rank meets the
optimizer's own ``nonfinite`` policy in both phases, also written into one rank's ``.grad`` after
DDP averaged it; an invalid lr never raises inside the backward; misuse is an error."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fn
import fn.ddp
import fn.optim
from fn.collectives._traffic import all_gather_bytes, all_reduce_bytes
from tests._distributed import run_distributed, run_together
from tests.optim._problem import (
    backward,
    flat_params,
    kill_hidden_unit,
    make_model,
    states_equal,
)
from tests.optim.test_distributed import CHECKPOINTED
from tests.optim.test_hierarchical import ADAPTERS as HIERARCHICAL

# The optimizers of the adapter's distributed tests (weight decay on), with steps covering
# every step kind (``name: (make, steps)``):
# - onebit_adam: steps 1-3 warmup, 4-8 compressed;
# - zero_one_adam: variance steps 1, 2, 3, 5 (5 also zeroes the errors), a 1-bit step 4, then
#   frozen: synchronizations 6, 7, 9, 11 and local steps 8, 10, 12, 13, 14;
# - onebit_lamb: steps 1-3 warmup (3 copies the variance), 4 sets the scaling, 4-8 compressed;
# - the "auto" ones: the switch decided at the end of a warmup update (at the latest update 5),
#   which the hook must know before the next backward pass; 1-bit Adam's momentum masked where
#   the averaged gradient stayed 0 (the auto mask).
AUTO = fn.AutoFreeze(min_updates=2, max_updates=5, tolerance=0.05)
OPTIMIZERS = {
    **{
        name: (CHECKPOINTED[name], steps)
        for name, steps in (("onebit_adam", 8), ("zero_one_adam", 14), ("onebit_lamb", 8))
    },
    "onebit_adam auto": (
        lambda ps: fn.optim.OnebitAdam(
            ps, lr=1e-2, freeze_step=AUTO, exp_avg_mask="auto", weight_decay=0.01
        ),
        9,
    ),
    "onebit_lamb auto": (
        lambda ps: fn.optim.OnebitLamb(ps, lr=1e-2, freeze_step=AUTO, weight_decay=0.01),
        9,
    ),
}

# The first step's check that the ranks start in sync: one all_gather of 7 int64 (one group)
START_CHECK_BYTES = all_gather_bytes(7 * 8, 2)
# Without DDP, the first step's look for gradients averaged already (fn.optim._ddp_detection):
# one all_gather of 3 int64 (one group)
DETECTION_BYTES = all_gather_bytes(3 * 8, 2)
# fn's dense warmup traffic per step without DDP (66 fp32 params, 2 ranks): one allreduce per
# group, 1-bit LAMB one per param
WARMUP_BYTES = {
    "onebit_adam": all_reduce_bytes(66 * 4, 2),
    "zero_one_adam": all_reduce_bytes(66 * 4, 2),
    "onebit_lamb": sum(all_reduce_bytes(n * 4, 2) for n in (35, 7, 21, 3)),
}
WARMUP_BYTES.update({f"{name} auto": WARMUP_BYTES[name] for name in ("onebit_adam", "onebit_lamb")})


def _bytes_written() -> int:
    """What this process has written so far (sockets included: gloo's traffic), from the
    kernel's count, independent of fn's own byte counter."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


def _run(rank, name, use_ddp, bucket_cap_mb=None):
    """Params after each step, bytes written per step, and which steps were compressed."""
    make, steps = OPTIMIZERS[name]
    model = make_model()
    # the "auto" runs: hidden unit 0 dead, its gradients exactly 0, which the auto mask masks
    dead = kill_hidden_unit(model) if "auto" in name else {}
    opt = make(model.parameters())
    net = model
    if use_ddp:
        kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        net = DDP(model, **kwargs)
        fn.ddp.register(net, opt)
    history, sent, fn_sent, compressed = [], [], [], []
    for t in range(steps):
        compressed.append(opt.next_update_compressed()[0])
        dist.barrier()
        before = _bytes_written()
        opt.comm.reset_bytes_sent()
        opt.zero_grad()
        backward(net, rank, t)
        opt.step()
        sent.append(_bytes_written() - before)
        fn_sent.append(opt.comm.bytes_sent)
        history.append(flat_params(model))
    flat_mask = torch.cat([m.reshape(-1) for m in dead.values()]) if dead else None
    return {
        "history": history,
        "sent": sent,
        "fn_sent": fn_sent,
        "compressed": compressed,
        "dead": None if flat_mask is None else flat_mask == 0,
    }


def _parity_worker(rank, world_size, names):
    del world_size
    out = {}
    for name in names:
        out[name] = {
            "bare": _run(rank, name, False),
            "ddp": _run(rank, name, True),
            # tiny buckets: several per model, so that one backward makes several hook calls
            "buckets": _run(rank, name, True, bucket_cap_mb=1e-4),
        }
    return out


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, list]:
    """The 2-rank workers of this file, in one launch."""
    parts = {
        "parity": (_parity_worker, (list(OPTIMIZERS),)),
        "nan": (_nan_worker, ()),
        "bad_lr": (_bad_lr_worker, ()),
        "misuse": (_misuse_worker, ()),
    }
    return run_together(parts, 2, timeout=620)


@pytest.mark.timeout(700)
def test_register_equals_bare_fn_bitwise_and_ddp_is_silent_when_compressed(two_ranks):
    results = two_ranks["parity"]
    for name in OPTIMIZERS:
        for rank, result in enumerate(results):
            bare = result[name]["bare"]
            assert any(bare["compressed"]) and not all(bare["compressed"]), name
            for kind in ("ddp", "buckets"):
                run = result[name][kind]
                assert run["compressed"] == bare["compressed"]
                for t, (a, b) in enumerate(zip(run["history"], bare["history"], strict=True)):
                    assert torch.equal(a, b), (name, kind, rank, t)
                for t, compressed in enumerate(bare["compressed"]):
                    if compressed:  # the same collectives as without DDP: DDP adds nothing
                        ddp_bytes, bare_bytes = run["sent"][t], bare["sent"][t]
                        assert ddp_bytes <= 1.05 * bare_bytes + 64, (name, kind, t, run["sent"])
                        assert run["fn_sent"][t] == bare["fn_sent"][t]
                    else:  # DDP averaged: fn sends its 3-element gradient vote only
                        vote = all_reduce_bytes(24, 2) + (START_CHECK_BYTES if t == 0 else 0)
                        assert run["fn_sent"][t] == vote, (name, t)
                        detection = DETECTION_BYTES if t == 0 else 0
                        assert bare["fn_sent"][t] == vote + WARMUP_BYTES[name] + detection
        if name == "onebit_adam auto":  # the mask kept the dead unit at 0 in the 1-bit updates
            for result in results:
                run = result[name]["ddp"]
                assert int(run["dead"].sum()) == 9  # W1 row 0, b1[0], W2 column 0
                assert all(not p[run["dead"]].any() for p in run["history"])
        if name != "zero_one_adam":  # (0/1 Adam's ranks differ between synchronizations)
            last = [result[name]["ddp"]["history"][-1] for result in results]
            assert torch.equal(last[0], last[1]), name


def _three_ranks_worker(rank, world_size):
    del world_size
    return {"bare": _run(rank, "onebit_adam", False), "ddp": _run(rank, "onebit_adam", True)}


@pytest.mark.timeout(200)
def test_register_with_three_ranks_agrees_to_rounding():
    """With W = 3 the warmup means may sum in another order (DDP's buckets vs fn's flat
    gradient): equal to rounding, and the compressed steps add no DDP traffic."""
    results = run_distributed(_three_ranks_worker, 3, timeout=180)
    for result in results:
        bare, run = result["bare"], result["ddp"]
        for a, b in zip(run["history"], bare["history"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for t, compressed in enumerate(bare["compressed"]):
            if compressed:
                assert run["sent"][t] <= 1.05 * bare["sent"][t] + 64, (t, run["sent"])
    assert all(
        torch.equal(r["ddp"]["history"][-1], results[0]["ddp"]["history"][-1]) for r in results
    )


def _nan_worker(rank, world_size):
    """Rank 0's gradient of the first layer's weight turns NaN at a warmup and at a compressed
    update of 1-bit Adam (freeze_step 3), in the backward (the hook passes it on, the optimizer
    decides) or in its ``.grad`` after DDP averaged it (the ranks' vote finds it)."""
    del world_size
    out = {}
    for policy, bad, where in itertools.product(("raise", "skip"), (1, 4), ("backward", "after")):
        model = make_model()
        opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, nonfinite=policy)
        net = DDP(model)
        fn.ddp.register(net, opt)
        for t in range(bad + 2):
            opt.zero_grad()
            handle = None
            if t == bad and rank == 0 and where == "backward":
                handle = model[0].weight.register_hook(lambda g: torch.full_like(g, torch.nan))
            backward(net, rank, t)  # never raises: the hook decides nothing
            if handle is not None:
                handle.remove()
            if t == bad and rank == 0 and where == "after":
                model[0].weight.grad[0, 0] = torch.nan
            if t != bad:
                opt.step()
                continue
            compressed = opt.next_update_compressed()[0]
            before, params = opt.state_dict(), flat_params(model)
            error = _error(opt.step)
            kept = states_equal(before, opt.state_dict()) and torch.equal(
                params, flat_params(model)
            )
        out[policy, bad, where] = {
            "compressed": compressed,
            "error": error,
            "kept": kept,
            "skipped": opt.skipped_steps,
            "params": flat_params(model),
        }
    return out


def _bad_lr_worker(rank, world_size):
    """An invalid lr in ``param_groups`` at a warmup and at a compressed update of 1-bit Adam,
    on rank 0 (set back before ``step()``) and on every rank: the backward never raises (the
    hook follows the last update's schedule, the same on every rank), ``step()`` raises on
    every rank that holds it, and set back, training goes on."""
    del world_size
    out = {}
    for bad, where in itertools.product((1, 4), ("rank 0", "every rank")):
        model = make_model()
        opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)
        net = DDP(model)
        fn.ddp.register(net, opt)
        log = []
        for t in range(bad + 2):
            opt.zero_grad()
            if t == bad and (rank == 0 or where == "every rank"):
                opt.param_groups[0]["lr"] = -1.0
            log.append(_error(lambda t=t, net=net: backward(net, rank, t)))
            if where == "rank 0":
                opt.param_groups[0]["lr"] = 1e-2
            params = flat_params(model)
            log.append(_error(opt.step))
            log.append(torch.equal(params, flat_params(model)))
            opt.param_groups[0]["lr"] = 1e-2
        out[bad, where] = {"log": log, "params": flat_params(model)}
    return out


@pytest.mark.timeout(700)
def test_an_invalid_lr_never_raises_inside_the_backward(two_ranks):
    results = two_ranks["bad_lr"]
    for result in results:
        for (bad, where), out in result.items():
            log = out["log"]
            assert log[0::3] == [None] * (bad + 2), (bad, where, log)  # the backwards
            for t, (error, unchanged) in enumerate(zip(log[1::3], log[2::3], strict=True)):
                if t == bad and where == "every rank":
                    assert error[0] == "ValueError" and "lr" in error[1], error
                    assert unchanged
                else:
                    assert error is None and not unchanged, (bad, where, t, error)
    for key in results[0]:
        assert torch.equal(results[0][key]["params"], results[1][key]["params"]), key


@pytest.mark.timeout(700)
def test_a_nan_on_one_rank_meets_the_optimizers_policy_in_both_phases(two_ranks):
    results = two_ranks["nan"]
    for result in results:
        for bad, where in itertools.product((1, 4), ("backward", "after")):
            raised, skipped = result["raise", bad, where], result["skip", bad, where]
            assert raised["compressed"] == skipped["compressed"] == (bad == 4)
            assert raised["error"] is not None and raised["error"][0] == "NonFiniteError", raised
            assert skipped["error"] is None and skipped["skipped"] == 1, skipped
            assert raised["kept"] and skipped["kept"]
            assert bool(torch.isfinite(skipped["params"]).all())
    for key in results[0]:
        assert torch.equal(results[0][key]["params"], results[1][key]["params"]), key


class _Wrapper:
    """An optimizer wrapper as Accelerate's ``AcceleratedOptimizer``: the optimizer inside."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()


def _accumulate(rank, use_ddp, micro=2, steps=6):
    """1-bit Adam with ``micro`` backward passes per step (all but the last under ``no_sync``
    with DDP, the optimizer registered through a wrapper)."""
    model = make_model()
    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    net = model
    if use_ddp:
        net = DDP(model)
        opt = _Wrapper(opt)
        fn.ddp.register(net, opt)
    for t in range(steps):
        opt.zero_grad()
        for k in range(micro):
            if use_ddp and k < micro - 1:
                with net.no_sync():
                    backward(net, rank, micro * t + k)
            else:
                backward(net, rank, micro * t + k)
        opt.step()
    return flat_params(model)


def _mixed_phases(rank, use_ddp):
    """Two param groups in different phases at once (per-group freeze_step), one DDP bucket."""
    model = make_model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = fn.optim.OnebitAdam(
        [{"params": weights, "freeze_step": 2}, {"params": biases, "freeze_step": 5}], lr=1e-2
    )
    net = model
    if use_ddp:
        net = DDP(model)
        fn.ddp.register(net, opt)
    phases = []
    for t in range(7):
        phases.append(tuple(opt.next_update_compressed()))
        opt.zero_grad()
        backward(net, rank, t)
        opt.step()
    return flat_params(model), phases


def _error(f):
    try:
        f()
    except Exception as err:  # noqa: BLE001 (the test inspects the type and message)
        return type(err).__name__, str(err)
    return None


def _misuse_worker(rank, world_size):
    def adam(model, **kwargs):
        return fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, **kwargs)

    def twice():
        model = make_model()
        opt = adam(model)
        fn.ddp.register(DDP(model), opt)
        fn.ddp.register(DDP(model), opt)

    def same_model_twice():
        model = DDP(make_model())
        opt = adam(model.module)
        fn.ddp.register(model, opt)
        fn.ddp.register(model, opt)  # a no-op (e.g. a second Trainer.train())
        if len(model._comm_hooks) != 1:
            raise AssertionError(f"{len(model._comm_hooks)} comm hooks")

    def hooked_model():
        model = DDP(make_model())
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        fn.ddp.register(model, adam(model.module))

    def other_params():
        fn.ddp.register(DDP(make_model()), adam(make_model(seed=1)))

    def fewer_params():
        model = make_model()
        fn.ddp.register(DDP(model), fn.optim.OnebitAdam(model[0].parameters(), freeze_step=3))

    def local_comm():
        model = make_model()
        fn.ddp.register(DDP(model), adam(model, comm=fn.collectives.Local()))

    def staged_unfreeze():  # DDP built with model[0] frozen never averages its gradients
        model = make_model()
        model[0].requires_grad_(False)
        ddp = DDP(model)
        opt = fn.optim.OnebitAdam(model[2].parameters(), lr=1e-2, freeze_step=3)
        fn.ddp.register(ddp, opt)
        opt.add_param_group({"params": model[0].parameters()})  # frozen still: left out
        model[0].requires_grad_(True)
        try:
            opt.add_param_group({"params": model[0].parameters()})
        finally:
            if len(opt.param_groups) != 2:
                raise AssertionError(f"{len(opt.param_groups)} groups")

    errors = {
        "plain model": _error(lambda: fn.ddp.register(make_model(), adam(make_model()))),
        "torch optimizer": _error(
            lambda: fn.ddp.register(DDP(make_model()), torch.optim.AdamW(make_model().parameters()))
        ),
        "functional optimizer": _error(
            lambda: fn.ddp.register(
                DDP(make_model()),
                fn.optim.FunctionalOptimizer(make_model().parameters(), fn.adam(1e-3)),
            )
        ),
        "twice": _error(twice),
        "same model twice": _error(same_model_twice),
        "hooked model": _error(hooked_model),
        "other params": _error(other_params),
        "fewer params": _error(fewer_params),
        "local comm": _error(local_comm),
        "staged unfreeze": _error(staged_unfreeze),
    }
    return {
        "errors": errors,
        "accumulate": (_accumulate(rank, False), _accumulate(rank, True)),
        "mixed": (_mixed_phases(rank, False), _mixed_phases(rank, True)),
    }


@pytest.mark.timeout(700)
def test_misuse_accumulation_and_mixed_phases(two_ranks):
    results = two_ranks["misuse"]
    expected = {
        "plain model": ("TypeError", "must be a DistributedDataParallel"),
        "torch optimizer": ("TypeError", "got AdamW"),
        "functional optimizer": ("TypeError", "got FunctionalOptimizer"),
        "twice": ("RuntimeError", "registered with another DDP model already"),
        "hooked model": ("RuntimeError", "has a comm hook already"),
        "other params": ("ValueError", "4 of the optimizer's 4 params are not in the model"),
        "fewer params": (
            "ValueError",
            "0 of the optimizer's 2 params are not in the model, 2 of the model's 4",
        ),
        "local comm": ("ValueError", "world_size 1, DDP's process group 2"),
        "staged unfreeze": ("ValueError", "shapes [(7, 5), (7,)] are not among the params the DDP"),
    }
    for result in results:
        assert result["errors"]["same model twice"] is None, result["errors"]
        for case, (kind, message) in expected.items():
            got = result["errors"][case]
            assert got is not None and got[0] == kind and message in got[1], (case, got)
        bare, ddp = result["accumulate"]
        assert torch.equal(bare, ddp)
        (bare, bare_phases), (ddp, ddp_phases) = result["mixed"]
        assert (True, False) in bare_phases and bare_phases == ddp_phases
        assert torch.equal(bare, ddp)


def _hierarchical_worker(rank, world_size):
    """Each 1-bit adapter at 2 ranks per node, with and without DDP: the params after every
    step."""
    del world_size
    out = {}
    for name, (adapter, _) in HIERARCHICAL.items():
        runs = []
        for use_ddp in (False, True):
            model = make_model()
            opt = adapter(model.parameters(), local_world_size=2)
            net = model
            if use_ddp:
                net = DDP(model)
                fn.ddp.register(net, opt)
            history = []
            for t in range(9):
                opt.zero_grad()
                backward(net, rank, t)
                opt.step()
                history.append(flat_params(model))
            runs.append(history)
        out[name] = runs
    return out


@pytest.mark.timeout(300)
def test_register_follows_the_optimizer_s_local_world_size():
    """At 2 ranks per node on 4 ranks: the run with DDP equals the bare one to rounding (the
    warmup means of 4 ranks may sum in another order), and 1-bit Adam's and 1-bit LAMB's ranks
    agree bit for bit after every step."""
    results = run_distributed(_hierarchical_worker, 4, timeout=280)
    for name in HIERARCHICAL:
        for result in results:
            bare, ddp = result[name]
            for a, b in zip(ddp, bare, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if name == "zero_one_adam":  # its ranks differ between synchronizations by design
            continue
        for t in range(9):
            assert all(torch.equal(r[name][1][t], results[0][name][1][t]) for r in results), t
