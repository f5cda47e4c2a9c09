"""torchtitan's Trainer with fn's config (``--module fn.integrations.torchtitan --config
llama3_debugmodel``) on CPU gloo ranks, under ``torchrun``, for
tests/integrations/test_torchtitan.py: ``_torchtitan_runs.py fsdp|hsdp WORKDIR``.

``main`` installs the CPU shim, then imports torchtitan (importing this module changes
nothing). Every run is torchtitan's own: its config parsed by its ``ConfigManager``, its
trainer built by ``config.build()``, trained by ``train()``, checkpointed by its
``CheckpointManager``; several runs share one launch (a launch costs tens of seconds of
imports). Each rank writes what it saw to ``WORKDIR/<scenario>/rank<r>.pt``; the runs' folders
are under ``WORKDIR/<scenario>``. The checkpoints that no test reads go as soon as they are
written (one of this model is 143 MB, and a scenario writes more than ten): a resumed run
keeps its last, the full run keeps those the resumes start from until they have started, and
the others keep none.

- ``fsdp`` (2 ranks): TP, PP, CP and EP refused at start; a run with micro-batches (2 per step)
  and clipping, checkpointed every 2 steps, resumed from its warmup, its freeze and its
  compressed phase; an AdamW run of torchtitan's own config, then fn started from its
  checkpoint.
- ``hsdp`` (4 ranks, 2 replicas x 2 shards): the same run on HSDP, resumed from its warmup
  and its compressed phase.
"""

from __future__ import annotations

import logging
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.integrations._torchtitan_cpu import CPU_ARGS, install, write_assets

STEPS = {"fsdp": 8, "hsdp": 5}
FREEZE = {"fsdp": 4, "hsdp": 3}
RESUMES = {"fsdp": (2, 4, 6), "hsdp": (2, 4)}
MAX_NORM = 0.5  # below the gradient's norm: the clip acts
ADAM_STEPS, WARM_STEPS = 3, 5
REFUSED = (
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
)
HSDP = [
    "--parallelism.data_parallel_replicate_degree", "2",
    "--parallelism.data_parallel_shard_degree", "2",
]  # fmt: skip


def local(x: torch.Tensor) -> torch.Tensor:
    return (x.to_local() if isinstance(x, DTensor) else x).detach().clone()


def common(work: Path, world: int) -> list[str]:
    """The arguments of every run: the data, a short sequence, 2 micro-batches per step."""
    assets, data = work / "assets" / "tokenizer", work / "assets" / "data"
    return [
        *CPU_ARGS,
        "--hf_assets_path", str(assets),
        "--dataloader.dataset_path", str(data),
        "--training.seq_len", "32",
        "--training.local_batch_size", "1",
        "--training.global_batch_size", str(2 * world),
        "--debug.seed", "0",
        "--metrics.log_freq", "1",
        "--checkpoint.enable",
        "--checkpoint.keep_latest_k", "0",
    ]  # fmt: skip


def fn_args(scenario: str, work: Path, world: int) -> list[str]:
    return [
        "--module", "fn.integrations.torchtitan", "--config", "llama3_debugmodel",
        *common(work, world),
        "--optimizer.freeze_step", str(FREEZE[scenario]),
        "--training.max_norm", str(MAX_NORM),
        "--checkpoint.interval", "2",
    ]  # fmt: skip


def titan_args(work: Path, world: int) -> list[str]:
    """torchtitan's own llama3_debugmodel with AdamW, without clipping."""
    return [
        "--module", "llama3", "--config", "llama3_debugmodel", *common(work, world),
        "--training.disable_cuda_graphs", "--training.max_norm", "1e9",
    ]  # fmt: skip


def fn_state(trainer: Any) -> dict[str, Any]:
    """What this rank holds after training: fn's optimizer state and the params' shards."""
    optimizer = trainer.optimizers.optimizer
    state = optimizer.state_dict()
    (model,) = trainer.model_parts
    own = state["per_rank"][f"rank{dist.get_rank()}"]
    from torchtitan.components.checkpointer.utils import canonical_fqn

    return {
        "count": optimizer.count,
        "signed": state["signed"].tolist(),
        "max_grad_norm": optimizer.max_grad_norm,
        "titan_max_norm": trainer.config.training.max_norm,
        "momentum": {k: {n: local(x) for n, x in v.items()} for k, v in state["momentum"].items()},
        "exp_avg": {k: local(v) for k, v in state["exp_avg"].items()},
        "exp_avg_sq": {k: local(v) for k, v in state["exp_avg_sq"].items()},
        "errors": {k: {n: local(x) for n, x in v.items()} for k, v in own.items()},
        "params": {canonical_fqn(n): local(p) for n, p in model.named_parameters()},
        "sent": optimizer.bytes_sent_by_hop,
    }


def adam_state(trainer: Any) -> dict[str, Any]:
    """AdamW's moments and the params' shards on this rank, by param name."""
    from torchtitan.components.checkpointer.utils import canonical_fqn

    (optimizer,) = trainer.optimizers.optimizers
    (model,) = trainer.model_parts
    moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for name, param in model.named_parameters():
        for field, values in moments.items():
            values[canonical_fqn(name)] = local(optimizer.state[param][field])
    params = {canonical_fqn(n): local(p) for n, p in model.named_parameters()}
    return {**moments, "params": params}


def train(
    args: list[str], folder: Path, inspect: Any = fn_state, grads: bool = False
) -> dict[str, Any]:
    """One torchtitan run (``torchtitan.train``'s steps): its losses by step, the warnings it
    raised, ``inspect(trainer)`` after training and, with ``grads``, this rank's ``.grad``
    shards after the first step."""
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args([*args, "--dump_folder", str(folder)])
    record: dict[str, Any] = {"losses": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = config.build()
        log = trainer.metrics_processor.log
        (model,) = trainer.model_parts

        def logged(step: int, loss: float, max_loss: float, *rest: Any, **kwargs: Any) -> None:
            record["losses"][step] = loss
            if grads and "grads" not in record:  # after step(): on HSDP the sum over the replicas
                shards = {canonical_fqn(n): p.grad for n, p in model.named_parameters()}
                record["grads"] = {n: local(g) for n, g in shards.items() if g is not None}
            log(step, loss, max_loss, *rest, **kwargs)

        trainer.metrics_processor.log = logged
        try:
            trainer.train()
            record["state"] = inspect(trainer)
        finally:
            trainer.close()
    record["warnings"] = [str(w.message) for w in caught]
    return record


def refusal(args: list[str], folder: Path) -> str | None:
    """The error with which building a trainer from ``args`` stops, or ``None``."""
    from torchtitan.config import ConfigManager

    try:
        ConfigManager().parse_args([*args, "--dump_folder", str(folder)]).build()
    except Exception as error:  # noqa: BLE001 (the test reads it)
        return f"{type(error).__name__}: {error}"
    return None


def load_refusal(args: list[str], folder: Path) -> str | None:
    """The ``ValueError`` with which a run from ``args`` stops (loading its checkpoint), or
    ``None``."""
    try:
        train(args, folder)
    except ValueError as error:
        return str(error)
    return None


def resume(runs: Path, args: list[str], step: int) -> dict[str, Any]:
    """The run resumed, in a folder of its own, from the full run's checkpoint at ``step``."""
    folder = runs / f"resumed-{step}"
    if dist.get_rank() == 0:
        shutil.copytree(runs / "full" / "checkpoint" / f"step-{step}",
                        folder / "checkpoint" / f"step-{step}")  # fmt: skip
    dist.barrier()
    return train(args, folder)


def prune(folder: Path, keep: int | None) -> None:
    """Removes a run's checkpoints but the one at step ``keep`` (all of them with ``None``),
    once every rank has finished writing them."""
    dist.barrier()
    if dist.get_rank() == 0:
        for saved in (folder / "checkpoint").glob("step-*"):
            if saved.name != f"step-{keep}":
                shutil.rmtree(saved)
    dist.barrier()


def main(scenario: str, work: Path) -> None:
    install()  # before torchtitan's first import
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    logger.setLevel(logging.WARNING)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0 and not (work / "assets").exists():
        write_assets(work / "assets")
    dist.barrier()
    args = fn_args(scenario, work, world) + (HSDP if scenario == "hsdp" else [])
    args += ["--training.steps", str(STEPS[scenario])]
    runs = work / scenario  # each run's dump folder under it
    results: dict[str, Any] = {}
    if scenario == "fsdp":
        results["refused"] = {
            name: refusal([*args, f"--parallelism.{name}", "2"], runs / "refused")
            for name in REFUSED
        }
    steps = STEPS[scenario]
    results["full"] = train(args, runs / "full", grads=True)
    for step in RESUMES[scenario]:
        results[f"resumed-{step}"] = resume(runs, args, step)
        prune(runs / f"resumed-{step}", keep=steps)
    prune(runs / "full", keep=steps)
    if scenario == "fsdp":
        adam = [*titan_args(work, world), "--training.steps", str(ADAM_STEPS)]
        results["adamw"] = train(adam, runs / "adamw", inspect=adam_state, grads=True)
        start = ["--checkpoint.initial_load_path",
                 str(runs / "adamw" / "checkpoint" / f"step-{ADAM_STEPS}"),
                 "--checkpoint.no-initial_load_model_only"]  # fmt: skip
        warm = fn_args(scenario, work, world) + start
        # loaded and not trained (training.steps is the checkpoint's step), then trained on
        results["warm loaded"] = train(
            [*warm, "--training.steps", str(ADAM_STEPS)], runs / "warm-loaded"
        )
        results["warm"] = train([*warm, "--training.steps", str(WARM_STEPS)], runs / "warm")
        prune(runs / "adamw", keep=None)
        # a job whose last save is model-only cannot go on: refused, naming what resumes
        short = [*fn_args(scenario, work, world), "--checkpoint.last_save_model_only"]
        train([*short, "--training.steps", "1"], runs / "model-only")
        results["model only"] = load_refusal([*short, "--training.steps", "2"], runs / "model-only")
        prune(runs / "model-only", keep=None)
        prune(runs / "warm-loaded", keep=None)
        prune(runs / "warm", keep=None)
    if scenario == "hsdp":  # torchtitan's own HSDP, one step: its summed gradient
        native = [*titan_args(work, world), *HSDP, "--training.steps", "1"]
        results["native"] = train(native, runs / "native", inspect=adam_state, grads=True)
        prune(runs / "native", keep=None)
    torch.save(results, runs / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
