"""fn.integrations.lightning with fn.fsdp.OnebitAdam (and OnebitLamb with freeze_step="auto")
under Lightning's ModelParallelStrategy on 2
gloo ranks under ``torchrun`` (tests/integrations/_lightning_fsdp.py and
examples/lightning_fsdp.py): runs resumed from a checkpoint in the warmup, at the freeze and in
the compressed phase end bit-identical (params and optimizer state) to the uninterrupted run,
which equals a plain fn.fsdp loop and sends 1-bit traffic after the freeze; bad set-ups are
refused on every rank with nothing changed; with accumulate_grad_batches=4 and
gradient_clip_val=1.0 the same, the clip acting in both phases, and clipping that fn cannot
make, or a checkpoint between micro-batches, refused on every rank; in one process: the
strategies it cannot run under."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fn.fsdp

lightning = pytest.importorskip("lightning", reason="lightning is in the 'lightning' extra")
from lightning.pytorch.strategies import (  # noqa: E402
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from fn.integrations.lightning import check_strategy  # noqa: E402
from tests._distributed import ROOT, torchrun  # noqa: E402
from tests._examples import (  # noqa: E402
    documented,
    download,
    option,
    run_downloaded,
    with_option,
)
from tests.integrations._lightning_fsdp import (  # noqa: E402
    ACC_RESUME,
    ACC_STEPS,
    ACCUMULATE,
    CLIP,
    FREEZE,
    LAMB_RESUME,
    RESUME,
    STEPS,
)

# the optimizer state every rank holds alike (DCP saves one copy of it)
REPLICATED = ("header", "lr", "signed", "momentum.")

REFUSED = {
    "other settings": r"^ValueError: fn.fsdp.OnebitAdam: .*other settings.*nothing was loaded",
    "other optimizer": r"^ValueError: .*holds no fn.fsdp.OnebitAdam state under 'optimizer_0'",
    "mesh of one rank": r"^ValueError: .*shard mesh holds 1 of the 2 ranks.*replicate=",
    "full checkpoint": r"^NotImplementedError: .*save_distributed_checkpoint=False",
}


ACC_REFUSED = {
    "by value": r"^NotImplementedError: .*gradient_clip_algorithm='value' with fn.fsdp.OnebitAdam",
    "other norm": r"^ValueError: .*gradient_clip_val=1.0 and .*\(max_grad_norm=0.5\) differ",
    "hook's norm": r"^ValueError: .*clipping to the norm 0.5 .* whose max_grad_norm is None",
    "between micro-batches": r"^RuntimeError: .*state_dict\(\) between a backward and its step",
}


def assert_resumed_bit_for_bit(full: dict, resumed: dict, *where: object) -> None:
    """A run resumed from a checkpoint ends with the uninterrupted run's params and optimizer
    state (``{"params": ..., "state": ...}`` of tensors by name), bit for bit."""
    for name, value in full["params"].items():
        assert torch.equal(value, resumed["params"][name]), (*where, name)
    assert resumed["state"].keys() == full["state"].keys()
    for key, value in full["state"].items():
        assert torch.equal(value, resumed["state"][key]), (*where, key)


def check_accumulation_runs(ranks: list[dict], hsdp: bool) -> None:
    """The assertions on ``_lightning_fsdp.accumulation_runs``'s results, one per rank."""
    warmup = (FREEZE - 1) * ACCUMULATE  # the batches of the warmup updates
    last = [b % ACCUMULATE == ACCUMULATE - 1 for b in range(ACC_STEPS * ACCUMULATE)]
    for rank, result in enumerate(ranks):
        full = result["full"]
        # Lightning's own clipping stepped aside: on .grad, in a 1-D compressed phase, fn warns
        assert full["warnings"] == [] and full["max_grad_norm"] == CLIP
        # a checkpoint per update, none between the micro-batches (fn.fsdp refuses those)
        assert full["saved"] == [f"checkpoint-{s}.ckpt" for s in range(1, ACC_STEPS + 1)]
        for name, value in full["params"].items():
            # Lightning's loss / ACCUMULATE per micro-batch, and one clipping, by fn
            assert torch.equal(value, result["bare"][name]), (rank, name)
            assert torch.equal(value, ranks[0]["full"]["params"][name]), (rank, name)
        # the clip acts in the warmup, and in the compressed phase (from the same checkpoint)
        unclipped = result["unclipped"]
        assert any(not torch.equal(v, unclipped["warmup"][n]) for n, v in full["warmed"].items())
        assert any(
            not torch.equal(v, unclipped["compressed"][n]) for n, v in full["params"].items()
        )
        for step in ACC_RESUME:
            assert_resumed_bit_for_bit(full, result["resumed"][step], rank, step)
        sent, inter = full["sent"], full["inter"]
        assert len(sent) == len(inter) == ACC_STEPS * ACCUMULATE
        after = warmup + ACCUMULATE  # the batches after the freeze's update
        if hsdp:  # across the nodes: once per update, 1 bit per element once compressed
            assert all(b > 0 if end else b == 0 for b, end in zip(inter, last, strict=True))
            dense = inter[ACCUMULATE - 1 : warmup : ACCUMULATE]
            assert max(inter[after:]) < min(dense) / 8, inter
        else:  # the compressed phase accumulates locally, then sends 1 bit per element
            assert not any(inter) and min(sent[:warmup]) > 1000
            steps = zip(sent[after:], last[after:], strict=True)
            assert all(b > 0 if end else b == 0 for b, end in steps), sent
            assert max(sent[after:]) < min(sent[:warmup]) / 8, sent
        for case, pattern in ACC_REFUSED.items():
            message, unchanged = result["refused"][case]
            assert unchanged, case
            assert message == ranks[0]["refused"][case][0]  # the same on every rank
            assert re.search(pattern, message), message


def scenarios(script: str, world: int, out: Path, timeout: float) -> dict[str, list[dict]]:
    """``tests/integrations/<script>``'s scenarios in one ``torchrun`` of ``world`` ranks:
    ``{scenario: each rank's results}``."""
    torchrun(ROOT / "tests" / "integrations" / script, str(out), nproc=world, timeout=timeout)
    return {
        name: [torch.load(out / name / f"rank{r}.pt", weights_only=False) for r in range(world)]
        for name in ("main", "accumulation")
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    return scenarios("_lightning_fsdp.py", 2, tmp_path_factory.mktemp("lightning_fsdp"), 340)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_accumulation_and_clipping_train_and_resume_bit_for_bit(runs):
    """accumulate_grad_batches=4 and gradient_clip_val=1.0 on 2 ranks: the run equals a plain
    fn.fsdp loop (loss / 4 per micro-batch, max_grad_norm=1.0), the clip acts in both phases,
    runs resumed in the warmup and compressed phase are bit-identical; clipping by value or to
    another norm than max_grad_norm is refused on every rank."""
    check_accumulation_runs(runs["accumulation"], hsdp=False)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_resumed_at_every_phase_is_bit_identical_and_bad_setups_are_refused(runs):
    ranks = runs["main"]
    for rank, result in enumerate(ranks):
        full = result["full"]
        assert full["warnings"] == []  # a healthy run is quiet
        for name, value in full["params"].items():  # Lightning adds nothing to fn's updates
            assert torch.equal(value, result["bare"][name]), name
        dense, compressed = full["sent"][: FREEZE - 1], full["sent"][FREEZE:]
        assert len(compressed) == STEPS - FREEZE and min(dense) > 1000
        assert max(compressed) < min(dense) / 8, full["sent"]  # 1 bit per element, not 32
        assert f"per_rank.rank{rank}.net.worker" in full["state"]  # this rank's own error feedback
        for step in RESUME:
            assert_resumed_bit_for_bit(full, result["resumed"][step], rank, step)
        for case, pattern in REFUSED.items():
            message, unchanged = result["refused"][case]
            assert unchanged, case
            assert message == ranks[0]["refused"][case][0]  # the same on every rank
            assert re.search(pattern, message), message
        (short,) = result["short"]
        assert "estimated_stepping_batches (2 updates)" in short and "freeze_step" in short
    states = [r["full"]["state"] for r in ranks]
    for key in states[0]:
        if key.startswith(REPLICATED):
            assert torch.equal(states[0][key], states[1][key]), key
    for rank, result in enumerate(ranks):  # 1-bit LAMB, freeze_step="auto"
        lamb = result["lamb"]
        full = lamb["full"]
        switch = int(full["state"]["auto.freeze_at"])
        assert full["warnings"] == [] and switch in (3, 4)
        assert switch == int(ranks[0]["lamb"]["full"]["state"]["auto.freeze_at"])
        # after the freeze's one all-gather of the momentum, 1 bit per element
        dense, compressed = full["sent"][: switch - 1], full["sent"][switch:]
        assert max(compressed) < min(dense) / 4, full["sent"]
        for name, value in full["params"].items():
            assert torch.equal(value, ranks[0]["lamb"]["full"]["params"][name]), name
        for step in LAMB_RESUME:
            assert_resumed_bit_for_bit(full, lamb["resumed"][step], rank, step)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_resumes_in_new_processes_bit_for_bit(tmp_path):
    """docs/examples.md's command (6 updates, the freeze at 3, a checkpoint at 4), run from a
    copy of the script alone in an empty folder, and resumed from its checkpoint."""
    command = documented("lightning_fsdp.py")
    assert [option(command, f"--{k}") for k in ("max-steps", "freeze-step", "save-steps")] == [
        "6", "3", "4"
    ]  # fmt: skip
    folder = download("lightning_fsdp.py", tmp_path / "download")

    def run(output_dir: Path, *extra: str) -> dict[str, torch.Tensor]:
        words = with_option(command, "--output-dir", str(output_dir)) + list(extra)
        out = run_downloaded(words, folder, timeout=240)
        assert "the same on every rank" in out and "6 updates" in out
        return torch.load(output_dir / "final.pt", weights_only=True)

    full = run(tmp_path / "full")
    checkpoint = tmp_path / "full" / "checkpoint-4.ckpt"  # compressed phase
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in checkpoint.iterdir()}  # each rank
    resumed = run(tmp_path / "resumed", "--ckpt-path", str(checkpoint))
    assert full.keys() == resumed.keys() and len(full) == 4
    for name in full:
        assert torch.equal(full[name], resumed[name]), name


@pytest.fixture
def one_rank_model():
    """A model sharded by FSDP2 on a group of one process (this one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield fully_shard(torch.nn.Linear(2, 1), mesh=init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()


def test_fsdp_onebit_adam_runs_only_under_model_parallel_strategy(one_rank_model):
    optimizer = fn.fsdp.OnebitAdam(one_rank_model, freeze_step=2)
    check_strategy(ModelParallelStrategy(), optimizer)
    for strategy in (DDPStrategy(), FSDPStrategy()):
        with pytest.raises(NotImplementedError, match="ModelParallelStrategy, not under"):
            check_strategy(strategy, optimizer)
