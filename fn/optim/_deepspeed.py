"""Coming from DeepSpeed: its 1-bit optimizer configs and optimizer checkpoints.

``from_deepspeed(params, config, state_dict=None)`` builds the ``fn.optim`` optimizer that a
DeepSpeed 0.18.x config's ``"optimizer"`` block describes (``OneBitAdam``, ``ZeroOneAdam``,
``OneBitLamb``) and imports the state of DeepSpeed's optimizer. The mapping, key by key, and
every deliberate difference are in ``docs/migrating-from-deepspeed.md``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import zipfile
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fn.collectives import Local
from fn.optim._checkpoint import state_to_dict
from fn.optim._onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from fn.optim._schedulers import read_config
from fn.transforms import ZeroOneAdamSchedule

_ADAM = dict(lr=1e-3, freeze_step=100000, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
_ZERO_ONE = dict(
    {k: v for k, v in _ADAM.items() if k != "freeze_step"},
    var_freeze_step=100000,
    var_update_scaler=16,
    local_step_scaler=32678,
    local_step_clipper=16,
)
_LAMB = dict(
    _ADAM,
    max_coeff=10.0,
    min_coeff=0.01,
    coeff_beta=0.9,
    factor_max=4.0,
    factor_min=0.5,
    factor_threshold=0.1,
)
_MOMENTS = ("exp_avg", "exp_avg_sq")
# 0/1 Adam's schedule counters: DeepSpeed's per-param entry -> fn's state field (and counter)
_ZERO_ONE_COUNTERS = {
    "var_interval": "var_interval",
    "var_counter": "var_counter",
    "local_step_interval": "local_interval",
    "local_step_counter": "local_counter",
}
_LAMB_SCALARS = ("lamb_coeff_freeze", "last_factor", "scaling_coeff")
# DeepSpeed's lower-cased type name: (its spelling, fn's optimizer, the hyperparameters DeepSpeed
# read with its defaults, the per-param state entries of its optimizer)
TYPES: dict[str, tuple[str, type, dict[str, Any], frozenset[str]]] = {
    "onebitadam": ("OneBitAdam", OnebitAdam, _ADAM, frozenset(_MOMENTS)),
    "zerooneadam": (
        "ZeroOneAdam",
        ZeroOneAdam,
        _ZERO_ONE,
        frozenset({*_MOMENTS, "momentum_accumulator", *_ZERO_ONE_COUNTERS, "lrs"}),
    ),
    "onebitlamb": (
        "OneBitLamb",
        OnebitLamb,
        _LAMB,
        frozenset({*_MOMENTS, "exp_avg_sq_fresh", *_LAMB_SCALARS}),
    ),
}
# What DeepSpeed kept per param besides the state above: the step and its error feedback
# (dropped: DeepSpeed's own load_state_dict reset it too) with the padded sizes.
_DROPPED_STATE = frozenset(
    {
        "step",
        "worker_error",
        "server_error",
        "tensor_size",
        "corrected_tensor_size",
        "server_chunk_size",
    }
)
# Optimizer params DeepSpeed took but that have no effect in fn, with the reason.
IGNORED_PARAMS = {
    "cuda_aware": "fn picks its transport from torch.distributed (no MPI/CuPy path)",
    "comm_backend_name": "fn communicates through torch.distributed's process group "
    "(gloo, nccl, xccl, hccl, mpi), see fn.optim.default_comm",
    "bias_correction": "stored but never applied by DeepSpeed's 1-bit optimizers; fn has no "
    "bias correction either",
    "eps_inside_sqrt": "stored but never read by DeepSpeed's 1-bit optimizers: eps is added to "
    "sqrt(v), as in fn",
    "amsgrad": "False is the only value DeepSpeed accepted",
}
# Optimizer params that are a clear error, with the reason.
_REJECTED_PARAMS = {
    "max_grad_norm": "DeepSpeed's engine rejected it too: clip the gradients with "
    "torch.nn.utils.clip_grad_norm_ before opt.step() (DeepSpeed's 'gradient_clipping')",
}
# Top-level config keys, and what to do with them in fn (any other key: not read).
_TOP_LEVEL = {
    "optimizer": None,
    "scheduler": "use fn.optim.scheduler_from_deepspeed(optimizer, config)",
    "gradient_clipping": "call torch.nn.utils.clip_grad_norm_ before opt.step()",
    "fp16": "fn.optim keeps an fp32 master copy of fp16/bf16 params itself; scale the loss with "
    "torch.amp.GradScaler",
    "bf16": "fn.optim keeps an fp32 master copy of bf16 params itself",
    "zero_optimization": "DeepSpeed's 1-bit optimizers ran without ZeRO (stage 0) only",
    "zeropp_loco_param": "ZeRO++'s LoCo error feedback is fn.collectives.loco_allreduce",
}
# fn options that make the imported optimizer follow DeepSpeed's numerics exactly, per fn class:
# each param compressed on its own, and DeepSpeed's frozen-variance rule (no safeguard).
DEEPSPEED_OPTIONS: dict[type, dict[str, Any]] = {
    OnebitAdam: {"flatten": False, "safeguard": False},
    ZeroOneAdam: {"flatten": False, "safeguard": False},
    OnebitLamb: {"safeguard": False},
}


def from_deepspeed(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    config: Mapping[str, Any] | str | os.PathLike,
    *,
    state_dict: Mapping[str, Any] | None = None,
    values: Mapping[str, Any] | None = None,
    **options: Any,
) -> OnebitAdam | ZeroOneAdam | OnebitLamb:
    """The ``fn.optim`` optimizer of a DeepSpeed 0.18.x 1-bit optimizer config, optionally with
    the state of a DeepSpeed checkpoint.

    ``OneBitAdam`` gives :class:`fn.optim.OnebitAdam`, ``ZeroOneAdam``
    :class:`fn.optim.ZeroOneAdam` and ``OneBitLamb`` :class:`fn.optim.OnebitLamb` (type names
    are case-insensitive), with every hyperparameter DeepSpeed read (its defaults where absent)
    and DeepSpeed's numerics (``flatten=False``: each param compressed on its own). Keys without
    effect in fn, and a block without ``"params"`` (DeepSpeed's defaults), are warned about.

    With ``state_dict`` (what DeepSpeed's engine stored under ``"optimizer"`` in
    ``mp_rank_00_model_states.pt``), the training continues as DeepSpeed's uninterrupted run
    would with its error feedback zeroed at the checkpoint: the moments, the update count, the
    0/1 Adam and 1-bit LAMB state and each group's lr are taken over (the limits, e.g. of a
    0/1 Adam checkpoint, are in ``docs/migrating-from-deepspeed.md``).

    Args:
        params: tensors or param-group dicts, in the order given to DeepSpeed (the checkpoint's
            params are matched by position and shape).
        config: a DeepSpeed config (a dict or the path of its JSON file): the whole config or
            just its ``"optimizer"`` block.
        state_dict: DeepSpeed's optimizer state dict, or ``None`` for a fresh optimizer.
        values: values replacing the config's optimizer params, e.g. ``{"lr": 3e-4}`` for a
            Hugging Face ``"auto"`` placeholder.
        **options: keyword arguments of the fn optimizer that DeepSpeed's config does not hold
            (``comm``, ``exp_avg_mask``, ``nonfinite``; ``flatten=True`` for fn's one-leaf
            compression).

    Returns:
        The optimizer (its state imported when ``state_dict`` was given).

    Raises:
        ValueError: no optimizer block, an unknown type or key, an ``"auto"`` placeholder
            without a value, ZeRO stage > 0, or a state dict that does not match the params or
            the optimizer type.
        NotImplementedError: a state dict of DeepSpeed's fp16 optimizer wrapper.

    Example:
        >>> import torch
        >>> import fn
        >>> from fn.collectives import Local
        >>> config = {"optimizer": {"type": "OneBitAdam",
        ...     "params": {"lr": 1e-3, "freeze_step": 400, "cuda_aware": False}}}
        >>> model = torch.nn.Linear(2, 1)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     opt = fn.optim.from_deepspeed(model.parameters(), config, comm=Local())
        >>> type(opt).__name__, opt.param_groups[0]["freeze_step"], opt.flatten
        ('OnebitAdam', 400, False)
        >>> "cuda_aware" in str(caught[0].message)
        True
    """
    config = read_config(config)
    block = config.get("optimizer", config)
    notes = _top_level_notes(config) if "optimizer" in config else []
    kind, hyper, param_notes = _read_block(block, values or {})
    _, cls, _, _ = TYPES[kind]
    notes += param_notes
    if notes:
        warnings.warn(
            "fn.optim.from_deepspeed: DeepSpeed config keys without effect here:\n  "
            + "\n  ".join(notes),
            stacklevel=2,
        )
    if not block.get("params") and not values:
        defaults = ", ".join(f"{k}={v!r}" for k, v in hyper.items())
        warnings.warn(
            f"fn.optim.from_deepspeed: the {block['type']} block has no 'params', so DeepSpeed's "
            f"defaults are used ({defaults}); with freeze_step or var_freeze_step 100000 the "
            "updates stay dense (Adam's traffic) for the first 100000 steps",
            stacklevel=2,
        )
    optimizer = cls(params, **hyper, **{**DEEPSPEED_OPTIONS[cls], **options})
    if state_dict is not None:
        _import_state(optimizer, kind, state_dict)
    return optimizer


def _top_level_notes(config: Mapping[str, Any]) -> list[str]:
    zero = config.get("zero_optimization") or {}
    if isinstance(zero, Mapping) and zero.get("stage", 0) not in (0, "0"):
        raise ValueError(
            f"zero_optimization.stage is {zero.get('stage')!r}: DeepSpeed's 1-bit optimizers ran "
            "without ZeRO only (stage 0); for sharded training use FSDP with fn's collectives"
        )
    return [
        f"{key}: {_TOP_LEVEL.get(key) or 'not read by from_deepspeed'}"
        for key in config
        if key != "optimizer"
    ]


def _read_block(block: Any, values: Mapping[str, Any]) -> tuple[str, dict[str, Any], list[str]]:
    """The type, fn hyperparameters and notes on ignored keys of an optimizer block."""
    if not isinstance(block, Mapping) or "type" not in block:
        raise ValueError(
            "the config has no optimizer block: expected {'optimizer': {'type': ..., "
            "'params': {...}}} or the block itself"
        )
    extra = sorted(set(block) - {"type", "params", "legacy_fusion"})
    if extra:
        raise ValueError(f"optimizer block: unknown keys {extra} (it has 'type' and 'params')")
    name = block["type"]
    kind = str(name).lower()
    if kind not in TYPES:
        raise ValueError(
            f"optimizer type {name!r} is not one of DeepSpeed's 1-bit optimizers "
            f"{[spelling for spelling, *_ in TYPES.values()]} (case-insensitive)"
        )
    spelling, _, defaults, _ = TYPES[kind]
    given = {**dict(block.get("params") or {}), **values}
    unknown = sorted(set(given) - set(defaults) - set(IGNORED_PARAMS) - set(_REJECTED_PARAMS))
    if unknown:
        raise ValueError(
            f"{spelling} params: unknown keys {unknown}; DeepSpeed's {spelling} takes "
            f"{sorted(defaults)} (and {sorted(IGNORED_PARAMS)}, without effect in fn)"
        )
    auto = sorted(k for k, v in given.items() if isinstance(v, str) and v.lower() == "auto")
    if auto:
        raise ValueError(
            f"{spelling} params {auto} are 'auto' (a Hugging Face placeholder): pass their "
            "values, e.g. from_deepspeed(params, config, values={'lr': 3e-4})"
        )
    for key, why in _REJECTED_PARAMS.items():
        if key in given:
            raise ValueError(f"{spelling} params: {key!r} is not supported: {why}")
    amsgrad = given.get("amsgrad", False)
    if amsgrad not in (True, False):
        raise ValueError(f"{spelling} params: amsgrad must be true or false, got {amsgrad!r}")
    if amsgrad:
        raise ValueError(f"{spelling} params: amsgrad=True is not supported (nor by DeepSpeed)")
    notes = [f"optimizer.params.{k}: {IGNORED_PARAMS[k]}" for k in given if k in IGNORED_PARAMS]
    hyper = {k: given.get(k, default) for k, default in defaults.items()}
    betas = hyper["betas"]
    if not isinstance(betas, (list, tuple)):
        raise ValueError(
            f"{spelling} params: betas must be a list of two numbers, e.g. [0.9, 0.999], got "
            f"{betas!r}"
        )
    hyper["betas"] = tuple(betas)
    return kind, hyper, notes


def _import_state(optimizer: Any, kind: str, state_dict: Mapping[str, Any]) -> None:
    """Loads DeepSpeed's optimizer state into the freshly built ``optimizer`` (error feedback
    zero), through ``optimizer.load_state_dict``."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    if "optimizer_state_dict" in state_dict:
        raise NotImplementedError(_FP16_WRAPPER)
    if set(state_dict) != {"state", "param_groups"}:
        raise ValueError(
            f"state_dict has keys {sorted(map(str, state_dict))}; a DeepSpeed optimizer state "
            "dict has 'state' and 'param_groups'"
        )
    spelling, _, _, entries = TYPES[kind]
    ds_groups, ds_state = list(state_dict["param_groups"]), state_dict["state"]
    if len(ds_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the state dict has {len(ds_groups)} param groups, the params given make "
            f"{len(optimizer.param_groups)}"
        )
    records = [
        _group_entries(index, ds_group, group, ds_state, entries, spelling)
        for index, (ds_group, group) in enumerate(
            zip(ds_groups, optimizer.param_groups, strict=True)
        )
    ]
    steps = {s for _, s in records if s is not None}
    if len(steps) > 1:
        raise ValueError(f"the params' DeepSpeed step counters differ: {sorted(steps)}")
    # DeepSpeed's counter counted its gradient-dropping init step
    updates = max(next(iter(steps), 1) - 1, 0)
    saved = optimizer.state_dict()
    for index, ((per_param, step), ds_group) in enumerate(zip(records, ds_groups, strict=True)):
        runtime = optimizer.group_runtimes[index]
        fields = _fields(kind, per_param, runtime.state, updates, optimizer.param_groups[index])
        if optimizer.flatten:  # fn's one-leaf compression: the group's moments as one leaf
            fields = {
                k: torch.cat([x.reshape(-1) for x in v]) if isinstance(v, list) else v
                for k, v in fields.items()
            }
        made = updates if step is not None else 0
        state = runtime.state._replace(count=torch.tensor(made), **fields)
        saved["state"][index]["step"] = made
        saved["state"][index]["functional"] = state_to_dict(state)
        for key in ("lr", "betas"):
            if key in ds_group:
                value = ds_group[key]
                saved["param_groups"][index][key] = tuple(value) if key == "betas" else value
    optimizer.load_state_dict(saved)


def _group_entries(
    index: int,
    ds_group: Mapping[str, Any],
    group: Mapping[str, Any],
    ds_state: Mapping[Any, Any],
    entries: frozenset[str],
    spelling: str,
) -> tuple[list[dict[str, Any]] | None, int | None]:
    """One group's per-param DeepSpeed state (``None``: never stepped) and step counter."""
    ids, params = list(ds_group["params"]), group["params"]
    if len(ids) != len(params):
        raise ValueError(
            f"param group {index}: {len(ids)} params in the state dict, {len(params)} given"
        )
    found = [ds_state.get(i) for i in ids]
    if all(not entry for entry in found):
        return None, None
    if any(not entry for entry in found):
        raise ValueError(
            f"param group {index}: some params have DeepSpeed state and others none (params "
            "without gradients); fn steps every param, so this state cannot be continued"
        )
    steps = set()
    for j, (entry, p) in enumerate(zip(found, params, strict=True)):
        keys = set(entry)
        # (1-bit LAMB has no scaling_coeff before its compression)
        missing = [] if entries - keys == {"scaling_coeff"} else sorted(entries - keys)
        unknown = sorted(keys - entries - _DROPPED_STATE)
        if missing or unknown or "step" not in keys:
            raise ValueError(
                f"param group {index}, param {j}: the state has keys {sorted(keys)}, not those "
                f"of DeepSpeed's {spelling} (missing {missing}, unexpected {unknown}); was it "
                "saved by another optimizer type?"
            )
        if tuple(entry["exp_avg"].shape) != tuple(p.shape):
            raise ValueError(
                f"param group {index}, param {j}: the state is for shape "
                f"{tuple(entry['exp_avg'].shape)}, the param has shape {tuple(p.shape)}"
            )
        steps.add(int(entry["step"]))
    if len(steps) > 1:
        raise ValueError(f"param group {index}: the params' step counters differ: {sorted(steps)}")
    return found, steps.pop()


def _tensors(entries: list[dict[str, Any]], key: str) -> list[torch.Tensor]:
    return [e[key].detach().to(torch.float32, copy=True) for e in entries]


def _scalars(entries: list[dict[str, Any]], key: str, fresh: list[torch.Tensor]) -> list:
    return [
        torch.tensor(float(e[key]), dtype=torch.float32) if key in e else f
        for e, f in zip(entries, fresh, strict=True)
    ]


def _fields(
    kind: str,
    entries: list[dict[str, Any]] | None,
    fresh: Any,
    updates: int,
    group: Mapping[str, Any],
) -> dict[str, Any]:
    """The functional state fields of one group from DeepSpeed's per-param state."""
    if entries is None:
        return {}
    fields = {key: _tensors(entries, key) for key in _MOMENTS}
    if kind == "onebitlamb":
        fields["exp_avg_sq_fresh"] = _tensors(entries, "exp_avg_sq_fresh")
        for key in _LAMB_SCALARS:
            fields[key] = _scalars(entries, key, getattr(fresh, key))
    elif kind == "zerooneadam":
        schedule = ZeroOneAdamSchedule(*(group[key] for key in ZeroOneAdamSchedule._fields))
        counters = schedule.counters(updates + 1)
        for key, field in _ZERO_ONE_COUNTERS.items():
            value = getattr(counters, field)
            saved = {int(e[key]) for e in entries}
            if saved != {value}:
                raise ValueError(
                    f"0/1 Adam's {key} is {sorted(saved)} in the state dict, but its schedule "
                    f"gives {value} after {updates} updates: the config's var_freeze_step, "
                    "var_update_scaler, local_step_scaler or local_step_clipper differ from the "
                    "run's"
                )
            fields[field] = torch.tensor(value)
        lrs = {float(e["lrs"]) for e in entries}
        if len(lrs) > 1:
            raise ValueError(f"0/1 Adam's lrs differ between the params: {sorted(lrs)}")
        fields.update(
            momentum_accumulator=_tensors(entries, "momentum_accumulator"),
            lrs=torch.tensor(lrs.pop(), dtype=torch.float32),
            frozen=torch.tensor(counters.frozen),
        )
    return fields


MODEL_STATES = "mp_rank_00_model_states.pt"
_FP16_WRAPPER = (
    "this is the state of DeepSpeed's fp16 optimizer wrapper (FP16_Optimizer), whose inner 1-bit "
    "optimizer ran on flat fp32 copies of each param group; fn imports the state of a 1-bit "
    "optimizer run without the fp16 wrapper"
)
_WEIGHTS_ONLY_REFUSAL = "Weights only load failed"  # how torch >= 1.13 words it


def convert_checkpoint(
    folder: str | os.PathLike,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    *,
    trust: bool = False,
) -> tuple[dict[str, Any], list[str]]:
    """A DeepSpeed 0.18.x checkpoint of a non-ZeRO 1-bit run, as a file that fn resumes from.

    DeepSpeed's engine wrote ``<save_dir>/<tag>/mp_rank_00_model_states.pt`` (and the tag into
    ``<save_dir>/latest``) holding ``module`` (the model's state dict), ``optimizer`` (the
    optimizer's state dict), ``lr_scheduler``, ``buffer_names``, ``ds_config`` and counters.
    The result holds plain containers and tensors only (``torch.load(weights_only=True)`` reads
    it)::

        {"model": state dict, "optimizer": DeepSpeed's optimizer state without error feedback,
         "config": {"optimizer": ..., "scheduler": ... (resuming at the checkpoint)},
         "step": updates made, "param_names": [...], "deepspeed_version": str}

    and resumes with::

        model.load_state_dict(ckpt["model"])
        opt = fn.optim.from_deepspeed(model.parameters(), ckpt["config"],
                                      state_dict=ckpt["optimizer"])
        sched = fn.optim.scheduler_from_deepspeed(opt, ckpt["config"])  # if there is one

    Args:
        folder: DeepSpeed's ``save_dir`` (its ``latest`` tag is used) or one tag's folder
            (relative or absolute, a ``str`` or ``os.PathLike``; ``~`` is expanded).
        config: the DeepSpeed config, when the checkpoint's ``ds_config`` is not a dict.
        trust: unpickle arbitrary objects (``torch.load(weights_only=False)``); only for
            checkpoints from a trusted source.

    Returns:
        The converted checkpoint and a summary, one line per item.

    Raises:
        FileNotFoundError: no model states file.
        OSError: the model states file cannot be opened (permissions, an I/O error).
        ValueError: a ZeRO or model-parallel checkpoint; a model states file that cannot be
            read (corrupted or truncated), that holds objects a weights-only load refuses
            (without ``trust``) or whose structure is not that of a 1-bit optimizer's model
            states (no ``module``, an optimizer state without ``param_groups``, ...); no usable
            config; or a checkpoint that ``from_deepspeed`` cannot import (the message says
            why).
        NotImplementedError: the optimizer state of DeepSpeed's fp16 wrapper.

    Example:
        A checkpoint of DeepSpeed's layout, saved before the first step:

        >>> import pathlib, tempfile
        >>> model = torch.nn.Linear(2, 1)
        >>> tag = pathlib.Path(tempfile.mkdtemp(), "global_step0")
        >>> tag.mkdir()
        >>> config = {"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 400}}}
        >>> optimizer = {"state": {}, "param_groups": [{"freeze_step": 400, "params": [0, 1]}]}
        >>> torch.save({"module": model.state_dict(), "optimizer": optimizer,
        ...             "ds_config": config}, tag / "mp_rank_00_model_states.pt")
        >>> ckpt, summary = fn.optim.convert_checkpoint(tag)
        >>> ckpt["param_names"], ckpt["step"], summary[1].split(" (")[0]
        (['weight', 'bias'], 0, 'optimizer: OneBitAdam -> fn.optim.OnebitAdam')
    """
    path = _model_states(os.path.abspath(os.path.expanduser(os.fspath(folder))))
    saved = _load_model_states(path, trust)
    ds_config = _checkpoint_config(path, saved, config)
    block = ds_config.get("optimizer", ds_config)
    names, params = _named_params(saved)
    optimizer_state = _without_error_feedback(saved["optimizer"])
    groups = _param_groups(params, optimizer_state["param_groups"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the summary lists what is not used
        optimizer = from_deepspeed(
            groups, {"optimizer": block}, state_dict=optimizer_state, comm=Local()
        )
    updates = optimizer.state_dict()["state"][0]["step"]
    converted_config = {"optimizer": dict(block)}
    summary = [
        f"read {path} (DeepSpeed {saved.get('ds_version', '?')}, "
        f"global step {saved.get('global_steps', '?')})",
        f"optimizer: {block['type']} -> fn.optim.{type(optimizer).__name__} (per-param "
        f"compression), {len(params)} params in {len(groups)} group(s), {updates} updates made "
        "(DeepSpeed's step counter also counted its init step)",
        "error feedback: dropped, it restarts at zero (DeepSpeed's own load reset it too)",
    ]
    scheduler = ds_config.get("scheduler")
    if scheduler is not None:
        iteration = (saved.get("lr_scheduler") or {}).get("last_batch_iteration", -1)
        params_block = dict(scheduler.get("params") or {}, last_batch_iteration=iteration)
        converted_config["scheduler"] = dict(scheduler, params=params_block)
        summary.append(f"scheduler: {scheduler.get('type')} resumes at iteration {iteration}")
    ignored = sorted(set(ds_config) - {"optimizer", "scheduler"})
    if ignored:
        summary.append(f"config keys not converted (see the migration guide): {ignored}")
    return {
        "model": saved["module"],
        "optimizer": optimizer_state,
        "config": converted_config,
        "step": updates,
        "param_names": names,
        "deepspeed_version": str(saved.get("ds_version", "")),
    }, summary


def _load_model_states(path: str, trust: bool) -> dict[str, Any]:
    """The model states file at ``path``, which must hold the optimizer's state."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=not trust)
    except OSError:
        raise
    except Exception as err:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        # A weights-only load words its refusal the same way for a file it cannot parse at all;
        # a refusal proper is of a whole archive, as torch.save writes it.
        if not trust and _WEIGHTS_ONLY_REFUSAL in str(err) and zipfile.is_zipfile(path):
            raise ValueError(
                f"{path} holds objects that a weights-only load refuses ({err}); if the "
                "checkpoint comes from a trusted source, convert it with --trust"
            ) from err
        if trust and isinstance(err, (ImportError, AttributeError)):
            raise ValueError(f"{path} holds objects that cannot be unpickled here: {err}") from err
        brief = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else "no data"
        raise ValueError(
            f"{path} cannot be read: it is corrupted or truncated ({type(err).__name__}: {brief})"
        ) from err
    _check_model_states(path, saved)
    return saved


def _check_model_states(path: str, saved: Any) -> None:
    """Raises ``ValueError`` unless ``saved`` has the structure of the model states of a 1-bit
    optimizer run: a dict with the model's state dict (``module``) and the optimizer's."""

    def refuse(what: str) -> ValueError:
        return ValueError(
            f"{path} is not a DeepSpeed model-states file of a 1-bit optimizer: {what}"
        )

    if not isinstance(saved, Mapping):
        raise refuse(f"it holds a {type(saved).__name__}, not a dict")
    if not isinstance(saved.get("module"), Mapping):
        found = "no 'module'" if "module" not in saved else f"a {type(saved['module']).__name__}"
        raise refuse(f"it has {found} where the model's state dict should be")
    optimizer = saved.get("optimizer")
    if optimizer is None:
        raise ValueError(
            f"{path} has no optimizer state: a ZeRO checkpoint (DeepSpeed's 1-bit optimizers ran "
            "without ZeRO) or one saved without its optimizer"
        )
    if not isinstance(optimizer, Mapping):
        raise refuse(f"its 'optimizer' is a {type(optimizer).__name__}, not a state dict")
    if "optimizer_state_dict" in optimizer:
        raise NotImplementedError(_FP16_WRAPPER)
    missing = [key for key in ("state", "param_groups") if key not in optimizer]
    if missing:
        raise refuse(f"its optimizer state has no {' and no '.join(map(repr, missing))}")
    if not isinstance(optimizer["state"], Mapping):
        raise refuse(f"its optimizer's 'state' is a {type(optimizer['state']).__name__}")
    groups = optimizer["param_groups"]
    if not isinstance(groups, (list, tuple)) or not all(
        isinstance(group, Mapping) and isinstance(group.get("params"), (list, tuple))
        for group in groups
    ):
        raise refuse("its optimizer's 'param_groups' are not a list of dicts with 'params'")


def _checkpoint_config(
    path: str, saved: Mapping[str, Any], config: Mapping[str, Any] | str | os.PathLike | None
) -> dict[str, Any]:
    """The DeepSpeed config of the checkpoint ``saved`` (read from ``path``): ``config`` if
    given, else the checkpoint's ``ds_config`` (a dict, or the path of a file that exists)."""
    ds_config = config if config is not None else saved.get("ds_config")
    if isinstance(ds_config, str) and not os.path.exists(ds_config):
        ds_config = None
    if ds_config is None:
        raise ValueError(
            f"{path} does not hold its DeepSpeed config as a dict: pass the config (--config)"
        )
    return read_config(ds_config)


def _param_groups(
    params: list[torch.Tensor], ds_groups: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``params`` cut into DeepSpeed's param groups, in order (the optimizer took them all)."""
    groups, start = [], 0
    for ds_group in ds_groups:
        count = len(ds_group["params"])
        groups.append({"params": params[start : start + count]})
        start += count
    if start != len(params):
        raise ValueError(
            f"the optimizer has {start} params, the model state {len(params)} (after leaving out "
            "its buffers and tied copies): fn converts runs whose optimizer took all of "
            "model.parameters()"
        )
    return groups


def checkpoint_files(
    folder: str | os.PathLike, config: str | os.PathLike | None = None
) -> list[str]:
    """The files :func:`convert_checkpoint` reads from ``folder`` (and ``config``), of those
    that exist: DeepSpeed's ``latest`` file, the model-states file of the tag it names (or of
    ``folder`` itself) and ``config`` when it is a path. A config that the checkpoint names by
    path (its ``ds_config``) is known only once the model states are read, and is not listed.

    Args:
        folder: DeepSpeed's ``save_dir`` or one tag's folder, as for ``convert_checkpoint``.
        config: the config given to ``convert_checkpoint``: a path, a dict or ``None``.

    Returns:
        The paths, as strings, in the order above.

    Example:
        >>> import pathlib, tempfile
        >>> save_dir = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (save_dir / "latest").write_text("global_step10")
        >>> (save_dir / "global_step10").mkdir()
        >>> _ = (save_dir / "global_step10" / "mp_rank_00_model_states.pt").write_bytes(b"")
        >>> [pathlib.Path(p).relative_to(save_dir).as_posix() for p in checkpoint_files(save_dir)]
        ['latest', 'global_step10/mp_rank_00_model_states.pt']
    """
    folder = os.fspath(folder)
    latest = os.path.join(folder, "latest")
    found = [latest] if os.path.isfile(latest) else []
    with contextlib.suppress(OSError, ValueError):  # convert_checkpoint reports these
        found.append(os.path.join(_tag_folder(folder), MODEL_STATES))
    if isinstance(config, (str, os.PathLike)):
        found.append(os.fspath(config))
    return [path for path in found if os.path.isfile(path)]


def _tag_folder(folder: str) -> str:
    """The folder of the tag that ``folder``'s ``latest`` names, or ``folder`` without one."""
    latest = os.path.join(folder, "latest")
    if not os.path.isfile(latest):
        return folder
    with open(latest, encoding="utf-8") as f:
        return os.path.join(folder, f.read().strip())


def _model_states(folder: str) -> str:
    folder = _tag_folder(folder)
    path = os.path.join(folder, MODEL_STATES)
    if os.path.isfile(path):
        if os.path.isfile(os.path.join(folder, MODEL_STATES.replace("00", "01"))):
            raise ValueError(
                f"{folder} is a model-parallel checkpoint; fn converts mp_rank_00 only"
            )
        return path
    shards = [n for n in os.listdir(folder) if "optim_states" in n] if os.path.isdir(folder) else []
    if shards:
        raise ValueError(
            f"{folder} is a ZeRO checkpoint ({shards[0]}, ...); DeepSpeed's 1-bit optimizers ran "
            "without ZeRO"
        )
    raise FileNotFoundError(f"no {MODEL_STATES} in {folder} (nor a 'latest' file naming a tag)")


def _named_params(saved: Mapping[str, Any]) -> tuple[list[str], list[torch.Tensor]]:
    """The model's params in ``model.parameters()`` order: its state dict without the buffers
    and without tied copies (the same storage under a second name)."""
    buffers = set(saved.get("buffer_names") or [])
    names, params, seen = [], [], set()
    for name, value in saved["module"].items():
        if name in buffers or not isinstance(value, torch.Tensor):
            continue
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if key in seen:
            continue
        seen.add(key)
        names.append(name)
        params.append(torch.nn.Parameter(value.detach().float().clone()))
    return names, params


def _without_error_feedback(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed's optimizer state dict without its error feedback and padded sizes, and without
    ``exp_avg_mask`` (fn takes masks when the optimizer is built, as DeepSpeed's load did)."""
    if "optimizer_state_dict" in state_dict:
        return dict(state_dict)  # from_deepspeed explains why the fp16 wrapper is not imported
    state = {
        index: {k: v for k, v in entry.items() if k not in _DROPPED_STATE or k == "step"}
        for index, entry in state_dict["state"].items()
    }
    groups = [
        {k: v for k, v in group.items() if k != "exp_avg_mask"}
        for group in state_dict["param_groups"]
    ]
    return {"state": state, "param_groups": groups}
