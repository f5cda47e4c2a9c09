"""Every 1-bit optimizer, saved through every save path of ``fn.optim`` at every kind of update,
resumes bit for bit on 2 gloo ranks.

Save paths:

- ``own``: every rank saves and loads its own ``state_dict()``;
- ``rank0``: every rank calls ``gather_error_feedback()``, rank 0 alone saves, and every rank
  loads rank 0's checkpoint (what Hugging Face ``Trainer``, ``accelerate`` and Lightning do; the
  stacks' own callbacks are run by ``tests/integrations``);
- ``dcp``: ``torch.distributed.checkpoint`` through ``fn.optim.PerRankState``.

Save points: warmup, the last warmup update, the freeze (the first compressed update), the
update after it, the compressed phase; with two param groups in different phases (per-group
``freeze_step``), with a ``non_freeze`` group, whose error feedback is never allocated, and with
``freeze_step="auto"`` (switching at update 3 or 4; 1-bit Adam with ``exp_avg_mask="auto"``,
1-bit LAMB beside a group of a fixed ``freeze_step``), saved before, at and after the decision.

0/1 Adam's ranks hold their own momentum and params between synchronizations once its variance
froze (by design): a checkpoint that one rank saves for all cannot resume them exactly, so the
``rank0`` path covers its updates before that freeze only.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fn.optim
from tests._distributed import run_distributed
from tests.optim._problem import flat_params, make_model, save_and_load, states_equal, train

pytestmark = pytest.mark.distributed

STEPS = 8
SAVED_AFTER = (1, 2, 3, 4, 6)  # warmup, last warmup, the freeze, right after, compressed
ZERO_ONE = dict(var_freeze_step=3, var_update_scaler=1, local_step_scaler=2, local_step_clipper=2)
AUTO = fn.AutoFreeze(min_updates=2, max_updates=3, tolerance=0.05)


def _two_groups(model: torch.nn.Module, second: dict) -> list[dict]:
    return [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), **second},
    ]


OPTIMIZERS = {
    "onebit_adam": lambda m: fn.optim.OnebitAdam(m.parameters(), lr=1e-2, freeze_step=3),
    "onebit_adam_per_param_bf16": lambda m: fn.optim.OnebitAdam(
        m.parameters(), lr=1e-2, freeze_step=3, flatten=False, error_dtype=torch.bfloat16
    ),
    "onebit_lamb": lambda m: fn.optim.OnebitLamb(m.parameters(), lr=1e-2, freeze_step=3),
    "zero_one_adam": lambda m: fn.optim.ZeroOneAdam(m.parameters(), lr=1e-2, **ZERO_ONE),
    "mixed_freeze_steps": lambda m: fn.optim.OnebitAdam(
        _two_groups(m, {"freeze_step": 5}), lr=1e-2, freeze_step=3
    ),
    "non_freeze_group": lambda m: fn.optim.OnebitAdam(
        _two_groups(m, {"non_freeze": True}), lr=1e-2, freeze_step=3
    ),
    "onebit_lamb_mixed": lambda m: fn.optim.OnebitLamb(
        _two_groups(m, {"freeze_step": 5}), lr=1e-2, freeze_step=3
    ),
    "onebit_adam_auto": lambda m: fn.optim.OnebitAdam(
        m.parameters(), lr=1e-2, freeze_step=AUTO, exp_avg_mask="auto"
    ),
    "onebit_lamb_auto_mixed": lambda m: fn.optim.OnebitLamb(
        _two_groups(m, {"freeze_step": 5}), lr=1e-2, freeze_step=AUTO
    ),
}
PATHS = ("own", "rank0", "dcp")


def _exact_from_rank0(name: str, saved_after: int) -> bool:
    """Whether every rank can resume exactly from rank 0's checkpoint (see the module doc)."""
    return name != "zero_one_adam" or saved_after < ZERO_ONE["var_freeze_step"] + 1


def _from_rank0(obj):
    """Rank 0's ``obj`` on every rank, through ``torch.save`` and ``torch.load``."""
    box = [save_and_load(obj) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return save_and_load(box[0])


def _save(path: str, opt, model, where: str):
    """The checkpoint of ``(model, opt)`` by save path ``path`` (``where``: a DCP directory)."""
    weights = copy.deepcopy(model.state_dict())
    if path == "own":
        return weights, save_and_load(opt.state_dict())
    if path == "rank0":
        opt.gather_error_feedback()
        return _from_rank0(weights), _from_rank0(opt.state_dict())
    dcp.save({"optim": fn.optim.PerRankState(opt)}, checkpoint_id=where)
    return weights, where


def _load(path: str, opt, checkpoint) -> None:
    if path == "dcp":
        dcp.load({"optim": fn.optim.PerRankState(opt)}, checkpoint_id=checkpoint)
    else:
        opt.load_state_dict(checkpoint)


def _worker(rank: int, world_size: int, root: str) -> dict:
    del world_size
    warnings.simplefilter("ignore", RuntimeWarning)  # the frozen-variance report
    out = {}
    for name, make in OPTIMIZERS.items():
        for path in PATHS:
            model = make_model()
            opt = make(model)
            checkpoints = {}
            for t in range(STEPS):
                train(model, opt, rank, range(t, t + 1))
                if t + 1 in SAVED_AFTER:
                    where = f"{root}/{name}-{path}-{t + 1}"
                    checkpoints[t + 1] = _save(path, opt, model, where)
            full_params, full_state = flat_params(model), opt.state_dict()
            for k, (weights, checkpoint) in checkpoints.items():
                if path == "rank0" and not _exact_from_rank0(name, k):
                    continue
                resumed = make_model(seed=1)
                resumed_opt = make(resumed)
                resumed.load_state_dict(weights)
                _load(path, resumed_opt, checkpoint)
                train(resumed, resumed_opt, rank, range(k, STEPS))
                out[name, path, k] = (
                    torch.equal(flat_params(resumed), full_params),
                    states_equal(resumed_opt.state_dict(), full_state),
                )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    return run_distributed(_worker, 2, root, timeout=500)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_from_every_save_path_and_phase_is_bit_for_bit(results, name, path):
    expected = [k for k in SAVED_AFTER if path != "rank0" or _exact_from_rank0(name, k)]
    for rank, out in enumerate(results):
        resumed = {k: out[name, path, k] for k in expected}
        assert resumed == {k: (True, True) for k in expected}, (rank, resumed)
