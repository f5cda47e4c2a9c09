"""``fn.optim.from_deepspeed``: DeepSpeed configs and optimizer checkpoints.

The reference is DeepSpeed 0.18.9 itself, run once by ``deepspeed_data/generate.py`` (its
docstring has the command): continuing from an imported checkpoint must give DeepSpeed's
uninterrupted trajectory with its error feedback zeroed at the checkpoint, on 2 gloo ranks, in
the warmup and the compressed phase of every optimizer.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch

import fn
from fn.collectives import Local, ProcessGroup
from tests._distributed import run_distributed

pytestmark = pytest.mark.filterwarnings("ignore:fn.optim.from_deepspeed")
DATA = Path(__file__).resolve().parent / "deepspeed_data"
REFERENCE = torch.load(DATA / "optimizers.pt", weights_only=True)
RUNS = REFERENCE["runs"]


def _run(name: str, k: int) -> dict:
    return next(r for r in RUNS if r["name"] == name and r["checkpoint_step"] == k)


def _continue(rank: int, run: dict, **options) -> float:
    """Imports the run's checkpoint, continues it on this rank, and returns the largest distance
    to DeepSpeed's params over the remaining updates."""
    params = [torch.nn.Parameter(p.clone()) for p in run["params_at_checkpoint"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fn.optim.from_deepspeed(
            params, run["config"], state_dict=run["state_dict"], comm=ProcessGroup(), **options
        )
    worst = 0.0
    for t in range(run["checkpoint_step"] + 1, run["steps"] + 1):
        for p, target, noise in zip(
            params, run["targets"][rank], run["noise"][t][rank], strict=True
        ):
            p.grad = (p.detach() - target) + noise  # generate.py's gradient
        opt.step()
        for p, theirs in zip(params, run["trajectory"][t - 1][rank], strict=True):
            worst = max(worst, (p.detach() - theirs).abs().max().item())
    return worst


def _worker(rank, world_size):
    assert world_size == REFERENCE["world_size"]
    out = {(r["name"], r["checkpoint_step"]): _continue(rank, r) for r in RUNS}
    # fn's default one-leaf compression of 1-bit Adam is another algorithm (another scale)
    out["flat"] = _continue(rank, _run("onebit_adam", 6), flatten=True)
    return out


@pytest.fixture(scope="module")
def distances():
    return run_distributed(_worker, REFERENCE["world_size"], timeout=300)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", [(r["name"], r["checkpoint_step"]) for r in RUNS], ids=str)
def test_import_continues_deepspeed_s_trajectory(distances, run):
    for rank_distances in distances:
        assert rank_distances[run] < 1e-6, run  # fp32 rounding (measured <= 4.8e-7)


@pytest.mark.timeout(360)
def test_per_param_mode_is_what_makes_it_deepspeed_s(distances):
    for rank_distances in distances:
        assert rank_distances["flat"] > 1e-3


def _params(run):
    return [torch.nn.Parameter(p.clone()) for p in run["params_at_checkpoint"]]


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_imported_state_is_deepspeed_s_without_its_init_step(name):
    run = RUNS[[r["name"] for r in RUNS].index(name) + 1]  # the compressed-phase checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fn.optim.from_deepspeed(
            _params(run), run["config"], state_dict=run["state_dict"], comm=Local()
        )
    ds = run["state_dict"]["state"]
    record = opt.state_dict()["state"][0]
    assert record["step"] == run["checkpoint_step"] == ds[0]["step"] - 1
    functional = record["functional"]
    for j in range(3):
        assert torch.equal(functional[f".exp_avg[{j}]"], ds[j]["exp_avg"])
        assert torch.equal(functional[f".exp_avg_sq[{j}]"], ds[j]["exp_avg_sq"])
    errors = [v for k, v in functional.items() if "_error" in k]
    assert errors and all(not e.any() for e in errors)
    if name == "onebit_lamb":
        for j in range(3):
            for key in ("lamb_coeff_freeze", "last_factor", "scaling_coeff"):
                assert functional[f".{key}[{j}]"].item() == pytest.approx(ds[j][key], rel=1e-7)
    if name == "zero_one_adam":
        assert functional[".local_interval"].item() == ds[0]["local_step_interval"]
        assert functional[".var_interval"].item() == ds[0]["var_interval"]
        assert bool(functional[".frozen"])


CONFIG = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 0.01, "freeze_step": 4}}}


def _build(config, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn.optim.from_deepspeed(
            [torch.nn.Parameter(torch.ones(2, 3))], config, comm=Local(), **kwargs
        )


@pytest.mark.parametrize(
    ("spelling", "cls"),
    [
        ("onebitadam", fn.optim.OnebitAdam),
        ("ZeroOneAdam", fn.optim.ZeroOneAdam),
        ("ONEBITLAMB", fn.optim.OnebitLamb),
    ],
)
def test_types_are_case_insensitive_with_deepspeed_s_defaults(spelling, cls):
    opt = _build({"type": spelling})
    assert type(opt) is cls
    group = opt.param_groups[0]
    assert group["lr"] == 1e-3 and group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8
    if cls is fn.optim.ZeroOneAdam:
        assert (group["var_freeze_step"], group["local_step_scaler"]) == (100000, 32678)
    else:
        assert group["freeze_step"] == 100000


def test_config_from_a_json_file_and_values_for_auto(tmp_path):
    path = tmp_path / "ds.json"
    config = copy.deepcopy(CONFIG)
    config["optimizer"]["params"]["lr"] = "auto"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'auto'.*values="):
        _build(path)
    opt = _build(str(path), values={"lr": 3e-4})
    assert opt.param_groups[0]["lr"] == 3e-4 and opt.param_groups[0]["freeze_step"] == 4


def test_ignored_keys_are_explained_in_one_warning():
    config = copy.deepcopy(CONFIG)
    config["optimizer"]["params"].update(cuda_aware=False, comm_backend_name="nccl")
    config.update(gradient_clipping=1.0, train_batch_size=32)
    with pytest.warns(UserWarning) as caught:
        fn.optim.from_deepspeed([torch.nn.Parameter(torch.ones(2))], config, comm=Local())
    assert len(caught) == 1
    message = str(caught[0].message)
    for key in ("cuda_aware", "comm_backend_name", "gradient_clipping", "train_batch_size"):
        assert key in message


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"optimizer": {"type": "Adam"}}, "not one of DeepSpeed's 1-bit"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"frezee_step": 3}}}, "unknown keys"),
        ({"optimizer": {"type": "OneBitAdam", "param": {}}}, "unknown keys"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"max_grad_norm": 1.0}}}, "clip_grad"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True}}}, "amsgrad"),
        ({"train_batch_size": 8}, "no optimizer block"),
        ({**CONFIG, "zero_optimization": {"stage": 2}}, "without ZeRO"),
    ],
)
def test_bad_configs_are_clear_errors(config, match):
    with pytest.raises(ValueError, match=match):
        _build(config)


def test_state_dict_of_another_optimizer_or_model_is_a_clear_error():
    lamb, adam = _run("onebit_lamb", 6), _run("onebit_adam", 6)
    with pytest.raises(ValueError, match="another optimizer type"):
        fn.optim.from_deepspeed(
            _params(adam), adam["config"], state_dict=lamb["state_dict"], comm=Local()
        )
    with pytest.raises(ValueError, match="shape"):
        params = [torch.nn.Parameter(torch.zeros(6, 4)), *_params(adam)[1:]]
        fn.optim.from_deepspeed(params, adam["config"], state_dict=adam["state_dict"], comm=Local())
    with pytest.raises(ValueError, match="2 params in the state dict|3 params in the state"):
        fn.optim.from_deepspeed(
            _params(adam)[:2], adam["config"], state_dict=adam["state_dict"], comm=Local()
        )
    with pytest.raises(NotImplementedError, match="FP16_Optimizer"):
        fn.optim.from_deepspeed(
            _params(adam), adam["config"], state_dict={"optimizer_state_dict": {}}, comm=Local()
        )
    zero_one = _run("zero_one_adam", 9)
    config = copy.deepcopy(zero_one["config"])
    config["optimizer"]["params"]["local_step_scaler"] = 5
    with pytest.raises(ValueError, match="local_step"):
        fn.optim.from_deepspeed(
            _params(zero_one), config, state_dict=zero_one["state_dict"], comm=Local()
        )
