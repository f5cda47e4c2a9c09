"""fn.integrations.torchtitan: torchtitan 0.3.0's own Trainer, config manager and
CheckpointManager with fn's config (``--module fn.integrations.torchtitan --config
llama3_debugmodel``), on CPU gloo ranks under ``torchrun`` (tests/integrations/_torchtitan_runs.py,
with the test-only CPU shim of _torchtitan_cpu.py), two micro-batches per step and clipping:

- FSDP on 2 ranks: TP, PP, CP and EP refused at start on every rank; it trains, compresses, and
  its first gradient is torchtitan's summed gradient bit for bit; runs resumed from its
  checkpoints in the warmup, at the freeze and in the compressed phase end with the same
  checkpoint (every tensor bit for bit, the data loaders at the same place of their stream);
  an AdamW checkpoint of torchtitan's own config starts
  it (params, ``m``, ``v`` and the step carried over, the error feedback zero, one warning),
  and it trains on, compressed;
- HSDP on 4 ranks (2 replicas x 2 shards): the same, the replicas' shards identical, its first
  gradient torchtitan's own HSDP's summed gradient.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is in the 'torchtitan' extra")
from tests._distributed import ROOT, torchrun  # noqa: E402
from tests.integrations._torchtitan_runs import (  # noqa: E402
    ADAM_STEPS,
    MAX_NORM,
    REFUSED,
    RESUMES,
    STEPS,
    WARM_STEPS,
)

SCRIPT = ROOT / "tests" / "integrations" / "_torchtitan_runs.py"
STARTED = "started from Adam's state at update"


class Scenario(NamedTuple):
    """What a scenario's launch left: each rank's record, and the last checkpoint of the full
    run and of each resumed run (``"full"``, ``"resumed-<step>"``), flattened."""

    ranks: list[dict[str, Any]]
    last_checkpoints: dict[str, dict[str, Any]]


def _launch(scenario: str, world: int, factory: pytest.TempPathFactory) -> Scenario:
    """Runs a scenario and reads what the tests need into memory; its folder goes at once (its
    checkpoints and records take GBs, and the next scenario needs the disk)."""
    work = factory.mktemp("torchtitan")
    try:
        torchrun(SCRIPT, scenario, str(work), nproc=world, timeout=480)
        runs = work / scenario
        ranks = [torch.load(runs / f"rank{r}.pt", weights_only=False) for r in range(world)]
        last = f"step-{STEPS[scenario]}"
        names = ["full", *(f"resumed-{step}" for step in RESUMES[scenario])]
        checkpoints = {
            name: _checkpoint(runs / name / "checkpoint" / last, work / "flat.pt") for name in names
        }
        return Scenario(ranks, checkpoints)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    return _launch("fsdp", 2, tmp_path_factory)


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    return _launch("hsdp", 4, tmp_path_factory)


def _checkpoint(folder: Path, cache: Path) -> dict[str, Any]:
    """A torchtitan DCP checkpoint, every entry (full tensors; each rank's own entries)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, cache)
    flat: dict[str, Any] = {}

    def walk(tree: dict[str, Any], prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = value

    walk(torch.load(cache, weights_only=False), "")
    cache.unlink()
    return flat


def _same(key: str, a: Any, b: Any) -> bool:
    """Whether two entries of a checkpoint are the same: tensors bit for bit, other values
    equal, and a rank's data loader state at the same place of the same token stream."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if key.startswith("dataloader.dp_rank_"):
        return _same_stream(pickle.loads(a)["dataset_state"], pickle.loads(b)["dataset_state"])
    return a == b


def _same_stream(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """torchtitan's text dataset keeps the documents it has read and not yet batched in its
    buffers: a resumed one reads the next document before it batches what its buffers hold,
    so its state may be one document further along, its buffers longer by that document."""
    if b["sample_idx"] < a["sample_idx"]:
        a, b = b, a
    if b["sample_idx"] - a["sample_idx"] not in (0, 1) or a["epoch"] != b["epoch"]:
        return False
    buffers = ("inputs_buffer", "labels_buffer", "positions_buffer")
    if b["sample_idx"] == a["sample_idx"]:
        return all(a[k] == b[k] for k in buffers)
    return all(b[k][: len(a[k])] == a[k] and len(b[k]) > len(a[k]) for k in buffers)


def _check_resumed(scenario: Scenario, name: str) -> None:
    """Every resumed run logs the full run's losses after its start, and its last checkpoint
    equals the full run's, entry for entry (the model, fn's state with every rank's error
    feedback, the LR scheduler, the step; the data loaders at the same place)."""
    full = scenario.last_checkpoints["full"]
    assert any(key.startswith("optimizer.per_rank.rank1.") for key in full), sorted(full)[:20]
    for start in RESUMES[name]:
        for rank in scenario.ranks:
            resumed, straight = rank[f"resumed-{start}"]["losses"], rank["full"]["losses"]
            assert resumed == {s: v for s, v in straight.items() if s > start}, (start, resumed)
        last = scenario.last_checkpoints[f"resumed-{start}"]
        assert last.keys() == full.keys()
        different = [key for key in full if not _same(key, full[key], last[key])]
        assert different == [], (start, different[:10])


def _fn_warnings(record: dict[str, Any]) -> list[str]:
    return [w for w in record["warnings"] if w.startswith("fn.")]


def _check_trains(ranks: list[dict[str, Any]]) -> None:
    """Every rank logs the same losses, which fall; every module compressed; fn clips with
    --training.max_norm and torchtitan's clip_grad_norm_ is neutral (nothing warns about a
    changed .grad)."""
    full = ranks[0]["full"]
    losses = full["losses"]
    assert all(rank["full"]["losses"] == losses for rank in ranks)
    assert losses[max(losses)] < losses[1], losses
    for rank in ranks:
        state = rank["full"]["state"]
        assert state["signed"] == [1] * len(state["signed"]), state["signed"]
        assert state["max_grad_norm"] == MAX_NORM and state["titan_max_norm"] == float("inf")
        assert _fn_warnings(rank["full"]) == [], _fn_warnings(rank["full"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_refuses_other_parallelisms_at_start_on_every_rank(fsdp):
    ranks = fsdp.ranks
    for name in REFUSED:
        message = ranks[0]["refused"][name]
        assert message is not None and message.startswith("NotImplementedError: "), message
        assert f"--parallelism.{name} 2" in message and "is not built" in message, message
        assert all(rank["refused"][name] == message for rank in ranks), name


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_trains_with_torchtitans_summed_gradient(fsdp):
    ranks = fsdp.ranks
    _check_trains(ranks)
    for rank in ranks:
        # step 1, warmup, 2 micro-batches: the same .grad as torchtitan's AdamW run (same
        # init, same data): summed over the ranks and the micro-batches, bit for bit
        grads, adam = rank["full"]["grads"], rank["adamw"]["grads"]
        assert grads.keys() == adam.keys() and len(grads) > 40
        assert all(torch.equal(grads[n], adam[n]) for n in grads)
    # every rank holds the whole momentum as packed signs: the same bits
    momenta = [rank["full"]["state"]["momentum"] for rank in ranks]
    for name, packed in momenta[0].items():
        assert all(torch.equal(m[name]["packed"], packed["packed"]) for m in momenta), name


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_resumes_bit_for_bit_in_warmup_at_freeze_and_compressed(fsdp):
    _check_resumed(fsdp, "fsdp")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adamw_checkpoint_starts_onebit_adam(fsdp):
    ranks = fsdp.ranks
    for rank in ranks:
        adam, loaded = rank["adamw"]["state"], rank["warm loaded"]
        state = loaded["state"]
        assert state["count"] == ADAM_STEPS and state["signed"] == [0] * len(state["signed"])
        for name, value in adam["params"].items():
            assert torch.equal(state["params"][name], value), name
        by_name = {n.replace("._checkpoint_wrapped_module", ""): n for n in state["exp_avg"]}
        assert by_name.keys() == adam["exp_avg"].keys()
        for field in ("exp_avg", "exp_avg_sq"):
            for name, value in adam[field].items():
                assert torch.equal(state[field][by_name[name]], value), (field, name)
        errors = [x for module in state["errors"].values() for x in module.values()]
        assert errors and all(not bool(x.any()) for x in errors)
        warned = _fn_warnings(loaded)
        assert sum(STARTED in w for w in warned) == 1, warned
        assert "error feedback of the 1-bit allreduce starts at zero" in warned[-1], warned
        # trained on from the checkpoint's step: compressed from the next update (the freeze)
        warm = rank["warm"]
        assert sorted(warm["losses"]) == list(range(ADAM_STEPS + 1, WARM_STEPS + 1))
        assert all(torch.isfinite(torch.tensor(list(warm["losses"].values()))))
        assert warm["state"]["signed"] == [1] * len(state["signed"])
        assert [STARTED in w for w in _fn_warnings(warm)] == [True], _fn_warnings(warm)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_model_only_checkpoint_is_refused_naming_what_resumes(fsdp):
    """It was refused with advice (leave the optimizer out) that then failed in DCP."""
    for rank in fsdp.ranks:
        refused = rank["model only"]
        assert refused is not None and "holds the model only" in refused, refused
        assert "--checkpoint.load_step" in refused and "initial_load_path" in refused, refused


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hsdp_trains_replicas_agree_and_resumes_bit_for_bit(hsdp):
    ranks = hsdp.ranks
    _check_trains(ranks)
    for shard, peer in ((0, 2), (1, 3)):  # the 2 replicas of each shard: the same bits
        for run in ("full", *(f"resumed-{s}" for s in RESUMES["hsdp"])):
            mine, theirs = ranks[shard][run]["state"], ranks[peer][run]["state"]
            for field in ("params", "exp_avg_sq"):
                for name, value in mine[field].items():
                    assert torch.equal(value, theirs[field][name]), (run, field, name)
    sent = ranks[0]["full"]["state"]["sent"]
    assert 0 < sent["inter"] < sent["intra"], sent
    # the first step's gradient (the sum over the replicas, after step()) is torchtitan's own
    # HSDP's summed gradient, to rounding: fn owns the replicas, in another order of sums
    for name in ranks[0]["native"]["grads"]:
        fn_grad, titan_grad = (
            torch.cat([ranks[r][run]["grads"][name] for r in (0, 1)]) for run in ("full", "native")
        )
        torch.testing.assert_close(fn_grad, titan_grad, rtol=1e-5, atol=1e-9)
    _check_resumed(hsdp, "hsdp")
