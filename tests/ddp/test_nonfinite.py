"""fn.ddp's hooks with a NaN or an Inf on one rank: one policy in the dense warmup and in the
compressed phase (``nonfinite="raise"`` raises on every rank, ``"propagate"`` passes the bucket
on as non-finite on every rank), no error feedback kept from that iteration, and
``torch.amp.GradScaler`` in fp16 skipping the overflowing steps."""

# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
import pytest
import torch
import torch.distributed as dist

import fn
from tests._distributed import run_distributed
from tests.ddp.test_hooks import HOOKS, START, _Bucket
from tests.ddp.test_overlap import _leaves, _same_leaves, _setup, _steps
from tests.optim._problem import backward, batch, flat_params

pytestmark = pytest.mark.distributed

WARMUP, COMPRESSED = START - 1, START + 1  # the iterations that get a NaN on rank 0


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def _nan_worker(rank, world_size):
    """Rank 0's gradient of the first layer's weight (in DDP's last bucket, so the buckets
    before it are reduced first) turns NaN at a warmup and at a compressed iteration."""
    del world_size
    out = {}
    for name in ("onebit", "loco4"):
        for policy in ("raise", "propagate"):
            for bad in (WARMUP, COMPRESSED):
                for overlap in (True, False):
                    net, model, state, opt = _setup(name, overlap, nonfinite=policy)
                    _steps(net, opt, rank, range(bad))
                    errors, iters = _leaves(state), state.iter
                    handle = None
                    if rank == 0:
                        handle = model[0].weight.register_hook(
                            lambda g: torch.full_like(g, torch.nan)
                        )
                    opt.zero_grad()
                    try:
                        backward(net, rank, bad)
                        error = None
                    except Exception as err:  # noqa: BLE001
                        error = f"{type(err).__name__}: {err}"
                    if handle is not None:
                        handle.remove()
                    case = {
                        "error": error,
                        "grads": _grads(model) if error is None else None,
                        "iter": (iters, state.iter),
                        "errors_kept": _same_leaves(errors, _leaves(state)),
                        "had_errors": bool(errors),
                    }
                    # the next finite steps go on (DDP too) as in a run without the bad
                    # iteration, which counts as one where it propagated (a GradScaler skips
                    # that step) and as none where it raised
                    _steps(net, opt, rank, range(bad + 1, bad + 3))
                    ref_net, ref_model, ref_state, ref_opt = _setup(name, overlap)
                    _steps(ref_net, ref_opt, rank, range(bad))
                    if policy == "propagate":
                        ref_state.load_state_dict({**ref_state.state_dict(), "iter": bad + 1})
                    _steps(ref_net, ref_opt, rank, range(bad + 1, bad + 3))
                    case["next_params"] = flat_params(model)
                    case["next_equal"] = (
                        state.iter == ref_state.iter
                        and torch.equal(case["next_params"], flat_params(ref_model))
                        and _same_leaves(_leaves(state), _leaves(ref_state))
                    )
                    out[name, policy, bad, overlap] = case
    return out


@pytest.fixture(scope="module")
def nan_results():
    return run_distributed(_nan_worker, 2, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["onebit", "loco4"])
@pytest.mark.parametrize("bad", [WARMUP, COMPRESSED], ids=["warmup", "compressed"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "inside"])
def test_raise_raises_on_every_rank_and_keeps_the_state(nan_results, name, bad, overlap):
    for result in nan_results:
        case = result[name, "raise", bad, overlap]
        assert case["error"] is not None, case
        # DDP's RuntimeError naming it, from the bucket's future
        assert "NonFiniteError: fn.ddp: bucket" in case["error"], case["error"]
        assert case["iter"] == (bad, bad), case  # the failed iteration does not count
        assert case["errors_kept"], case
        assert case["had_errors"] == (bad == COMPRESSED)
        assert case["next_equal"], case  # DDP and the hook went on


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["onebit", "loco4"])
@pytest.mark.parametrize("bad", [WARMUP, COMPRESSED], ids=["warmup", "compressed"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "inside"])
def test_propagate_gives_nonfinite_grads_on_every_rank(nan_results, name, bad, overlap):
    cases = [result[name, "propagate", bad, overlap] for result in nan_results]
    for case in cases:
        assert case["error"] is None, case["error"]
        assert not bool(torch.isfinite(case["grads"]).all()), case
        assert case["iter"] == (bad, bad + 1), case  # the iteration counts
        assert case["errors_kept"], case
        assert case["next_equal"] and bool(torch.isfinite(case["next_params"]).all()), case
    # every rank holds the same gradients, NaN at the same places
    torch.testing.assert_close(cases[0]["grads"], cases[1]["grads"], equal_nan=True)
    assert torch.equal(cases[0]["next_params"], cases[1]["next_params"])


def _scaler_worker(rank, world_size):
    """fp16 autocast with GradScaler and the hooks' default policy: rank 0's gradient overflows
    (one Inf) at a warmup and at a compressed step; every rank skips those steps."""
    del world_size
    out = {}
    for name in ("onebit", "loco4"):
        net, model, state, opt = _setup(name, True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        scales, moved = [], []
        for t in range(START + 3):
            opt.zero_grad()
            handle = None
            if rank == 0 and t in (WARMUP, COMPRESSED):
                handle = model[2].bias.register_hook(
                    lambda g: g.index_fill(0, torch.tensor([0]), torch.inf)
                )
            x, y = batch(rank, t)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(net(x).float(), y)
            scaler.scale(loss).backward()
            if handle is not None:
                handle.remove()
            before = flat_params(model)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            moved.append(not torch.equal(before, flat_params(model)))
        out[name] = {
            "scales": scales,
            "moved": moved,
            "params": flat_params(model),
            "iter": state.iter,
        }
    return out


@pytest.mark.timeout(200)
def test_grad_scaler_skips_overflowing_steps_with_the_default_policy():
    results = run_distributed(_scaler_worker, 2, timeout=180)
    for name in ("onebit", "loco4"):
        for result in results:
            run = result[name]
            skipped = [t for t, m in enumerate(run["moved"]) if not m]
            assert skipped == [WARMUP, COMPRESSED], (name, run["moved"])
            # the scale halves at each overflow, and only there
            halvings = [sum(s <= t for s in skipped) for t in range(len(run["scales"]))]
            assert run["scales"] == [2.0**10 / 2**k for k in halvings], (name, run["scales"])
            assert run["iter"] == START + 3 and bool(torch.isfinite(run["params"]).all())
        assert torch.equal(results[0][name]["params"], results[1][name]["params"]), name


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["onebit", "loco4"])
def test_nonfinite_must_be_a_policy(name, one_rank_group):
    state_cls, _, kwargs = HOOKS[name]
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('propagate', 'raise'\)"):
        state_cls(nonfinite="skip", **kwargs)
    assert state_cls(**kwargs).nonfinite == "propagate"


@pytest.mark.parametrize("name", ["onebit", "loco4"])
@pytest.mark.parametrize("group", ["gloo", 0])
def test_a_process_group_that_is_no_group_is_a_type_error(name, group, one_rank_group):
    state_cls, _, kwargs = HOOKS[name]
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        state_cls(process_group=group, **kwargs)


@pytest.mark.parametrize("setting", [dict(bits=4.0), dict(bits=True), dict(group_size=64.0)])
def test_loco_quantization_settings_are_ints(setting, one_rank_group):
    with pytest.raises(ValueError, match="must be"):
        fn.ddp.LocoHookState(**setting)


@pytest.mark.parametrize("name", ["onebit", "loco4"])
def test_one_rank_applies_the_policy_in_both_phases(name, one_rank_group):
    """With one rank the compressing transforms pass the values on unchecked: the hook checks
    them itself, so both phases follow the policy there too."""
    state_cls, hook, kwargs = HOOKS[name]
    for policy in ("raise", "propagate"):
        state = state_cls(start_iter=1, overlap=False, nonfinite=policy, **kwargs)
        hook(state, _Bucket(0, [(6,)])).wait()  # dense
        hook(state, _Bucket(0, [(6,)])).wait()  # compressed
        kept = [x.clone() for x in fn.tree.tree_leaves(state.buckets[0][1])]
        nan_bucket = _Bucket(0, [(6,)])
        nan_bucket.buffer()[2] = torch.nan
        if policy == "raise":  # through the future: the hook itself never raises
            future = hook(state, nan_bucket)
            with pytest.raises(RuntimeError, match="NonFiniteError: fn.ddp: bucket 0 is non-fin"):
                future.wait()
        else:
            assert bool(hook(state, nan_bucket).wait().isnan().all())
        after = fn.tree.tree_leaves(state.buckets[0][1])
        assert all(torch.equal(a, b) for a, b in zip(after, kept, strict=True))
        assert state.iter == (2 if policy == "raise" else 3)
        dense = state_cls(start_iter=1, overlap=False, nonfinite=policy, **kwargs)
        nan_bucket.buffer()[2] = torch.nan
        result = hook(dense, nan_bucket)
        if policy == "raise":
            with pytest.raises(RuntimeError, match="NonFiniteError: fn.ddp: bucket 0 is non-fin"):
                result.wait()
        else:
            assert bool(result.wait()[2].isnan())
        assert dense.iter == (0 if policy == "raise" else 1)
