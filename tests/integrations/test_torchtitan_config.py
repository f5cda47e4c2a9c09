"""fn.integrations.torchtitan's configs, in one process: torchtitan's llama3 registry under fn's
module (its command line parsed by torchtitan's ConfigManager), onebit_config's mapping of
AdamW's settings and what it refuses, and check_supported's refusals of the layouts and
settings fn does not run under."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is in the 'torchtitan' extra")
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.models.llama3 import config_registry as llama3  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from fn.integrations.torchtitan import (  # noqa: E402
    OnebitCheckpointManager,
    OnebitTrainer,
    check_supported,
    config_registry,
    onebit_config,
)

MODULE = ["--module", "fn.integrations.torchtitan"]


@dataclass(kw_only=True, slots=True)
class OtherTrainerConfig(Trainer.Config):
    """Another trainer's config (torchft's, say)."""


def test_the_registry_has_every_llama3_config_with_onebit_adam():
    names = dir(config_registry)
    assert {"llama3_debugmodel", "llama3_8b", "llama3_70b"} <= set(names)
    assert all(callable(getattr(llama3, name)) for name in names)
    assert "default_adamw" not in names and "Trainer" not in names  # imported, not configs
    with pytest.raises(AttributeError):
        config_registry.llama3_nonexistent  # noqa: B018
    config = config_registry.llama3_8b()
    titan = llama3.llama3_8b()
    assert isinstance(config, OnebitTrainer.Config)
    assert isinstance(config.checkpoint, OnebitCheckpointManager.Config)
    assert config.model_spec.flavor == titan.model_spec.flavor == "8B"
    assert config.training.steps == titan.training.steps
    assert config.checkpoint.interval == titan.checkpoint.interval
    adamw = titan.optimizer.param_groups[0].optimizer_kwargs
    for name in ("lr", "eps", "weight_decay"):
        assert getattr(config.optimizer, name) == adamw[name], name
    assert tuple(config.optimizer.betas) == tuple(adamw["betas"])
    assert config.parallelism.spmd_backend == "partial_dtensor"
    assert config.training.disable_cuda_graphs
    check_supported(config)
    check_supported(replace(config, training=replace(config.training, max_norm=math.inf)))


def test_the_command_line_sets_fns_settings():
    args = MODULE + ["--config", "llama3_debugmodel", "--optimizer.name", "OnebitLamb"]
    args += ["--optimizer.freeze_step", "auto", "--optimizer.error_dtype", "bfloat16"]
    args += ["--optimizer.exp_avg_mask", "auto", "--optimizer.lr", "0.002"]
    args += ["--optimizer.optimizer_kwargs", "max_coeff", "5", "--training.max_norm", "0.5"]
    config = ConfigManager().parse_args(args)
    optimizer = config.optimizer
    assert (optimizer.name, optimizer.freeze_step, optimizer.error_dtype) == (
        "OnebitLamb",
        "auto",
        "bfloat16",
    )
    assert optimizer.exp_avg_mask == "auto" and optimizer.lr == 0.002
    assert optimizer.optimizer_kwargs == {"max_coeff": 5.0}
    assert config.training.max_norm == 0.5 and optimizer.max_grad_norm is None  # set at start
    assert "replicate" not in config.to_dict()["optimizer"]
    args = MODULE + ["--config", "llama3_debugmodel", "--optimizer.freeze_step", "40"]
    assert ConfigManager().parse_args(args).optimizer.freeze_step == 40


def test_onebit_config_takes_settings_and_refuses_what_fn_cannot_take():
    titan = llama3.llama3_debugmodel()
    config = onebit_config(titan, freeze_step=7, name="OnebitLamb")
    assert (config.optimizer.freeze_step, config.optimizer.name) == (7, "OnebitLamb")
    assert config.optimizer.lr == titan.optimizer.param_groups[0].optimizer_kwargs["lr"]
    assert titan.parallelism.spmd_backend == "spmd_types"  # left as it was
    assert onebit_config(config, freeze_step=9).optimizer.name == "OnebitLamb"

    def groups(*specs: tuple[str, str, dict]) -> OptimizersContainer.Config:
        return OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(pattern=p, optimizer_name=n, optimizer_kwargs=k)
                for p, n, k in specs
            ]  # fmt: skip
        )

    two = groups(
        ("norm", "AdamW", {"lr": 1e-3, "weight_decay": 0.0}), (".*", "AdamW", {"lr": 1e-3})
    )
    same = groups(("norm", "AdamW", {"lr": 1e-3}), (".*", "AdamW", {"lr": 1e-3}))
    assert onebit_config(replace(titan, optimizer=same)).optimizer.lr == 1e-3
    refused = {
        "two groups": replace(titan, optimizer=two),
        "muon": replace(titan, optimizer=groups((".*", "DistMuon", {"lr": 1e-3}))),
        "adam decay": replace(titan, optimizer=groups((".*", "Adam", {"weight_decay": 0.1}))),
        "another trainer": OtherTrainerConfig(model_spec=titan.model_spec),
    }
    for name, config in refused.items():
        with pytest.raises(NotImplementedError, match="fn.integrations.torchtitan"):
            onebit_config(config)
        print(name, "refused")


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"parallelism": {"tensor_parallel_degree": 2}}, NotImplementedError, "tensor parallel"),
        ({"parallelism": {"pipeline_parallel_degree": 2}}, NotImplementedError, "pipeline"),
        ({"parallelism": {"context_parallel_degree": 2}}, NotImplementedError, "context"),
        ({"parallelism": {"expert_parallel_degree": 2}}, NotImplementedError, "expert"),
        ({"parallelism": {"spmd_backend": "spmd_types"}}, NotImplementedError, "spmd_types"),
        ({"training": {"disable_cuda_graphs": False}}, NotImplementedError, "CUDA graphs"),
        ({"training": {"enable_cpu_offload": True}}, NotImplementedError, "cpu_offload"),
        ({"training": {"max_norm": 0.0}}, ValueError, "max_norm must be positive"),
    ],
)
def test_check_supported_refuses(change, error, message):
    config = config_registry.llama3_debugmodel()
    for section, values in change.items():
        setattr(config, section, replace(getattr(config, section), **values))
    with pytest.raises(error, match=message):
        check_supported(config)
    with pytest.raises(error, match=message):  # the trainer, before any process group
        OnebitTrainer(config)
