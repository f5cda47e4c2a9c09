"""fn.ddp.onebit_hook and loco_hook: dense warmup, outputs equal to fn's collectives on the same
buckets, error feedback that telescopes, checkpoints, and a bucket rebuild."""

# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
import io
import logging

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fn
import fn.ddp
from fn.collectives import ProcessGroup, loco_allreduce, onebit_allreduce
from tests._distributed import run_distributed
from tests.optim._problem import backward, flat_params, make_model

START, STEPS = 2, 7
HOOKS = {
    "onebit": (fn.ddp.OnebitHookState, fn.ddp.onebit_hook, {}),
    "loco4": (fn.ddp.LocoHookState, fn.ddp.loco_hook, {"bits": 4, "group_size": 8}),
    "loco8": (fn.ddp.LocoHookState, fn.ddp.loco_hook, {"bits": 8, "group_size": 8}),
}


def _recording(hook, record):
    """``hook`` that also records each bucket's input and output."""

    def recorded(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        iteration, x = state.iter, bucket.buffer().clone()
        y = hook(state, bucket).wait().clone()
        record.append((iteration, bucket.index(), x, y))
        return _done(y)

    return recorded


def _done(y):
    future = torch.futures.Future()
    future.set_result(y)
    return future


def _train(rank, name, steps, state=None, model_state=None, opt_state=None, cap=1e-4):
    """AdamW on DDP with the hook; returns the records, the hook state, model and optimizer.

    ``cap``: DDP's ``bucket_cap_mb``: the default makes several buckets, which DDP rebuilds
    after the first iteration. ``None``: one bucket, which DDP keeps (``find_unused_parameters``
    turns the rebuild off), so a resumed run has the buckets it saved."""
    state_cls, hook, kwargs = HOOKS[name]
    model = make_model()
    if model_state is not None:
        model.load_state_dict(model_state)
    net = DDP(model, find_unused_parameters=True) if cap is None else DDP(model, bucket_cap_mb=cap)
    hook_state = state_cls(start_iter=START, **kwargs)
    if state is not None:
        hook_state.load_state_dict(state)
    record = []
    net.register_comm_hook(hook_state, _recording(hook, record))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    first = hook_state.iter
    for t in range(first, first + steps):
        opt.zero_grad()
        backward(net, rank, t)
        opt.step()
    return record, hook_state, model, opt


def _roundtrip(x):
    buffer = io.BytesIO()
    torch.save(x, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _hooks_worker(rank, world_size):
    comm = ProcessGroup()
    out = {}
    for name in HOOKS:
        record, state, model, opt = _train(rank, name, STEPS)
        buckets = sorted({index for _, index, _, _ in record})
        # the dense mean of every call, and fn's collective on the same inputs, one transform
        # state per bucket as the hook keeps them
        kwargs = HOOKS[name][2]
        tx = (
            onebit_allreduce(comm=comm) if name == "onebit" else loco_allreduce(comm=comm, **kwargs)
        )
        ref_states = {}
        dense, reference = [], []
        for iteration, index, x, _ in record:
            total = x.clone()
            dist.all_reduce(total)
            dense.append(total / world_size)
            if iteration < START:
                reference.append(dense[-1])
                continue
            ref_state = ref_states.get(index, tx.init(x))
            y, ref_states[index] = tx.update(x, ref_state)
            reference.append(y)
        compressed = [(r, d) for r, d in zip(record, dense, strict=True) if r[0] >= START]
        checks = {
            "iter": state.iter,
            "iterations": [r[0] for r in record],
            "buckets": buckets,
            "equal": [torch.equal(r[3], ref) for r, ref in zip(record, reference, strict=True)],
            "rel_error": [float((r[3] - d).norm() / d.norm()) for r, d in compressed],
        }
        if name == "onebit":
            # telescoping: sum_t y_t = sum_t mean_t - mean_i e_w,i - concat_r e_s,r (zero start)
            gaps = []
            for index in buckets:
                ys = [r[3] for r, _ in compressed if r[1] == index]
                means = [d for r, d in compressed if r[1] == index]
                worker, server = state.buckets[index][1]
                worker = comm.all_gather(worker).mean(0)
                server = comm.all_gather(server).reshape(-1)
                n = ys[0].numel()
                expected = sum(means) - worker[:n] - server[:n]
                gaps.append(float((sum(ys) - expected).abs().max() / sum(means).abs().max()))
            checks["telescoping_gap"] = max(gaps)
        # a checkpoint at step 4 resumes bit for bit (with the same buckets)
        _, _, model, _ = _train(rank, name, STEPS, cap=None)
        _, state4, model4, opt4 = _train(rank, name, 4, cap=None)
        saved = _roundtrip(
            {"hook": state4.state_dict(), "model": model4.state_dict(), "opt": opt4.state_dict()}
        )
        _, resumed_state, resumed, _ = _train(
            rank, name, STEPS - 4, saved["hook"], saved["model"], saved["opt"], cap=None
        )
        checks["resumed_iter"] = resumed_state.iter
        checks["resumed_equal"] = torch.equal(flat_params(resumed), flat_params(model))
        out[name] = checks
    return out


@pytest.mark.timeout(300)
def test_hooks_with_adamw_on_three_ranks():
    results = run_distributed(_hooks_worker, 3, timeout=280)
    for result in results:
        for name, checks in result.items():
            assert checks["iter"] == STEPS and len(checks["buckets"]) > 1, name
            assert sorted(set(checks["iterations"])) == list(range(STEPS))
            assert all(checks["equal"]), (name, checks["equal"])
            if name != "onebit":  # (1 bit per element: only the sum over steps is close)
                bound = {"loco4": 0.3, "loco8": 0.03}[name]
                assert max(checks["rel_error"]) < bound, (name, checks["rel_error"])
            assert checks["resumed_iter"] == STEPS and checks["resumed_equal"], name
        assert result["onebit"]["telescoping_gap"] < 1e-5
        assert max(result["loco8"]["rel_error"]) < max(result["loco4"]["rel_error"])


_PARAMS: dict[tuple, list[torch.Tensor]] = {}  # a bucket's params, the same objects each time


class _Bucket:
    """The part of ``dist.GradBucket`` the hooks use: the params of a bucket with the same
    index and shapes are the same tensors each time (DDP's), unless ``params`` are given."""

    def __init__(self, index, shapes, params=None):
        self._index = index
        key = (index, tuple(map(tuple, shapes)))
        self._params = params or _PARAMS.setdefault(key, [torch.zeros(s) for s in shapes])
        self._buffer = torch.randn(sum(p.numel() for p in self._params))

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def is_last(self):
        return True


def _sizes_worker(rank, world_size):
    """Rank 1's bucket 1 holds 300 elements where rank 0's holds 64 (bucket 0 matches)."""
    out = {}
    for overlap in (False, True):
        state = fn.ddp.LocoHookState(start_iter=0, bits=4, group_size=8, overlap=overlap)
        torch.manual_seed(rank)
        fn.ddp.loco_hook(state, _Bucket(0, [(8, 8)])).wait()
        before = _roundtrip(state.state_dict())  # a copy: state_dict() holds the live buffers
        bucket = _Bucket(1, [(8, 8)] if rank == 0 else [(300,)])
        buffer = bucket.buffer().clone()
        try:
            fn.ddp.loco_hook(state, bucket).wait()
            message = None
        except (ValueError, RuntimeError) as err:  # overlap: DDP's future wraps the ValueError
            message = str(err)
        after = state.state_dict()
        kept = after["iter"] == before["iter"] and list(after["buckets"]) == [0]
        pairs = zip(before["buckets"][0]["state"], after["buckets"][0]["state"], strict=True)
        kept = kept and all(torch.equal(a, b) for a, b in pairs)
        fn.ddp.loco_hook(state, _Bucket(0, [(8, 8)])).wait()  # the hook goes on
        out[overlap] = message, kept, torch.equal(bucket.buffer(), buffer), state.iter
    # built with other settings: refused on every rank (bits: gloo aborted the process at the
    # first compressed bucket; start_iter: one rank averaged densely while the other compressed)
    for cls, setting in (
        (fn.ddp.LocoHookState, {"bits": 4 if rank == 0 else 8}),
        (fn.ddp.OnebitHookState, {"start_iter": 10 * rank}),
    ):
        try:
            cls(**setting)
            out[cls.__name__] = None
        except ValueError as err:
            out[cls.__name__] = str(err)
    return out


@pytest.mark.timeout(200)
def test_loco_hook_buckets_of_different_sizes_or_settings_raise_on_every_rank():
    results = run_distributed(_sizes_worker, 2, timeout=180)
    expected = (
        "quantized allreduce: the ranks passed tensors of different sizes (rank 0: 64 elements, "
        "rank 1: 300 elements); every rank must pass the same number of elements. Nothing was "
        "changed."
    )
    for result in results:
        for overlap in (False, True):
            message, kept, untouched, iterations = result[overlap]
            assert message is not None and expected in message, (overlap, message)
            assert kept and untouched and iterations == 2, overlap
        for name, setting in (("LocoHookState", "bits"), ("OnebitHookState", "start_iter")):
            expected_refusal = (
                f"fn.ddp.{name}: the ranks passed different settings: {setting} (ranks 0 | 1)"
            )
            assert expected_refusal in (result[name] or ""), result[name]


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", list(HOOKS))
def test_bucket_rebuild_resets_error_feedback_with_a_log_line(name, one_rank_group, caplog):
    state_cls, hook, kwargs = HOOKS[name]
    state = state_cls(start_iter=0, **kwargs)
    hook(state, _Bucket(0, [(3, 4), (5,)]))
    before = state.buckets[0][1]
    with caplog.at_level(logging.WARNING, logger="fn.ddp"):
        hook(state, _Bucket(0, [(3, 4), (5,)]))  # same layout: kept, no log
        assert not caplog.records
        hook(state, _Bucket(0, [(2, 2)]))  # DDP rebuilt bucket 0 with other params
    assert "bucket 0 now holds 4 elements in 1 params (was 17 in 2" in caplog.text
    assert state.buckets[0][0] == ((2, 2),)
    assert tuple(x.shape for x in fn.tree.tree_leaves(state.buckets[0][1])) != tuple(
        x.shape for x in fn.tree.tree_leaves(before)
    )
    assert state.iter == 3


@pytest.mark.parametrize("name", list(HOOKS))
def test_a_bucket_rebuilt_with_its_params_in_another_order_resets_error_feedback(
    name, one_rank_group, caplog
):
    state_cls, hook, kwargs = HOOKS[name]
    first, second = torch.zeros(8), torch.zeros(8)
    state = state_cls(start_iter=0, **kwargs)
    hook(state, _Bucket(0, [(8,), (8,)], params=[first, second]))
    with caplog.at_level(logging.WARNING, logger="fn.ddp"):
        hook(state, _Bucket(0, [(8,), (8,)], params=[first, second]))  # kept, no log
        assert not caplog.records
        fresh = state_cls(start_iter=0, **kwargs)  # the same, from zero error
        fresh.load_state_dict({**_roundtrip(state.state_dict()), "buckets": {}})
        bucket = _Bucket(0, [(8,), (8,)], params=[second, first])  # the same shapes
        torch.manual_seed(1)  # (LoCo rounds stochastically)
        hook(state, bucket)
    assert "bucket 0 now holds 16 elements in 2 params (was 16 in 2" in caplog.text
    same = _Bucket(0, [(8,), (8,)], params=[second, first])
    same.buffer().copy_(bucket.buffer())
    torch.manual_seed(1)
    hook(fresh, same)
    kept, expected = (fn.tree.tree_leaves(x.buckets[0][1]) for x in (state, fresh))
    assert all(torch.equal(a, b) for a, b in zip(kept, expected, strict=True))


@pytest.mark.parametrize("name", list(HOOKS))
def test_state_dict_checks(name, one_rank_group):
    state_cls, hook, kwargs = HOOKS[name]
    state = state_cls(start_iter=1, **kwargs)
    for _ in range(3):
        hook(state, _Bucket(0, [(6,)]))
    saved = _roundtrip(state.state_dict())
    assert saved["iter"] == 3 and saved["rank"] == 0 and saved["world_size"] == 1
    fresh = state_cls(start_iter=1, **kwargs)
    fresh.load_state_dict(saved)
    assert fresh.iter == 3 and fresh.buckets[0][0] == ((6,),)
    restored, kept = (fn.tree.tree_leaves(s.buckets[0][1]) for s in (fresh, state))
    assert len(restored) == len(kept) > 0
    assert all(torch.equal(a, b) for a, b in zip(restored, kept, strict=True))
    with pytest.warns(UserWarning, match="saved by rank 1 of 2, this is rank 0 of 1"):
        fresh.load_state_dict({**saved, "rank": 1, "world_size": 2})
    assert fresh.iter == 3 and fresh.buckets == {}
    fresh.load_state_dict(saved)
    bad = {
        **saved,
        "iter": 5,
        "buckets": {0: {"layout": [[9]], "state": saved["buckets"][0]["state"]}},
    }
    with pytest.raises(ValueError, match="bucket 0's saved state has shapes"):
        fresh.load_state_dict(bad)
    assert fresh.iter == 3 and fresh.buckets[0][0] == ((6,),)  # unchanged
    leaves = saved["buckets"][0]["state"]
    floating = next(i for i, x in enumerate(leaves) if x.is_floating_point() and x.numel())
    for change, match in (
        (lambda x: x.fill_(torch.nan), "holds a NaN or an Inf"),
        (lambda x: x.double(), "shapes and dtypes"),
    ):
        changed = [change(x.clone()) if i == floating else x for i, x in enumerate(leaves)]
        bad = {**saved, "iter": 5, "buckets": {0: {**saved["buckets"][0], "state": changed}}}
        with pytest.raises(ValueError, match=match):
            fresh.load_state_dict(bad)
    for iteration in (-5, "7", 2.7, True):
        with pytest.raises(ValueError, match="iter must be an int >= 0"):
            fresh.load_state_dict({**saved, "iter": iteration})
    assert fresh.iter == 3 and all(  # unchanged
        torch.equal(a, b)
        for a, b in zip(fn.tree.tree_leaves(fresh.buckets[0][1]), kept, strict=True)
    )
    fresh.load_state_dict({**saved, "iter": torch.tensor(4)})
    assert fresh.iter == 4
    with pytest.raises(ValueError, match="start_iter must be an int >= 0"):
        state_cls(start_iter=-1, **kwargs)


def test_state_dict_saved_at_another_level_resets_error_feedback(one_rank_group):
    state = fn.ddp.OnebitHookState(start_iter=0)
    hook = fn.ddp.onebit_hook
    for _ in range(2):
        hook(state, _Bucket(0, [(6,)]))
    saved = _roundtrip(state.state_dict())
    assert saved["local_world_size"] is None
    other = fn.ddp.OnebitHookState(start_iter=0, local_world_size=1)
    with pytest.warns(
        UserWarning, match="rank 0 of 1, this is rank 0 of 1 with local_world_size 1"
    ):
        other.load_state_dict(saved)
    assert other.iter == 2 and other.buckets == {}
    hook(other, _Bucket(0, [(6,)]))
    assert _roundtrip(other.state_dict())["local_world_size"] == 1
    del saved["local_world_size"]  # a state saved before the level was recorded: flat
    fresh = fn.ddp.OnebitHookState(start_iter=0)
    fresh.load_state_dict(saved)
    assert fresh.buckets[0][0] == ((6,),)


def _hierarchical_hooks_worker(rank, world_size):
    """Both hooks at 2 ranks per node: each compressed bucket equals the hierarchical
    collective's transform on the same input, and the checkpoint records the level."""
    comm = ProcessGroup()
    out = {}
    for name, transform in (
        ("onebit", lambda: onebit_allreduce(comm=comm, local_world_size=2)),
        ("loco4", lambda: loco_allreduce(comm=comm, local_world_size=2, bits=4, group_size=8)),
    ):
        state_cls, hook, kwargs = HOOKS[name]
        model = make_model()
        net = DDP(model, find_unused_parameters=True)
        hook_state = state_cls(start_iter=START, local_world_size=2, **kwargs)
        record = []
        net.register_comm_hook(hook_state, _recording(hook, record))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for t in range(STEPS):
            opt.zero_grad()
            backward(net, rank, t)
            opt.step()
        tx, ref_states, equal = transform(), {}, []
        for iteration, index, x, y in record:
            if iteration < START:
                continue
            ref, ref_states[index] = tx.update(x, ref_states.get(index, tx.init(x)))
            equal.append(torch.equal(y, ref))
        out[name] = (equal, hook_state.state_dict()["local_world_size"])
    return out


@pytest.mark.timeout(300)
def test_hooks_at_two_ranks_per_node_on_four_ranks():
    results = run_distributed(_hierarchical_hooks_worker, 4, timeout=240)
    for result in results:
        for name, (equal, level) in result.items():
            assert equal and all(equal), name
            assert level == 2, name
