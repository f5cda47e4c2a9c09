"""fn.ddp's hooks overlapped with the backward pass: the same results and error feedback as
inside the hook, a stalled rank raising a timeout instead of hanging, checkpoints, the order of
events, and the background thread (non-finite gradients: test_nonfinite.py)."""

# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
import gc
import multiprocessing
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fn
import fn.ddp
from fn.app.launch import WorkerError
from fn.collectives import CollectiveTimeoutError
from fn.ddp._worker import SerialWorker
from tests._distributed import run_distributed
from tests.ddp.test_hooks import HOOKS, START, STEPS
from tests.optim._problem import backward, flat_params, make_model

pytestmark = pytest.mark.distributed

LIMIT_S = 2.0


def _setup(name, overlap, cap=1e-4, **kwargs):
    """A DDP model (several buckets), its hook state and AdamW."""
    state_cls, hook, hook_kwargs = HOOKS[name]
    model = make_model()
    net = DDP(model, find_unused_parameters=True) if cap is None else DDP(model, bucket_cap_mb=cap)
    state = state_cls(start_iter=START, overlap=overlap, **hook_kwargs, **kwargs)
    net.register_comm_hook(state, hook)
    return net, model, state, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _leaves(state):
    return {i: fn.tree.tree_leaves(s) for i, (_, s) in state.buckets.items()}


def _same_leaves(a, b):
    return a.keys() == b.keys() and all(
        len(a[i]) == len(b[i]) and all(torch.equal(x, y) for x, y in zip(a[i], b[i], strict=True))
        for i in a
    )


def _steps(net, opt, rank, steps):
    history = []
    for t in steps:
        opt.zero_grad()
        backward(net, rank, t)
        opt.step()
        history.append(flat_params(net.module))
    return history


def _parity_worker(rank, world_size):
    del world_size
    out = {}
    for name in ("onebit", "loco4"):
        runs = {}
        for overlap in (True, False):
            net, _, state, opt = _setup(name, overlap)
            runs[overlap] = (_steps(net, opt, rank, range(STEPS)), _leaves(state), state.iter)
        (fast, fast_state, fast_iter), (slow, slow_state, slow_iter) = runs[True], runs[False]
        # a checkpoint of the overlapped state mid-training (taken while nothing waits for the
        # last bucket: state_dict waits for it) resumes bit for bit
        net, model, state, opt = _setup(name, True, cap=None)
        whole = _steps(net, opt, rank, range(STEPS))
        net, model, state, opt = _setup(name, True, cap=None)
        _steps(net, opt, rank, range(4))
        saved = {"hook": state.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}
        net, model, state, opt = _setup(name, True, cap=None)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["hook"])
        resumed = _steps(net, opt, rank, range(4, STEPS))
        out[name] = {
            "iters": (fast_iter, slow_iter),
            "buckets": len(fast_state),
            "params_equal": all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True)),
            "state_equal": _same_leaves(fast_state, slow_state),
            "resumed_equal": torch.equal(resumed[-1], whole[-1]) and state.iter == STEPS,
            "moved": not torch.equal(fast[START], fast[-1]),
        }
    return out


@pytest.mark.timeout(300)
def test_overlapped_hooks_equal_the_hooks_run_inside():
    for result in run_distributed(_parity_worker, 2, timeout=280):
        for name, checks in result.items():
            assert checks["iters"] == (STEPS, STEPS) and checks["buckets"] > 1, name
            assert checks["params_equal"] and checks["state_equal"] and checks["moved"], name
            assert checks["resumed_equal"], name


def _stall_worker(rank, world_size, folder):
    """Rank 1 stalls before its first compressed backward pass: rank 0's hook gives up."""
    del world_size
    net, _, state, opt = _setup("loco4", True, timeout=LIMIT_S)
    _steps(net, opt, rank, range(START))
    dist.barrier()
    if rank == 1:
        time.sleep(4 * LIMIT_S)
    start = time.monotonic()
    try:
        backward(net, rank, START)
        out = {"error": None}
    except Exception as err:  # noqa: BLE001
        out = {"error": f"{type(err).__name__}: {err}", "cause": type(err.__cause__).__name__}
    out["s"] = time.monotonic() - start
    torch.save(out, os.path.join(folder, f"{rank}.pt"))
    os._exit(0)  # gloo would wait for the abandoned collective until its own timeout


@pytest.mark.timeout(120)
def test_a_stalled_rank_raises_a_timeout_through_the_hook(tmp_path):
    with pytest.raises(WorkerError, match="exited without a result"):
        run_distributed(_stall_worker, 2, str(tmp_path), timeout=80)
    out = torch.load(tmp_path / "0.pt")
    assert out["error"] is not None and "rank(s) [1] never reached it" in out["error"], out
    assert CollectiveTimeoutError.__name__ in out["error"] + out["cause"], out
    # the limit, then (point-to-point transfers) its last half to find the ranks
    assert LIMIT_S <= out["s"] < 1.5 * LIMIT_S + 3, out


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [True, False])
def test_backward_goes_on_while_a_bucket_is_reduced(overlap, one_rank_group):
    """The reduction of DDP's first bucket (the last layer) waits until the first layer's
    gradient exists: overlapped, backward computes it meanwhile; inside the hook, only after."""
    net, model, state, opt = _setup("onebit", overlap)
    events, first_layer_done = [], threading.Event()
    update = state.transform.update

    def slow_update(updates, bucket_state):
        if "reduce bucket 0" not in events:
            events.append("reduce bucket 0")
            first_layer_done.wait(timeout=1.0)  # bounded: inside the hook it cannot happen
            events.append("bucket 0 reduced")
        return update(updates, bucket_state)

    def first_layer_grad(grad):
        events.append("first layer's gradient")
        first_layer_done.set()

    _steps(net, opt, 0, range(START))
    state.transform = state.transform._replace(update=slow_update)
    model[0].weight.register_hook(first_layer_grad)
    _steps(net, opt, 0, range(START, START + 1))
    assert len(events) == 3 and state.iter == START + 1
    # overlapped, the thread may start bucket 0 before or after that gradient, and finishes it
    # after; inside the hook, backward stops until the bucket is reduced
    gradient_first = events.index("first layer's gradient") < events.index("bucket 0 reduced")
    assert gradient_first == overlap, events


def test_serial_worker_order_errors_and_fork():
    worker = SerialWorker("fn-test-worker")
    done = []
    futures = [worker.submit(lambda i=i: done.append(i) or i) for i in range(5)]
    failing = worker.submit(lambda: 1 / 0)
    worker.drain()  # waits, without raising the error that belongs to its future
    assert done == list(range(5)) and [f.wait() for f in futures] == list(range(5))
    with pytest.raises(RuntimeError, match="ZeroDivisionError: division by zero"):
        failing.wait()
    # a forked child has no copy of the thread: the worker starts its own there
    _FORKED.append(worker)
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            assert pool.apply(_submit_in_child) == 42
    finally:
        _FORKED.clear()
    # the thread ends with its worker
    (thread,) = [t for t in threading.enumerate() if t.name.startswith("fn-test-worker")]
    del worker, futures, failing
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


_FORKED = []  # the worker a forked child inherits


def _submit_in_child():
    return _FORKED[0].submit(lambda: 42).wait()


def test_overlap_must_be_a_bool(one_rank_group):
    with pytest.raises(TypeError, match="overlap must be a bool"):
        fn.ddp.OnebitHookState(overlap="yes")
