"""Run under ``torchrun`` by test_lightning.py: what each rank writes per training step (its
sockets included: gloo's traffic) with fn's 1-bit Adam in Lightning's DDP with ``FnCallback``,
in Lightning's DDP without it, and with bare ``fn.optim.OnebitAdam`` (no DDP, no Lightning).

    torchrun --nproc-per-node 2 tests/integrations/_lightning_traffic.py OUT_DIR

Writes ``OUT_DIR/rank<r>.pt``: per run, the bytes written and fn's bytes sent per step, which
steps were compressed, the fn.optim warnings and the final params.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import lightning
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from lightning_ddp import Classifier  # noqa: E402

import fn.optim  # noqa: E402
from fn.app.examples import ResumableBatches, synthetic_data  # noqa: E402
from fn.collectives import exit_distributed  # noqa: E402
from fn.integrations.lightning import FnCallback  # noqa: E402

STEPS, FREEZE, BATCH = 8, 3, 4


def bytes_written() -> int:
    """What this process has written so far, from the kernel's count."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar"))


class StepTraffic(lightning.Callback):
    """Records, per training step, the bytes written, fn's bytes sent and whether the step's
    update was compressed."""

    def __init__(self) -> None:
        self.written, self.fn_sent, self.compressed = [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        optimizer = trainer.optimizers[0]
        self.compressed.append(optimizer.next_update_compressed()[0])
        optimizer.comm.reset_bytes_sent()
        self.start = bytes_written()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.written.append(bytes_written() - self.start)
        self.fn_sent.append(trainer.optimizers[0].comm.bytes_sent)


def lightning_run(register: bool) -> dict:
    traffic = StepTraffic()
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=STEPS,
        use_distributed_sampler=False,
        callbacks=[FnCallback(), traffic] if register else [traffic],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Classifier(1e-2, FREEZE)
    loader = ResumableBatches(*synthetic_data(), BATCH, trainer.global_rank, trainer.world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    return {
        "written": traffic.written,
        "fn_sent": traffic.fn_sent,
        "compressed": traffic.compressed,
        "warnings": [str(w.message) for w in caught if "fn.optim" in str(w.message)],
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


def bare_run(rank: int, world_size: int) -> dict:
    """The same model and optimizer in a plain loop on this rank's share of the data."""
    model = Classifier(1e-2, FREEZE)
    optimizer = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    out = {"written": [], "fn_sent": [], "compressed": []}
    batches = iter(ResumableBatches(*synthetic_data(), BATCH, rank, world_size))
    for _ in range(STEPS):
        x, y = next(batches)
        out["compressed"].append(optimizer.next_update_compressed()[0])
        dist.barrier()
        optimizer.comm.reset_bytes_sent()
        start = bytes_written()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model.net(x), y).backward()
        optimizer.step()
        out["written"].append(bytes_written() - start)
        out["fn_sent"].append(optimizer.comm.bytes_sent)
    return out


def main() -> None:
    out_dir = Path(sys.argv[1])
    results = {"registered": lightning_run(True), "unregistered": lightning_run(False)}
    results["bare"] = bare_run(dist.get_rank(), dist.get_world_size())
    torch.save(results, out_dir / f"rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_distributed()
