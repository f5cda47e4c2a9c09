"""``fn.optim.from_deepspeed``: DeepSpeed configs and optimizer checkpoints.

The reference is DeepSpeed 0.18.9 itself, run once by ``deepspeed_data/generate.py`` (its
docstring has the command): on 2 and 4 gloo ranks, in the warmup and the compressed phase of
every optimizer (0/1 Adam also after a local step, where the ranks differ), every rank imports
its own checkpoint and must continue DeepSpeed's uninterrupted trajectory with its error
feedback zeroed at the checkpoint; every rank importing rank 0's checkpoint (what DeepSpeed's
engine saves) must too wherever the ranks' params and states agree.
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
WORLD_SIZES = sorted({r["world_size"] for r in RUNS})
# rank 0's checkpoint stands for every rank except after 0/1 Adam's local steps
SHARED = [r for r in RUNS if r["checkpoint_kind"] != "local"]
LOCAL = [r for r in RUNS if r["checkpoint_kind"] == "local"]


def _key(run: dict) -> str:
    return f"W{run['world_size']}-{run['name']}-{run['checkpoint_step']}-{run['checkpoint_kind']}"


def _run(name: str, k: int, world_size: int = 2) -> dict:
    return next(
        r
        for r in RUNS
        if r["name"] == name and r["checkpoint_step"] == k and r["world_size"] == world_size
    )


def _import(run: dict, source: int, **options):
    """Rank ``source``'s params and optimizer of the run's checkpoint on a process group, with
    the cross-rank check after every step."""
    params = [torch.nn.Parameter(p.clone()) for p in run["params_at_checkpoint"][source]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fn.optim.from_deepspeed(
            params,
            run["config"],
            state_dict=run["state_dicts"][source],
            comm=ProcessGroup(),
            **options,
        )
    opt.check_every = 1
    return params, opt


def _step(rank: int, run: dict, params: list, opt, t: int) -> None:
    """Real update ``t`` on this rank with generate.py's gradient."""
    for p, target, noise in zip(params, run["targets"][rank], run["noise"], strict=True):
        p.grad = (p.detach() - target) + noise[t, rank]
    opt.step()


def _continue(rank: int, run: dict, source: int | None = None, **options) -> float:
    """Imports rank ``source``'s checkpoint of the run (this rank's by default), continues it on
    this rank, and returns the largest distance to DeepSpeed's params of this rank over the
    remaining updates."""
    params, opt = _import(run, rank if source is None else source, **options)
    k, worst = run["checkpoint_step"], 0.0
    for t in range(k + 1, run["steps"] + 1):
        _step(rank, run, params, opt, t)
        for p, theirs in zip(params, run["trajectory"], strict=True):
            worst = max(worst, (p.detach() - theirs[t - k - 1, rank]).abs().max().item())
    return worst


def _next_sync(run: dict) -> int:
    """The first update after the checkpoint after which DeepSpeed's ranks agree (a sync)."""
    k = run["checkpoint_step"]
    return next(
        t
        for t in range(k + 1, run["steps"] + 1)
        if all((x[t - k - 1] - x[t - k - 1, 0]).abs().max() <= 1e-6 for x in run["trajectory"])
    )


def _resume_rank_0s(rank: int, run: dict) -> list[torch.Tensor]:
    """This rank's params at the first sync after continuing from rank 0's checkpoint."""
    params, opt = _import(run, 0)
    for t in range(run["checkpoint_step"] + 1, _next_sync(run) + 1):
        _step(rank, run, params, opt, t)
    return [p.detach().clone() for p in params]


def _worker(rank, world_size):
    out = {}
    for run in (r for r in RUNS if r["world_size"] == world_size):
        out["own", _key(run)] = _continue(rank, run)
        if run["checkpoint_kind"] == "local":
            out["resumed", _key(run)] = _resume_rank_0s(rank, run)
        else:
            out["rank 0's", _key(run)] = _continue(rank, run, source=0)
    # fn's default one-leaf compression of 1-bit Adam is another algorithm (another scale)
    out["flat"] = _continue(rank, _run("onebit_adam", 6, world_size), flatten=True)
    return out


@pytest.fixture(scope="module")
def results():
    """``results(world_size)``: every rank's ``_worker`` results (one launch per world size)."""
    launched = {}

    def by_rank(world_size: int) -> list[dict]:
        if world_size not in launched:
            launched[world_size] = run_distributed(_worker, world_size, timeout=300)
        return launched[world_size]

    return by_rank


def _cases(runs: list[dict]) -> list:
    return [pytest.param(r, id=_key(r)) for r in runs]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", _cases(RUNS))
def test_every_rank_s_own_import_continues_deepspeed_s_trajectory(results, run):
    for rank_results in results(run["world_size"]):
        assert rank_results["own", _key(run)] < 1e-6  # fp32 rounding (measured <= 4.8e-7)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", _cases(SHARED))
def test_rank_0_s_import_continues_deepspeed_s_trajectory_where_the_ranks_agree(results, run):
    for rank_results in results(run["world_size"]):
        assert rank_results["rank 0's", _key(run)] < 1e-6


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", _cases(LOCAL))
def test_rank_0_s_import_after_a_local_step_agrees_again_at_the_next_sync(results, run):
    ranks = run["params_at_checkpoint"]
    assert not all(torch.equal(a, b) for a, b in zip(ranks[0], ranks[1], strict=True))
    resumed = [rank_results["resumed", _key(run)] for rank_results in results(run["world_size"])]
    for other in resumed[1:]:
        for mine, theirs in zip(resumed[0], other, strict=True):
            torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-6)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_per_param_mode_is_what_makes_it_deepspeed_s(results, world_size):
    for rank_results in results(world_size):
        assert rank_results["flat"] > 1e-3


def _params(run, rank=0):
    return [torch.nn.Parameter(p.clone()) for p in run["params_at_checkpoint"][rank]]


@pytest.mark.parametrize("run", _cases([r for r in RUNS if r["checkpoint_kind"] != "warmup"]))
def test_every_rank_s_imported_state_is_deepspeed_s_without_its_init_step(run):
    name = run["name"]
    for rank, state_dict in enumerate(run["state_dicts"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = fn.optim.from_deepspeed(
                _params(run, rank), run["config"], state_dict=state_dict, comm=Local()
            )
        ds = state_dict["state"]
        record = opt.state_dict()["state"][0]
        assert record["step"] == run["checkpoint_step"] == ds[0]["step"] - 1
        functional = record["functional"]
        for j in range(3):
            assert torch.equal(functional[f".exp_avg[{j}]"], ds[j]["exp_avg"])
            assert torch.equal(functional[f".exp_avg_sq[{j}]"], ds[j]["exp_avg_sq"])
        errors = [v for k, v in functional.items() if "_error" in k]
        assert errors and all(e is None or not e.any() for e in errors)
        if name == "onebit_lamb":
            for j in range(3):
                for key in ("lamb_coeff_freeze", "last_factor", "scaling_coeff"):
                    assert functional[f".{key}[{j}]"].item() == pytest.approx(ds[j][key], rel=1e-7)
        if name == "zero_one_adam":
            for j in range(3):
                accumulator = functional[f".momentum_accumulator[{j}]"]
                assert torch.equal(accumulator, ds[j]["momentum_accumulator"])
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
        ({"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True}}}, "amsgrad=True"),
        (
            {"optimizer": {"type": "OneBitAdam", "params": {"amsgrad": "false"}}},
            "amsgrad must be true or false, got 'false'",
        ),
        ({"optimizer": {"type": "OneBitAdam", "params": {"betas": 0.9}}}, "betas must be a list"),
        (
            {"optimizer": {"type": "OneBitLamb", "params": {"betas": "0.9,0.999"}}},
            "betas must be a list",
        ),
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
            _params(adam), adam["config"], state_dict=lamb["state_dicts"][0], comm=Local()
        )
    with pytest.raises(ValueError, match="shape"):
        params = [torch.nn.Parameter(torch.zeros(6, 4)), *_params(adam)[1:]]
        fn.optim.from_deepspeed(
            params, adam["config"], state_dict=adam["state_dicts"][0], comm=Local()
        )
    with pytest.raises(ValueError, match="2 params in the state dict|3 params in the state"):
        fn.optim.from_deepspeed(
            _params(adam)[:2], adam["config"], state_dict=adam["state_dicts"][0], comm=Local()
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
            _params(zero_one), config, state_dict=zero_one["state_dicts"][0], comm=Local()
        )
