"""fn.fsdp.OnebitAdam and OnebitLamb after a failure, on 2 gloo ranks: a non-finite gradient, a
param without a gradient (on every rank or one), a second reduce-scatter before ``step()``, a
``step()`` without backward, a ``requires_grad`` or a setting changed after the optimizer was
built, a second param group, torch's state-dict API and bad arguments. Each is raised by
``step()`` (never inside FSDP2's backward) or refused, the same on every rank, with nothing
changed; the updates after it train, and the ranks agree."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint.state_dict as torch_state_dict
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._pytree import tree_leaves

import fn
import fn.fsdp
from tests._distributed import run_distributed, run_together

WORLD, FREEZE, STEPS = 2, 3, 7
OPTIMIZERS = {"adam": "OnebitAdam", "lamb": "OnebitLamb"}


class _ZeroGradient(torch.autograd.Function):
    """The identity whose gradient is +0: an explicit zero gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(grad)


class Net(nn.Module):
    """``block`` sharded on its own; ``head`` and ``bias`` in the root's group. ``bias`` is used
    or not (``"skip"``), or given a zero gradient (``"zero"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(5, 3)
        self.head = nn.Linear(3, 2)
        self.bias = nn.Parameter(torch.full((2,), 0.5))

    def forward(self, x: torch.Tensor, bias: str = "use") -> torch.Tensor:
        y = self.head(torch.tanh(self.block(x)))
        if bias == "use":
            return y + self.bias
        if bias == "zero":
            return y + _ZeroGradient.apply(self.bias) * 0.0
        return y


def build(kind: str, **options):
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = getattr(fn.fsdp, OPTIMIZERS[kind])(model, lr=1e-2, freeze_step=FREEZE, **options)
    return model, optimizer


def loss(model: nn.Module, rank: int, step: int, bias: str = "use", nan: bool = False):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 5, generator=g)
    if nan:
        x[0, 0] = float("nan")
    return model(x, bias).square().mean()


def full(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def state_of(optimizer) -> list[torch.Tensor]:
    leaves = tree_leaves(optimizer.state_dict())
    return [x.to_local().clone() if hasattr(x, "to_local") else x.clone() for x in leaves]


def same_state(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def uninterrupted(kind: str, rank: int, steps: range) -> torch.Tensor:
    """The params after a plain run of the updates ``steps`` (each a backward and a step)."""
    model, optimizer = build(kind)
    for t in steps:
        optimizer.zero_grad()
        loss(model, rank, t).backward()
        optimizer.step()
    return full(model)


def attempt(step) -> str:
    """``"ok"``, or the exception's type and message."""
    try:
        step()
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "ok"


# ----------------------------------------------------------------------------- the workers


def _worker_missing_gradients(rank: int, world_size: int, kind: str) -> dict:
    """``bias`` without a gradient on every rank (updates 1 and 4) and on one rank (2 and 5),
    in the warmup (updates 1-2) and compressed (4-5), against the same run in which it has an
    explicit zero gradient there."""
    del world_size
    skipped = {1: (0, 1), 2: (1,), 4: (0, 1), 5: (0,)}
    out = {}
    for mode in ("skip", "zero"):
        model, optimizer = build(kind)
        params = []
        for t in range(1, STEPS + 1):
            optimizer.zero_grad()
            loss(model, rank, t, mode if rank in skipped.get(t, ()) else "use").backward()
            optimizer.step()
            params.append(full(model))
        out[mode] = (torch.stack(params), optimizer.count)
    return out


def _worker_nonfinite(rank: int, world_size: int, kind: str) -> list:
    """A NaN in rank 1's gradient at update 2 (warmup) and 4 (compressed): ``step()`` raises on
    every rank with nothing changed; the batch is skipped and training goes on."""
    del world_size
    model, optimizer = build(kind)
    log, t = [], 0
    for attempt_index in range(STEPS + 2):
        bad = attempt_index in (2, 5) and rank == 1
        optimizer.zero_grad()
        loss(model, rank, attempt_index, nan=bad).backward()  # FSDP2's backward never raises
        before = full(model)
        outcome = attempt(optimizer.step)
        moved = not torch.equal(full(model), before)
        if outcome == "ok":
            t += 1
        log.append((outcome.split(":")[0], moved, optimizer.count == t, full(model)))
    return log


def _worker_second_reduce_scatter(rank: int, world_size: int, kind: str) -> list:
    """Two backwards before ``step()``, in the warmup and in the compressed phase: they
    accumulate into one update. A state dict taken between a backward and its ``step()`` is
    refused in both phases (the accumulated gradient is not part of a checkpoint), and the run
    goes on."""
    del world_size
    model, optimizer = build(kind)
    log = []
    for t in range(1, STEPS + 2):
        optimizer.zero_grad()
        loss(model, rank, t).backward()
        if t in (FREEZE - 1, FREEZE + 1):
            loss(model, rank, 50 + t).backward()
        if t in (1, FREEZE + 2):
            log.append(attempt(optimizer.state_dict).split(":")[0])
        before, count = full(model), optimizer.count
        outcome = attempt(optimizer.step)
        log.append((outcome, not torch.equal(full(model), before), optimizer.count - count))
    log.append(attempt(optimizer.state_dict).split(":")[0])
    return log + [full(model)]


def _worker_requires_grad_changed(rank: int, world_size: int, kind: str) -> list:
    """``head.weight`` frozen after the optimizer was built, in the compressed phase (a 1-D
    mesh: each rank accumulates its local gradient), on rank 1 alone (update ``FREEZE + 1``)
    and then on every rank: FSDP2 leaves it out of the reduce-scatter, which records the
    problem; ``step()`` raises it on every rank with nothing changed. Unfrozen again, training
    goes on."""
    del world_size
    model, optimizer = build(kind)
    log = []
    for t in range(1, STEPS + 1):
        frozen = (t == FREEZE + 1 and rank == 1) or t == FREEZE + 2
        model.head.weight.requires_grad_(not frozen)
        optimizer.zero_grad()
        loss(model, rank, t).backward()
        before, count = full(model), optimizer.count
        outcome = attempt(optimizer.step)
        log.append((outcome, torch.equal(full(model), before), optimizer.count - count))
    return log + [full(model)]


def _worker_settings_changed(rank: int, world_size: int, kind: str) -> dict:
    """A second param group is refused; ``weight_decay`` set in ``param_groups[0]`` on rank 1
    (update 2) and on every rank (update ``FREEZE + 1``), and an ``lr`` that differs on rank 0
    (update ``FREEZE + 3``), make ``step()`` raise on every rank with nothing changed; set back,
    training goes on."""
    del world_size
    model, optimizer = build(kind)
    added = attempt(lambda: optimizer.add_param_group({"params": [nn.Parameter(torch.ones(2))]}))
    log = []
    for t in range(1, STEPS + 1):
        changed = (t == 2 and rank == 1) or t == FREEZE + 1
        optimizer.param_groups[0]["weight_decay"] = 10.0 if changed else 0.0
        optimizer.param_groups[0]["lr"] = 2e-2 if (t == FREEZE + 3 and rank == 0) else 1e-2
        optimizer.zero_grad()
        loss(model, rank, t).backward()
        before, count = full(model), optimizer.count
        outcome = attempt(optimizer.step)
        log.append((outcome, torch.equal(full(model), before), optimizer.count - count))
    return {
        "added": added,
        "groups": len(optimizer.param_groups),
        "log": log,
        "params": full(model),
    }


def _worker_exception_inside_backward(rank: int, world_size: int, kind: str) -> list:
    """A user's hook raises inside a backward (on every rank): FSDP2 stops reduce-scattering
    for good, and every later ``step()`` says so, with nothing changed, instead of returning
    as if it had updated."""
    del world_size
    model, optimizer = build(kind)
    failing = [False]

    def hook(grad: torch.Tensor) -> None:
        if failing[0]:
            failing[0] = False
            raise RuntimeError("a user's hook")

    def on_forward(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(hook)

    model.block.register_forward_hook(on_forward)
    shards = optimizer.param_groups[0]["params"]  # FSDP2 left the model's params unsharded
    log = []
    for t in range(1, 5):
        optimizer.zero_grad()
        failing[0] = t == 2
        backward = attempt(lambda: loss(model, rank, t).backward())  # noqa: B023
        before, count = [p.full_tensor() for p in shards], optimizer.count
        outcome = attempt(optimizer.step)
        after = [p.full_tensor() for p in shards]
        unchanged = all(torch.equal(x, y) for x, y in zip(after, before, strict=True))
        log.append((backward.split(":")[0], outcome, unchanged, count))
    return log


def _worker_resume_after_a_failure(rank: int, world_size: int, kind: str, path: str) -> list:
    """A checkpoint saved right after a failed compressed update (its batch skipped) resumes
    bit for bit: the run that goes on and the run loaded from it make the same updates."""
    del world_size
    model, optimizer = build(kind)
    checkpoint = fn.fsdp.TrainingCheckpoint(model, optimizer)
    for t in range(1, FREEZE + 3):
        optimizer.zero_grad()
        loss(model, rank, t, nan=t == FREEZE + 2 and rank == 1).backward()
        outcome = attempt(optimizer.step)
    checkpoint.save(path)
    runs = []
    for resumed in (False, True):
        if resumed:
            model, optimizer = build(kind)
            fn.fsdp.TrainingCheckpoint(model, optimizer).load(path)
        for t in range(FREEZE + 3, STEPS + 2):
            optimizer.zero_grad()
            loss(model, rank, t).backward()
            optimizer.step()
        runs.append((optimizer.count, full(model)))
    return [outcome.split(":")[0], *runs]


def _worker_step_without_backward(rank: int, world_size: int, kind: str) -> dict:
    """``step()`` before any backward, and a second ``step()`` after one, in both phases: a
    no-op (params, state and ``count`` unchanged); the updates after them train normally."""
    del world_size
    model, optimizer = build(kind)
    out = {"noops": []}
    state, before = state_of(optimizer), full(model)
    optimizer.step()  # before any backward
    out["noops"].append((optimizer.count, same_state(state, state_of(optimizer)),
                         torch.equal(full(model), before)))  # fmt: skip
    for t in range(1, STEPS + 1):
        optimizer.zero_grad()
        loss(model, rank, t).backward()
        optimizer.step()
        if t in (1, FREEZE + 1):  # once in the warmup, once compressed
            state, before, count = state_of(optimizer), full(model), optimizer.count
            optimizer.step()
            out["noops"].append((optimizer.count - count, same_state(state, state_of(optimizer)),
                                 torch.equal(full(model), before)))  # fmt: skip
    out["count"], out["params"] = optimizer.count, full(model)
    out["reference"] = uninterrupted(kind, rank, range(1, STEPS + 1))
    return out


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.to_local().clone() for p in model.parameters()]


def _worker_torch_state_dict_api(rank: int, world_size: int, kind: str) -> dict:
    """torch's state-dict API (the four functions, with fn's own state dict, torch's form and
    a flattened one), before any update and in the compressed phase: refused, naming
    TrainingCheckpoint and read_onebit_state, with the optimizer's state, the params and the
    gradients unchanged; the updates after it equal an uninterrupted run's."""
    del world_size
    model, optimizer = build(kind)
    out = {"calls": []}
    options = torch_state_dict.StateDictOptions(flatten_optimizer_state_dict=True)
    forms = {
        "own": optimizer.state_dict,
        "torch": lambda: {"state": {}, "param_groups": [{"lr": 1e-2, "params": ["head.bias"]}]},
        "flat": lambda: {"param_groups.head.bias.lr": 1e-2},
    }

    def calls(form):
        return {
            "get_state_dict": lambda: torch_state_dict.get_state_dict(model, optimizer),
            "get_optimizer_state_dict": lambda: torch_state_dict.get_optimizer_state_dict(
                model, optimizer, options=options if form == "flat" else None
            ),
            "set_state_dict": lambda: torch_state_dict.set_state_dict(
                model,
                optimizer,
                model_state_dict=torch_state_dict.get_model_state_dict(model),
                optim_state_dict=forms[form](),
            ),
            "set_optimizer_state_dict": lambda: torch_state_dict.set_optimizer_state_dict(
                model, optimizer, forms[form]()
            ),
        }

    for t in range(STEPS + 1):
        if t in (0, FREEZE + 1):
            for form in forms:
                for name, call in calls(form).items():
                    state, before, grads = state_of(optimizer), full(model), _grads(model)
                    outcome = attempt(call)
                    unchanged = same_state(state, state_of(optimizer)) and all(
                        a is b or (a is not None and b is not None and torch.equal(a, b))
                        for a, b in zip(grads, _grads(model), strict=True)
                    )
                    params = torch.equal(full(model), before)
                    out["calls"].append((f"{name}({form})", outcome, unchanged, params))
        if t < STEPS:
            optimizer.zero_grad()
            loss(model, rank, t).backward()
            optimizer.step()
    out["params"], out["reference"] = full(model), uninterrupted(kind, rank, range(STEPS))
    return out


def _worker_bad_arguments(rank: int, world_size: int, kind: str) -> dict:
    del rank, world_size
    cls = getattr(fn.fsdp, OPTIMIZERS[kind])
    out = {}
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(model, mesh=mesh)
    cases = {
        "params": lambda: cls(model.parameters(), lr=1e-2),
        "betas": lambda: cls(model, lr=1e-2, betas=(0.9,)),
        "betas-str": lambda: cls(model, lr=1e-2, betas="0.9"),
        "lr": lambda: cls(model, lr="fast"),
        "lr-negative": lambda: cls(model, lr=-1.0),
        "eps": lambda: cls(model, lr=1e-2, eps=-1e-8),
        "error_dtype": lambda: cls(model, lr=1e-2, error_dtype=torch.int8),
    }
    for name, make in cases.items():
        out[name] = attempt(make)
    model.zero_grad()
    optimizer = cls(model, lr=1e-2, freeze_step=FREEZE)  # the refusals installed nothing
    loss(model, 0, 0).backward()
    optimizer.step()
    out["count"] = optimizer.count
    return out


def _worker_one_rank_refusals(rank: int, world_size: int) -> dict:
    """The refusals with one rank (no agreement across ranks)."""
    del rank
    model = fully_shard(nn.Linear(2, 1), mesh=init_device_mesh("cpu", (world_size,)))
    return {
        (kind, key): attempt(lambda: getattr(fn.fsdp, name)(model, lr=1e-2, **{key: value}))  # noqa: B023
        for kind, name in OPTIMIZERS.items()
        for key, value in (("eps", -1e-8), ("error_dtype", torch.int8))
    }


# ----------------------------------------------------------------------------- the tests

# Every worker builds its own model and leaves the process group usable, so one launch runs them
# all in turn; the hook that raises inside a backward goes last (FSDP2 stops for that model).
_WORKERS = {
    "missing_gradients": _worker_missing_gradients,
    "nonfinite": _worker_nonfinite,
    "second_reduce_scatter": _worker_second_reduce_scatter,
    "step_without_backward": _worker_step_without_backward,
    "torch_state_dict_api": _worker_torch_state_dict_api,
    "bad_arguments": _worker_bad_arguments,
    "resume_after_a_failure": _worker_resume_after_a_failure,
    "requires_grad_changed": _worker_requires_grad_changed,
    "settings_changed": _worker_settings_changed,
    "exception_inside_backward": _worker_exception_inside_backward,
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """``{(worker, kind): results by rank}`` of every worker above, for both optimizers."""
    parts = {}
    for name, worker in _WORKERS.items():
        for kind in sorted(OPTIMIZERS):
            args = (kind,)
            if name == "resume_after_a_failure":
                args += (str(tmp_path_factory.mktemp("ckpt") / "ckpt"),)
            parts[f"{name} {kind}"] = (worker, args)
    ran = run_together(parts, WORLD, timeout=600)
    return {tuple(key.split()): results for key, results in ran.items()}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_missing_gradient_counts_as_zero_in_both_phases(kind, outcomes):
    results = outcomes["missing_gradients", kind]
    for out in results:
        skipped, zero = out["skip"], out["zero"]
        assert skipped[1] == zero[1] == STEPS
        assert torch.equal(skipped[0], zero[0])  # bit for bit, after every update
    assert torch.equal(results[0]["skip"][0], results[1]["skip"][0])
    moved = results[0]["skip"][0].diff(dim=0).ne(0).any(dim=1)
    assert bool(moved.all())  # every update changed the params


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_nonfinite_gradient_is_raised_by_step_and_training_goes_on(kind, outcomes):
    results = outcomes["nonfinite", kind]
    for log in results:
        seen = [entry[0] for entry in log]
        assert [i for i, o in enumerate(seen) if o != "ok"] == [2, 5]
        assert {seen[2], seen[5]} == {"NonFiniteError"}
        for outcome, moved, count_right, _ in log:
            assert moved == (outcome == "ok") and count_right
    assert all(torch.equal(a[3], b[3]) for a, b in zip(*results, strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_backwards_accumulate_and_a_state_dict_between_them_is_refused(kind, outcomes):
    results = outcomes["second_reduce_scatter", kind]
    for result in results:
        assert result[0] == "RuntimeError" and result[FREEZE + 2] == "RuntimeError"
        assert result[-2] == "ok"  # after step()
        log = [entry for entry in result[:-1] if isinstance(entry, tuple)]
        assert log == [("ok", True, 1)] * (STEPS + 1), log
    assert torch.equal(results[0][-1], results[1][-1])


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_requires_grad_changed_in_the_compressed_phase_is_raised_on_every_rank(kind, outcomes):
    results = outcomes["requires_grad_changed", kind]
    failed = {FREEZE: 1, FREEZE + 1: None}  # the failing updates (0-based), and the rank
    for rank, result in enumerate(results):
        log = result[:-1]
        for i, (outcome, unchanged, counted) in enumerate(log):
            if i not in failed:
                assert (outcome, unchanged, counted) == ("ok", False, 1), (i, outcome)
                continue
            assert outcome.startswith("RuntimeError: "), (i, outcome)
            assert unchanged and counted == 0, i
            if failed[i] in (None, rank):  # the rank whose reduce-scatter found it
                assert "did a param's requires_grad change" in outcome, outcome
            else:
                assert "rank 1 found a problem before this update" in outcome, outcome
    assert torch.equal(results[0][-1], results[1][-1])


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_setting_changed_in_the_param_group_is_raised_on_every_rank(kind, outcomes):
    results = outcomes["settings_changed", kind]
    # the failing updates (0-based), and the rank that changed a setting (None: every rank, or lr)
    failed = {1: 1, FREEZE: None, FREEZE + 2: None}
    for rank, out in enumerate(results):
        assert out["added"].startswith("NotImplementedError: fn.fsdp."), out["added"]
        assert out["groups"] == 1
        for i, (outcome, unchanged, counted) in enumerate(out["log"]):
            if i not in failed:
                assert (outcome, unchanged, counted) == ("ok", False, 1), (i, outcome)
                continue
            assert outcome.startswith("ValueError: fn.fsdp."), (i, outcome)
            assert unchanged and counted == 0, i
            if i == FREEZE + 2:
                assert "the ranks' lr in param_groups[0] differ (rank 0: 0.02, rank 1: 0.01)" in (
                    outcome
                ), outcome
            elif failed[i] in (None, rank):
                assert "weight_decay=10.0 (built with 0.0)" in outcome, outcome
            else:
                assert "rank 1 found a problem before this update" in outcome, outcome
    assert torch.equal(results[0]["params"], results[1]["params"])


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_step_without_backward_is_a_noop(kind, outcomes):
    results = outcomes["step_without_backward", kind]
    for out in results:
        assert out["noops"] == [(0, True, True)] * 3
        assert out["count"] == STEPS
        assert torch.equal(out["params"], out["reference"])
    assert torch.equal(results[0]["params"], results[1]["params"])


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_torch_state_dict_api_is_refused_with_nothing_changed(kind, outcomes):
    results = outcomes["torch_state_dict_api", kind]
    for out in results:
        assert len(out["calls"]) == 2 * 3 * 4
        for name, outcome, unchanged, params_unchanged in out["calls"]:
            assert outcome.startswith(f"NotImplementedError: fn.fsdp.{OPTIMIZERS[kind]}: its "), (
                name,
                outcome,
            )
            assert "fn.fsdp.TrainingCheckpoint" in outcome, (name, outcome)
            assert "fn.fsdp.read_onebit_state" in outcome, (name, outcome)
            assert unchanged and params_unchanged, name
        assert torch.equal(out["params"], out["reference"])
    assert torch.equal(results[0]["params"], results[1]["params"])


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_bad_arguments_name_the_setting_on_every_rank(kind, outcomes):
    results = outcomes["bad_arguments", kind]
    assert results[0] == results[1]
    out = results[0]
    assert out["params"].startswith("TypeError") and "fully_shard" in out["params"]
    assert "model.parameters()" in out["params"]
    for name, setting in [("betas", "betas"), ("betas-str", "betas"), ("lr", "lr"),
                          ("lr-negative", "lr"), ("eps", "eps")]:  # fmt: skip
        assert out[name].split(":")[0] in ("ValueError", "TypeError"), out[name]
        assert setting in out[name].split(":", 1)[1], out[name]
    refused = f"ValueError: fn.fsdp.{OPTIMIZERS[kind]}: rank(s) [0, 1] refused the model or the "
    assert out["eps"] == f"{refused}settings: eps must be >= 0, got -1e-08"
    assert out["error_dtype"] == (
        f"{refused}settings: error_dtype must be one of torch.float32, torch.bfloat16, "
        "torch.float16, got torch.int8"
    )
    assert out["count"] == 1


@pytest.mark.distributed
def test_bad_arguments_on_one_rank_carry_one_prefix():
    (out,) = run_distributed(_worker_one_rank_refusals, 1, timeout=240)
    for kind, name in OPTIMIZERS.items():
        assert out[kind, "eps"] == f"ValueError: fn.fsdp.{name}: eps must be >= 0, got -1e-08"
        assert out[kind, "error_dtype"] == (
            f"ValueError: fn.fsdp.{name}: error_dtype must be one of torch.float32, "
            "torch.bfloat16, torch.float16, got torch.int8"
        )


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_after_an_exception_inside_backward_step_says_fsdp2_stopped(kind, outcomes):
    results = outcomes["exception_inside_backward", kind]
    for log in results:
        assert log[0] == ("ok", "ok", False, 0)
        assert log[1][0] == "RuntimeError"  # the user's hook, raised by backward
        for _, outcome, unchanged, count in log[1:]:
            assert outcome.startswith("RuntimeError") and "FSDP2 no longer" in outcome
            assert "TrainingCheckpoint.load" in outcome
            assert unchanged and count == 1


@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_checkpoint_saved_after_a_failure_resumes_bit_for_bit(kind, outcomes):
    results = outcomes["resume_after_a_failure", kind]
    for outcome, (count, params), (resumed_count, resumed) in results:
        assert outcome == "NonFiniteError"
        assert count == resumed_count == STEPS  # the failed update made none
        assert torch.equal(params, resumed)
    assert torch.equal(results[0][1][1], results[1][1][1])
