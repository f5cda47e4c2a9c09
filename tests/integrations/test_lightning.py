"""fn.integrations.lightning: 1-bit Adam in Lightning's DDP on 2 gloo ranks under ``torchrun``
(examples/lightning_ddp.py): resumed runs end bit-identical to the uninterrupted one, the
compressed steps write what bare fn.optim.OnebitAdam writes, and without ``FnCallback`` fn warns
once; in one process: the sharded strategies, a torch optimizer and a run too short to compress
are reported."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import fn
import fn.optim

lightning = pytest.importorskip("lightning", reason="lightning is in the 'lightning' extra")
from lightning.pytorch.strategies import (  # noqa: E402
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
)

from fn.app.examples import SAMPLES  # noqa: E402
from fn.integrations.lightning import FnCallback, check_strategy  # noqa: E402
from tests._distributed import ROOT, torchrun  # noqa: E402
from tests._examples import (  # noqa: E402
    documented,
    download,
    option,
    run_downloaded,
    with_option,
)


def _example(folder: Path, output_dir: Path, *extra: str) -> dict[str, torch.Tensor]:
    """docs/examples.md's command, its output in ``output_dir``, with ``extra``, run from a copy
    of the script alone in ``folder``."""
    command = with_option(documented("lightning_ddp.py"), "--output-dir", str(output_dir))
    out = run_downloaded(command + list(extra), download("lightning_ddp.py", folder))
    assert "the same on every rank" in out
    return torch.load(output_dir / "final.pt", weights_only=True)


def _resumed_runs_equal_the_full_run(tmp_path: Path) -> None:
    command = documented("lightning_ddp.py")  # --max-steps 10 --freeze-step 6 --save-steps 4
    steps, save = int(option(command, "--max-steps")), int(option(command, "--save-steps"))
    epoch = SAMPLES // (2 * int(option(command, "--batch-size")))  # 2 ranks: 8 steps
    # the first checkpoint in the warmup and in the middle of an epoch (the example's loader is
    # resumable), the second in the compressed phase
    assert save < int(option(command, "--freeze-step")) <= 2 * save < steps and save % epoch
    folder = tmp_path / "download"
    full = _example(folder, tmp_path / "full")
    for step in range(save, steps, save):
        checkpoint = tmp_path / "full" / f"checkpoint-{step}.ckpt"
        resumed = _example(folder, tmp_path / f"resumed-{step}", "--ckpt-path", str(checkpoint))
        assert full.keys() == resumed.keys() and len(full) == 4
        for name in full:
            assert torch.equal(full[name], resumed[name]), (step, name)
        # rank 0 saved alone, with every rank's error feedback
        saved = torch.load(checkpoint, weights_only=False)
        record = saved["optimizer_states"][0]["state"][0]
        assert record["rank"] == 0 and len(record["error_feedback_by_rank"]) == 2


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resumed_in_warmup_and_in_the_compressed_phase_is_bit_identical(tmp_path):
    _resumed_runs_equal_the_full_run(tmp_path)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_compressed_steps_send_what_bare_fn_sends_and_unregistered_ddp_is_reported(tmp_path):
    torchrun(ROOT / "tests" / "integrations" / "_lightning_traffic.py", str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for result in ranks:
        bare, registered, unregistered = (result[k] for k in ("bare", "registered", "unregistered"))
        compressed = [t for t, c in enumerate(bare["compressed"]) if c]
        assert registered["compressed"] == bare["compressed"] and len(compressed) >= 4
        for t in compressed:
            # counted at the kernel (sockets included) and by fn: DDP adds nothing
            assert registered["written"][t] <= 1.05 * bare["written"][t] + 64, registered
            assert registered["fn_sent"][t] == bare["fn_sent"][t]
            # without FnCallback DDP averages every gradient densely on top of fn's 1-bit
            assert unregistered["written"][t] > 3 * bare["written"][t], unregistered
        assert registered["warnings"] == []
        (message,) = unregistered["warnings"]  # once
        assert "fn.ddp.register(ddp_model, opt)" in message and "FnCallback()" in message
    for run in ("registered", "unregistered"):
        assert torch.equal(ranks[0][run]["params"], ranks[1][run]["params"])


def _onebit_adam() -> fn.optim.OnebitAdam:
    return fn.optim.OnebitAdam(torch.nn.Linear(2, 1).parameters(), comm=fn.collectives.Local())


@pytest.mark.parametrize(
    "strategy",
    [FSDPStrategy(), ModelParallelStrategy(), DeepSpeedStrategy.__new__(DeepSpeedStrategy)],
    ids=["fsdp", "model_parallel", "deepspeed"],
)
def test_sharded_strategies_are_refused_with_what_to_do(strategy):
    with pytest.raises(NotImplementedError, match="strategy='ddp'.*fn.fsdp.loco_reduce_scatter"):
        check_strategy(strategy, _onebit_adam())
    # an fn.optim optimizer outside the 1-bit family is left to the strategy
    adam = fn.optim.FunctionalOptimizer(
        torch.nn.Linear(2, 1).parameters(), fn.adam(1e-3), comm=fn.collectives.Local()
    )
    check_strategy(strategy, adam)


def test_ddp_strategy_is_accepted():
    check_strategy(DDPStrategy(), _onebit_adam())


class _Model(lightning.LightningModule):
    def __init__(self, make_optimizer):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.make_optimizer = make_optimizer

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def _fit(make_optimizer, max_steps: int = 2) -> list[str]:
    """Fits ``_Model`` in this process; returns the messages of fn's warnings."""
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[FnCallback()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Model(make_optimizer), torch.utils.data.DataLoader(data, batch_size=2))
    return [str(w.message) for w in caught if str(w.message).startswith("fn.")]


def test_a_torch_optimizer_is_refused():
    with pytest.raises(TypeError, match="needs an fn.optim optimizer.*SGD"):
        _fit(lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_a_run_too_short_to_compress_is_reported():
    (message,) = _fit(lambda ps: fn.optim.OnebitAdam(ps, freeze_step=100), max_steps=3)
    assert "estimated_stepping_batches (3 updates)" in message and "freeze_step" in message
    assert _fit(lambda ps: fn.optim.OnebitAdam(ps, freeze_step=2), max_steps=3) == []
