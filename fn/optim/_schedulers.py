"""DeepSpeed's learning-rate schedules as ``torch.optim.lr_scheduler`` objects.

``scheduler_from_deepspeed(optimizer, config)`` reads a DeepSpeed ``"scheduler"`` block
(``{"type": ..., "params": {...}}``) and returns a :class:`DeepSpeedLR` with DeepSpeed 0.18.9's
formulas for ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and
``LRRangeTest``; any other type is looked up in ``torch.optim.lr_scheduler``, as DeepSpeed did.

Iterations: DeepSpeed's engine stepped its scheduler after every ``optimizer.step()``, its
gradient-dropping init step included, so its real update ``t`` used the schedule at iteration
``t - 1``. A torch scheduler built before training sets the value of iteration 0 and
``scheduler.step()`` after every update advances it: the same real update gets the same value.
DeepSpeed's checkpointed ``last_batch_iteration`` is therefore the iteration to resume at.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from fn.errors import check_int

# type: (DeepSpeed's constructor arguments after the optimizer, with their defaults;
# a value of _REQUIRED has no default)
_REQUIRED = object()
_WARMUP_LR = dict(warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000, warmup_type="log")
SCHEDULES: dict[str, dict[str, Any]] = {
    "WarmupLR": _WARMUP_LR,
    # DeepSpeed's WarmupDecayLR is a WarmupLR (with another warmup_max_lr) that then decays
    "WarmupDecayLR": {"total_num_steps": _REQUIRED, **_WARMUP_LR, "warmup_max_lr": 0.001},
    "WarmupCosineLR": dict(
        total_num_steps=_REQUIRED,
        warmup_min_ratio=0.0,
        warmup_num_steps=1000,
        cos_min_ratio=0.0001,
        warmup_type="log",
    ),
    "OneCycle": dict(
        cycle_min_lr=_REQUIRED,
        cycle_max_lr=_REQUIRED,
        decay_lr_rate=0.0,
        cycle_first_step_size=2000,
        cycle_second_step_size=None,
        cycle_first_stair_count=0,
        cycle_second_stair_count=None,
        decay_step_size=0,
        cycle_momentum=True,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.0,
    ),
    "LRRangeTest": dict(
        lr_range_test_min_lr=1e-3,
        lr_range_test_step_size=2000,
        lr_range_test_step_rate=1.0,
        lr_range_test_staircase=False,
    ),
}
# DeepSpeed's OneCycle wrote (momentum, 0.99) into ``betas``: it replaced beta2 by 0.99
_ONE_CYCLE_BETA2 = 0.99


def _warmup_gamma(i: int, num_steps: int, kind: str) -> float:
    """How far warmup ``WarmupLR``-style schedules are at iteration ``i < num_steps``."""
    if kind == "linear":
        return i / num_steps
    return math.log(i + 1) / math.log(num_steps)


class DeepSpeedLR(torch.optim.lr_scheduler.LRScheduler):
    """One of DeepSpeed 0.18.9's LR schedules (and ``OneCycle``'s momentum cycle).

    With ``i = last_epoch`` (0 after construction, +1 per :meth:`step`), ``N`` the warmup steps
    (at least 2), ``T`` the total steps and ``base`` the group's lr at construction:

    - ``WarmupLR``: ``min + (max - min) * g`` with ``g = log(i + 1) / log(N)`` (``"log"``) or
      ``i / N`` (``"linear"``) while ``i < N``, else ``g = 1``; ``max`` defaults to ``base``.
    - ``WarmupDecayLR``: as ``WarmupLR``, then ``g = max(0, (T - i) / max(1, T - N))``.
    - ``WarmupCosineLR``: ``base * r`` with ``r = r0 + (1 - r0) g`` in warmup, then
      ``r = max(0, c + (1 - c) (1 + cos(pi (i - N + 1) / (T - N))) / 2)``.
    - ``OneCycle``: a triangle from ``cycle_min_lr`` up to ``cycle_max_lr`` (over
      ``cycle_first_step_size`` iterations) and back, then
      ``min / (1 + rate * k / decay_step_size)`` at ``k`` iterations after the cycle; the
      momentum (``betas[0]``) runs the opposite way between ``cycle_max_mom`` and
      ``cycle_min_mom``, and ``betas[1]`` is set to 0.99 (as DeepSpeed did).
      DeepSpeed never used its ``cycle_*_stair_count`` arguments.
    - ``LRRangeTest``: ``min * (1 + rate * (i + 1) / step_size)`` (the quotient floored with
      ``staircase``).

    Args:
        optimizer: the optimizer (any ``torch.optim.Optimizer``).
        kind: one of ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``,
            ``LRRangeTest``.
        params: the schedule's DeepSpeed arguments (missing ones get DeepSpeed's defaults); a
            ``last_batch_iteration`` >= 0 resumes at that iteration.

    Raises:
        ValueError: an unknown kind or argument, a missing required argument, or a per-group
            list of the wrong length.

    Example:
        >>> import torch
        >>> import fn
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> sched = fn.optim.DeepSpeedLR(opt, "WarmupLR", {"warmup_max_lr": 0.01,
        ...     "warmup_num_steps": 4, "warmup_type": "linear"})
        >>> lrs = []
        >>> for _ in range(6):
        ...     lrs.append(round(opt.param_groups[0]["lr"], 4))
        ...     opt.step()
        ...     sched.step()
        >>> lrs
        [0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01]
    """

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, params: Mapping[str, Any]):
        if kind not in SCHEDULES:
            raise ValueError(f"unknown DeepSpeed scheduler {kind!r}; fn has {sorted(SCHEDULES)}")
        params = dict(params)
        resume = params.pop("last_batch_iteration", -1)
        unknown = sorted(set(params) - set(SCHEDULES[kind]))
        if unknown:
            raise ValueError(
                f"scheduler {kind}: unknown params {unknown}; DeepSpeed's {kind} takes "
                f"{sorted(SCHEDULES[kind])} and last_batch_iteration"
            )
        values = {**SCHEDULES[kind], **params}
        missing = sorted(k for k, v in values.items() if v is _REQUIRED)
        if missing:
            raise ValueError(f"scheduler {kind}: the params {missing} are required")
        check_int("last_batch_iteration", resume, minimum=-1)
        self.kind = kind
        self.values = values
        groups = len(optimizer.param_groups)
        self.lows: list[float] = []
        self.highs: list[float] | None = None
        if kind in ("WarmupLR", "WarmupDecayLR"):
            high = values["warmup_max_lr"]
            self.lows = _per_group(values["warmup_min_lr"], groups, "warmup_min_lr")
            # None: the first group's lr at construction, for every group (as DeepSpeed)
            self.highs = None if high is None else _per_group(high, groups, "warmup_max_lr")
            self.num_steps = max(2, values["warmup_num_steps"])
        elif kind == "WarmupCosineLR":
            self.num_steps = max(2, values["warmup_num_steps"])
        elif kind == "LRRangeTest":
            self.lows = _per_group(values["lr_range_test_min_lr"], groups, "lr_range_test_min_lr")
        elif kind == "OneCycle":
            first = float(values["cycle_first_step_size"])
            second = values["cycle_second_step_size"]
            self.cycle_size = first + (first if second is None else float(second))
            self.rise = first / self.cycle_size
            self.cycle_momentum = bool(values["cycle_momentum"]) and "betas" in optimizer.defaults
        super().__init__(optimizer)
        if resume >= 0:
            self.last_epoch = resume
            self._last_lr = self.get_lr()
            for group, lr in zip(optimizer.param_groups, self._last_lr, strict=True):
                group["lr"] = lr
            self._set_momentum()

    def get_lr(self) -> list[float]:
        """The lr of every group at iteration ``last_epoch``."""
        i, v = self.last_epoch, self.values
        if self.kind in ("WarmupLR", "WarmupDecayLR"):
            if i < self.num_steps:
                gamma = _warmup_gamma(i, self.num_steps, v["warmup_type"])
            elif self.kind == "WarmupLR":
                gamma = 1.0
            else:
                total = v["total_num_steps"]
                gamma = max(0.0, float(total - i) / float(max(1.0, total - self.num_steps)))
            highs = self.highs or [self.base_lrs[0]] * len(self.lows)
            return [lo + (hi - lo) * gamma for lo, hi in zip(self.lows, highs, strict=True)]
        if self.kind == "WarmupCosineLR":
            if i < self.num_steps:
                low = v["warmup_min_ratio"]
                ratio = low + _warmup_gamma(i, self.num_steps, v["warmup_type"]) * (1.0 - low)
            else:
                done = i - self.num_steps + 1
                cosine = 1 + math.cos(math.pi * done / (v["total_num_steps"] - self.num_steps))
                low = v["cos_min_ratio"]
                ratio = max(0.0, low + (1.0 - low) * cosine / 2)
            return [base * ratio for base in self.base_lrs]
        if self.kind == "LRRangeTest":
            interval = (i + 1) / v["lr_range_test_step_size"]
            if v["lr_range_test_staircase"]:
                interval = math.floor(interval)
            increase = 1 + v["lr_range_test_step_rate"] * interval
            return [low * increase for low in self.lows]
        lr, decay = self._one_cycle(v["cycle_min_lr"], v["cycle_max_lr"], "decay_lr_rate")
        return [lr / decay] * len(self.optimizer.param_groups)

    def step(self, epoch: int | None = None) -> None:
        """Advances one iteration (sets every group's lr, and ``OneCycle``'s momentum)."""
        super().step(epoch)
        self._set_momentum()

    def _one_cycle(self, start: float, peak: float, rate: str) -> tuple[float, float]:
        """``OneCycle``'s value, from ``start`` to ``peak`` and back over its triangle (then
        ``start``), and its decay factor ``1 + rate * k / decay_step_size`` (1 in the cycle or
        without decay) at ``k`` iterations after the cycle."""
        v = self.values
        if self.last_epoch < self.cycle_size:
            it = self.last_epoch + 1
            x = 1.0 + it / self.cycle_size - math.floor(1 + it / self.cycle_size)
            scale = x / self.rise if x <= self.rise else (x - 1) / (self.rise - 1)
            return start + (peak - start) * scale, 1.0
        if v["decay_step_size"] == 0 or v[rate] == 0:
            return start, 1.0
        interval = (self.last_epoch - self.cycle_size + 1) / v["decay_step_size"]
        return start, 1 + v[rate] * interval

    def _set_momentum(self) -> None:
        """Sets ``OneCycle``'s momentum of iteration ``last_epoch`` (with ``cycle_momentum``)."""
        if self.kind != "OneCycle" or not self.cycle_momentum:
            return
        v = self.values
        momentum, decay = self._one_cycle(v["cycle_max_mom"], v["cycle_min_mom"], "decay_mom_rate")
        for group in self.optimizer.param_groups:
            group["betas"] = (momentum * decay, _ONE_CYCLE_BETA2)


def _per_group(value: Any, groups: int, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name}: expected {groups} values (one per group), got {value!r}")
        return [float(x) for x in value]
    return [float(value)] * groups


def scheduler_from_deepspeed(
    optimizer: torch.optim.Optimizer, config: Mapping[str, Any] | str | os.PathLike
) -> torch.optim.lr_scheduler.LRScheduler:
    """A DeepSpeed config's LR scheduler as a ``torch.optim.lr_scheduler`` object.

    Call ``scheduler.step()`` after every ``optimizer.step()``, as DeepSpeed's engine did (see
    :class:`DeepSpeedLR` for the formulas and how iterations line up with DeepSpeed's).

    Args:
        optimizer: the optimizer, e.g. from :func:`fn.optim.from_deepspeed`.
        config: a DeepSpeed config (a dict or the path of its JSON file): the whole config or
            just its ``"scheduler"`` block. ``params.last_batch_iteration`` (a DeepSpeed
            checkpoint's ``lr_scheduler["last_batch_iteration"]``) resumes there. ``WarmupLR``
            without ``warmup_max_lr`` and ``WarmupCosineLR`` scale the lr of the whole config's
            ``optimizer.params.lr`` when there is one (what DeepSpeed's engine built the
            scheduler with), else each group's lr.

    Returns:
        A :class:`DeepSpeedLR`, or a ``torch.optim.lr_scheduler`` class's object for a type
        DeepSpeed took from there (e.g. ``"StepLR"``).

    Raises:
        ValueError: no scheduler block, an unknown type or param, an ``"auto"`` placeholder.

    Example:
        >>> import torch
        >>> import fn
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> block = {"type": "WarmupDecayLR", "params": {"total_num_steps": 4,
        ...     "warmup_max_lr": 0.01, "warmup_num_steps": 2, "last_batch_iteration": 3}}
        >>> sched = fn.optim.scheduler_from_deepspeed(opt, {"scheduler": block})
        >>> round(opt.param_groups[0]["lr"], 4)  # iteration 3 of [0, 0.01, 0.01, 0.005, 0]
        0.005
        >>> block = {"type": "StepLR", "params": {"step_size": 10}}  # torch's, by name
        >>> type(fn.optim.scheduler_from_deepspeed(opt, block)).__name__
        'StepLR'
    """
    config = read_config(config)
    block = config.get("scheduler", config)
    if not isinstance(block, Mapping) or "type" not in block:
        raise ValueError("the config has no scheduler block ({'type': ..., 'params': {...}})")
    extra = sorted(set(block) - {"type", "params"})
    if extra:
        raise ValueError(f"scheduler: unknown keys {extra}; a block has 'type' and 'params'")
    kind, params = block["type"], dict(block.get("params") or {})
    auto = sorted(k for k, v in params.items() if v == "auto")
    if auto:
        raise ValueError(
            f"scheduler params {auto} are 'auto' (a Hugging Face placeholder): put the values "
            "into the config"
        )
    if kind not in SCHEDULES:
        torch_class = getattr(torch.optim.lr_scheduler, str(kind), None)
        if not isinstance(torch_class, type):
            raise ValueError(
                f"unknown scheduler type {kind!r}: DeepSpeed's are {sorted(SCHEDULES)}, others "
                "must name a torch.optim.lr_scheduler class"
            )
        return torch_class(optimizer, **params)
    optimizer_block = config.get("optimizer") if "scheduler" in config else None
    base = (optimizer_block or {}).get("params", {}).get("lr")
    if isinstance(base, (int, float)) and not isinstance(base, bool):
        for group in optimizer.param_groups:  # torch's schedulers take base_lrs from here
            group.setdefault("initial_lr", float(base))
    return DeepSpeedLR(optimizer, kind, params)


def read_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A DeepSpeed config from a dict or the path of its JSON file.

    Raises:
        ValueError: the file is not a JSON object, or ``config`` is neither a dict nor a path.
    """
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            try:
                config = json.load(f)
            except json.JSONDecodeError as err:
                raise ValueError(f"{os.fspath(config)!r} is not valid JSON: {err}") from err
    if not isinstance(config, Mapping):
        raise ValueError(f"a DeepSpeed config must be a dict or a JSON path, got {config!r}")
    return dict(config)
