"""The configs that ``--module fn.integrations.torchtitan --config NAME`` reads: every config
function of torchtitan's llama3 registry (``torchtitan.models.llama3.config_registry``:
``llama3_debugmodel``, ``llama3_8b``, ``llama3_70b``, ...) under its own name, its config
turned by :func:`~fn.integrations.torchtitan.onebit_config` into one for
:class:`~fn.integrations.torchtitan.OnebitTrainer` (1-bit Adam with AdamW's ``lr``, ``betas``,
``eps`` and ``weight_decay``; ``--optimizer.<name>`` sets the rest).

Example:
    >>> from fn.integrations.torchtitan import config_registry
    >>> config = config_registry.llama3_debugmodel()
    >>> type(config).__qualname__, config.model_spec.flavor
    ('OnebitTrainer.Config', 'debugmodel')
"""

from __future__ import annotations

from collections.abc import Callable

from torchtitan.models.llama3 import config_registry as llama3

from fn.integrations.torchtitan.trainer import OnebitTrainer, onebit_config

__all__: list[str] = []  # the configs are found by name (__getattr__)


def _names() -> list[str]:
    """The config functions of torchtitan's llama3 registry."""
    return [
        name
        for name, value in vars(llama3).items()
        if callable(value)
        and not name.startswith("_")
        and getattr(value, "__module__", None) == llama3.__name__
    ]


def __getattr__(name: str) -> Callable[[], OnebitTrainer.Config]:
    if name not in _names():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    make = getattr(llama3, name)

    def config() -> OnebitTrainer.Config:
        return onebit_config(make())

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan's {name} with fn's 1-bit Adam (onebit_config)."
    return config


def __dir__() -> list[str]:
    return sorted(_names())
