"""A thin stateful ``torch.optim`` adapter over fn's pure transforms.

``FunctionalOptimizer(params, transform)`` runs any ``GradientTransformation`` or
``CompressedOptimizer`` as a ``torch.optim.Optimizer``; ``OnebitAdam``, ``ZeroOneAdam`` and
``OnebitLamb`` are drop-in optimizers with the arguments of ``fn.onebit_adam``,
``fn.zero_one_adam`` and ``fn.onebit_lamb``::

    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=1000)  # under torchrun
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

Policies (the same on every rank, so the ranks always issue the same collectives):

- Gradient communication: the optimizer owns it. Do NOT wrap the model in DDP: each rank's
  ``.grad`` must hold its LOCAL gradient. A ``CompressedOptimizer`` averages the gradients itself
  (dense in warmup, 1-bit once compressed); a plain ``GradientTransformation`` gets the gradients
  averaged by the adapter first (one dense allreduce per group, ``sync_grads``). So anything
  applied to ``.grad`` before ``step()`` (e.g. ``clip_grad_norm_``) sees the local gradient.
- Flat buffers: per param group the params are copied into one contiguous buffer and each
  param's ``.data`` becomes a view of it (build the optimizer after ``model.to(...)``). With
  ``flatten=True`` the transform sees the whole group as ONE 1-D leaf (one collective per group
  and step; right for elementwise rules: Adam, SGD, 1-bit Adam, 0/1 Adam); with
  ``flatten=False`` it sees per-param views of the buffer (needed for per-tensor rules: LAMB's
  trust ratios; 1-bit LAMB fuses its momenta into one collective itself). The flat leaf is not
  padded: the 1-bit allreduce pads it with zeros internally at every call, which its error
  feedback requires (padding carried in the leaf would accumulate state).
- Mixed precision: fp16/bf16 params get an fp32 master copy; the transform state is fp32 and the
  master is cast back into the params after each step. Writes to the params between steps, by any
  route (``p.copy_``, ``model.load_state_dict``, ``p.data.zero_()``, ``p.data.clamp_()``), are
  taken into the master before the next step and ``state_dict()``: elementwise, wherever a param
  differs from its master cast to the param's dtype (elements that still match keep their exact
  fp32 master). This costs one comparison pass over the group's buffer per step.
- Params with ``requires_grad=False`` are left out. A param whose ``.grad`` is ``None`` at a step
  counts as a zero gradient (as DDP's ``find_unused_parameters``): a rank cannot know whether
  another rank had a gradient without an extra collective, and every rank must run the same
  collectives. Momentum and weight decay therefore still move such params.
- Non-finite gradients: the ranks agree on one decision (a 1-element allreduce of the count of
  non-finite gradient elements). ``nonfinite="raise"`` (default) raises ``ValueError`` on every
  rank, ``"skip"`` skips the step; either way nothing changes (params, state, error feedback,
  step count). A step driven by ``torch.amp.GradScaler`` always skips on overflow (that is the
  scaler's protocol; it then lowers its scale).
- ``GradScaler``: the optimizer declares ``_step_supports_amp_scaling``: ``scaler.step(opt)``
  always calls ``opt.step()``, which unscales the gradients itself (its ``.grad`` stay scaled)
  and makes the overflow decision global. (Without this, a rank that overflowed alone would skip
  ``step()`` and leave the others waiting in a collective.) Each rank's scaler still updates its
  scale from its local overflow flag; scales are powers of two, so the unscaled gradients do not
  depend on it.
- Checkpoints: ``state_dict()`` holds, per group, the host-side step count, the whole functional
  state (error feedback included) as a flat dict of tensors, and the fp32 master copy; loading it
  into a fresh optimizer continues bit for bit. Only plain containers, tensors and numbers are
  stored, so ``torch.load(weights_only=True)`` reads it. ``state_dict()["state"]`` is keyed by
  group index (the state is per group, not per param), and ``opt.state``, torch's per-param
  dict, stays empty.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fn._flat import FlatGroup
from fn._validation import all_finite
from fn.base import CompressedOptimizer, GradientTransformation, set_hyperparams
from fn.base import get_hyperparam as _get_hyperparam
from fn.collectives import (
    Local,
    ProcessGroup,
    Simulated,
    SimulatedGroup,
    error_feedback_leaves,
)
from fn.transforms import onebit_adam, onebit_lamb, zero_one_adam

__all__ = ["FunctionalOptimizer", "OnebitAdam", "ZeroOneAdam", "OnebitLamb", "default_comm"]

Transform = GradientTransformation | CompressedOptimizer
NONFINITE_POLICIES = ("raise", "skip")
# Group keys that are not hyperparameters of the transform.
_GROUP_META = frozenset({"params", "param_names", "initial_lr"})


def default_comm() -> Any:
    """``ProcessGroup()`` when ``torch.distributed`` is initialized, else ``Local()``."""
    if dist.is_available() and dist.is_initialized():
        return ProcessGroup()
    return Local()


class _Group:
    """The runtime of one param group: flat buffers, transform, functional state, step count."""

    def __init__(self, flat: FlatGroup, transform: Transform, hyper: dict, sync: bool) -> None:
        self.flat = flat
        self.transform = transform
        self.hyper = hyper
        self.sync = sync
        self.state: Any = None
        self.step = 0


class FunctionalOptimizer(torch.optim.Optimizer):
    """Any fn transform as a ``torch.optim.Optimizer`` (see the module docstring for policies).

    Args:
        params: an iterable of tensors or of param-group dicts, as for ``torch.optim``.
        transform: a ``GradientTransformation`` or ``CompressedOptimizer`` used for every group
            (groups may then only set ``lr``), or a factory called as ``transform(**hyper)``
            with each group's hyperparameters (``defaults`` filled in), which allows per-group
            values of every hyperparameter, e.g. ``FunctionalOptimizer(ps, fn.adamw,
            defaults=dict(lr=1e-3, weight_decay=0.01))``. A changed group hyperparameter other
            than ``lr`` rebuilds the group's transform at the next step (the state is kept).
        comm: the communicator; ``None`` gives :func:`default_comm`. A ``CompressedOptimizer``
            must have been built with the same comm. ``Simulated`` is not supported here (the
            adapter runs one rank per process; use the functional API to simulate ranks).
        defaults: the default hyperparameters of a factory ``transform``.
        flatten: the transform sees one flat leaf per group (``True``, for elementwise rules) or
            per-param views (``False``, for per-tensor rules such as ``fn.lamb``).
        sync_grads: average the gradients over the ranks before the transform (one dense
            allreduce per group). ``None``: for a ``GradientTransformation`` yes, for a
            ``CompressedOptimizer`` no (it communicates itself). Pass ``False`` for a
            transform that communicates itself, e.g. ``fn.staged(...)`` or a chain with
            ``fn.collectives.loco_allreduce``.
        nonfinite: ``"raise"`` or ``"skip"``: what a step with a non-finite gradient on any rank
            does (nothing changes either way).

    The learning rate of each group (``group["lr"]``, so ``torch.optim.lr_scheduler`` works) is
    written into the functional state with ``fn.set_hyperparams`` before every step; it defaults
    to the transform's ``lr`` state field. A ``CompressedOptimizer`` gets ``step=t``, the
    1-based count of the group's updates (skipped steps do not count).

    Attributes:
        skipped_steps: how many steps were skipped for non-finite gradients.
        last_step_skipped: whether the last ``step()`` was skipped.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        transform: Transform | Callable[..., Transform],
        comm: Any = None,
        *,
        defaults: Mapping[str, Any] | None = None,
        flatten: bool = True,
        sync_grads: bool | None = None,
        nonfinite: str = "raise",
    ) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        comm = default_comm() if comm is None else comm
        if isinstance(comm, (Simulated, SimulatedGroup)):
            raise TypeError(
                "fn.optim runs one rank per process: use Local() or ProcessGroup(); simulate "
                "ranks with the functional API (fn.collectives.simulate)"
            )
        is_transform = isinstance(transform, (GradientTransformation, CompressedOptimizer))
        if not is_transform and not callable(transform):
            raise TypeError(f"transform must be a transform or a factory, got {transform!r}")
        if is_transform and defaults:
            raise ValueError("defaults are for a factory transform; this one is fixed")
        self.comm = comm
        self.flatten = flatten
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._transform = transform
        self._sync_grads = sync_grads
        self._groups: list[_Group] = []
        super().__init__(params, dict(defaults or {}))

    # ---------------------------------------------------------------- construction

    def _make_transform(self, index: int, hyper: dict[str, Any]) -> Transform:
        """The transform of group ``index`` built from its hyperparameters."""
        del index
        if isinstance(self._transform, (GradientTransformation, CompressedOptimizer)):
            return self._transform
        return self._transform(**hyper)

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k in self.defaults}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group (a collective call under ``ProcessGroup``: every rank must add the same
        shapes). Params with ``requires_grad=False`` are left out."""
        super().add_param_group(param_group)
        try:
            self._build_group(len(self.param_groups) - 1)
        except BaseException:
            self.param_groups.pop()
            raise

    def _build_group(self, index: int) -> None:
        group = self.param_groups[index]
        keep = [i for i, p in enumerate(group["params"]) if p.requires_grad]
        group["params"] = [group["params"][i] for i in keep]
        if "param_names" in group:
            group["param_names"] = [group["param_names"][i] for i in keep]
        if isinstance(self._transform, (GradientTransformation, CompressedOptimizer)):
            extra = set(group) - _GROUP_META - {"lr"}
            if extra:
                raise ValueError(
                    f"param group {index} sets {sorted(extra)}, but a fixed transform only takes "
                    "a per-group lr; pass a factory and defaults for per-group hyperparameters"
                )
        lr = group.get("lr")
        if lr is not None and (isinstance(lr, torch.Tensor) or not isinstance(lr, (int, float))):
            raise TypeError(f"param group {index}: lr must be a Python number, got {lr!r}")
        check_same_shapes(self.comm, index, group["params"])

        flat = FlatGroup(group["params"])
        hyper = self._hyper(group)
        transform = self._make_transform(index, hyper)
        sync = (
            not isinstance(transform, CompressedOptimizer)
            if self._sync_grads is None
            else self._sync_grads
        )
        runtime = _Group(flat, transform, hyper, sync)
        runtime.state = transform.init(flat.tree(flat.master, self.flatten))
        try:
            stored_lr = _shortest_float(_get_hyperparam(runtime.state, "lr"))
        except KeyError:
            stored_lr = None
        if stored_lr is None and "lr" in group:
            raise ValueError(
                f"param group {index} sets lr, but the transform has no lr state field"
            )
        if stored_lr is not None:
            group.setdefault("lr", stored_lr)
        self._groups.append(runtime)

    # ---------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every group (or none, if a gradient is non-finite on some rank).

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            ValueError: ``nonfinite="raise"`` and a gradient is non-finite on some rank (on every
                rank; nothing was changed).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for runtime in self._groups:
            runtime.flat.check_params()
        grads = [runtime.flat.gather_grads() for runtime in self._groups]
        if grad_scale is not None:
            inv_scale = grad_scale.double().reciprocal().float()
            grads = [g * inv_scale.to(g.device) for g in grads]
        if self._count_nonfinite(grads, found_inf) > 0:
            self.last_step_skipped = True
            if self.nonfinite == "raise" and found_inf is None:
                raise ValueError(
                    "fn.optim: non-finite gradients (NaN or Inf) on some rank; no update was "
                    "made and the optimizer state is unchanged (nonfinite='skip' skips such steps)"
                )
            self.skipped_steps += 1
            return loss
        self.last_step_skipped = False
        for index, (group, runtime, g) in enumerate(
            zip(self.param_groups, self._groups, grads, strict=True)
        ):
            self._refresh_transform(index, group, runtime)
            if runtime.sync and self.comm.world_size > 1 and g.numel() > 0:
                g = self.comm.all_reduce(g, op="mean")
            state = runtime.state
            if "lr" in group:
                state = set_hyperparams(state, lr=group["lr"])
            params = runtime.flat.tree(runtime.flat.master, self.flatten)
            t = runtime.step + 1
            updates, state = runtime.transform.update(
                runtime.flat.tree(g, self.flatten), state, params, step=t
            )
            runtime.flat.add(updates)
            runtime.state, runtime.step = state, t
        return loss

    def _count_nonfinite(self, grads: list[torch.Tensor], found_inf: Any) -> int:
        """The number of non-finite gradient elements over all ranks (plus the scaler's flag)."""
        device = grads[0].device if grads else torch.device("cpu")
        count = torch.zeros((), dtype=torch.int64, device=device)
        for g in grads:
            if not all_finite(g):  # one reduction in the common case; the exact count only here
                count = count + (~torch.isfinite(g)).sum().to(device)
        if found_inf is not None:
            count = count + (found_inf.to(device) > 0).to(torch.int64)
        if self.comm.world_size > 1:
            count = self.comm.all_reduce(count, op="sum")
        return int(count)

    def _refresh_transform(self, index: int, group: dict[str, Any], runtime: _Group) -> None:
        """Rebuilds the group's transform when a hyperparameter other than lr changed."""
        hyper = self._hyper(group)
        changed = {k for k in hyper if k != "lr" and hyper[k] != runtime.hyper.get(k)}
        if changed:
            runtime.transform = self._make_transform(index, hyper)
            runtime.hyper = hyper

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state in ``torch.optim``'s layout.

        Returns:
            ``{"state": {group_index: record}, "param_groups": [...]}`` where ``param_groups``
            holds each group's hyperparameters and param indices (as ``torch.optim``) and a
            record is ``{"step": int, "world_size": int, "shapes": [[...], ...],
            "functional": {path: tensor}, "master": fp32 tensor (fp16/bf16 params only)}``;
            ``functional`` is the functional state flattened by pytree key path
            (e.g. ``".worker_error"``). The tensors are the live (never mutated) state tensors,
            the master is a copy, taken after writes to the params are synced into it as before a
            step.
        """
        param_groups, start = [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            param_groups.append(packed)
        state = {}
        for index, runtime in enumerate(self._groups):
            runtime.flat.sync_master()
            record = {
                "step": runtime.step,
                "world_size": self.comm.world_size,
                "shapes": [list(s) for s in runtime.flat.shapes],
                "functional": _state_to_dict(runtime.state),
            }
            if runtime.flat.has_master_copy:
                record["master"] = runtime.flat.master.clone()
            state[index] = record
        return {"state": state, "param_groups": param_groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict`: the functional state (error feedback included), the step
        counts, the fp32 master copies and the groups' hyperparameters.

        ``exp_avg_mask`` and the comm come from the constructor, not the checkpoint. A checkpoint
        saved with another world size gets its error-feedback buffers reset for this one (with a
        warning). Nothing is changed unless the whole checkpoint fits.

        Raises:
            ValueError: a different number of groups or params, different param shapes, or a
                functional state of another structure.
        """
        saved_groups = list(state_dict["param_groups"])
        records = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the checkpoint has {len(saved_groups)} param groups, this optimizer "
                f"{len(self.param_groups)}"
            )
        plans = []
        worlds = set()
        for index, (group, saved, runtime) in enumerate(
            zip(self.param_groups, saved_groups, self._groups, strict=True)
        ):
            record = records[index]
            _check_shapes(index, [tuple(s) for s in record["shapes"]], runtime.flat.shapes)
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {index}: {len(saved['params'])} params in the checkpoint, "
                    f"{len(group['params'])} here"
                )
            hyper = {k: saved.get(k, v) for k, v in self._hyper(group).items()}
            transform = self._make_transform(index, hyper)
            tree = runtime.flat.tree(runtime.flat.master, self.flatten)
            reset = int(record["world_size"]) != self.comm.world_size
            if reset:
                worlds.add(int(record["world_size"]))
            fresh = transform.init(tree) if reset else runtime.state
            state = _state_from_dict(index, record["functional"], fresh, reset)
            plans.append((group, saved, runtime, transform, hyper, state, record))
        if worlds:
            warnings.warn(
                f"fn.optim: the checkpoint was saved with world_size {sorted(worlds)}, this run "
                f"has world_size {self.comm.world_size}: the error-feedback buffers are reset to "
                "zero for the new world size",
                stacklevel=2,
            )
        for group, saved, runtime, transform, hyper, state, record in plans:
            group.update({k: v for k, v in saved.items() if k != "params"})
            runtime.transform, runtime.hyper = transform, hyper
            runtime.state, runtime.step = state, int(record["step"])
            runtime.flat.load_master(record.get("master"))


class _OnebitFamily(FunctionalOptimizer):
    """Shared construction of the 1-bit family adapters: per-group transforms with the group's
    hyperparameters, the comm, and the group's part of ``exp_avg_mask``."""

    _factory: Callable[..., CompressedOptimizer]

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        comm: Any,
        exp_avg_mask: Mapping[torch.Tensor, torch.Tensor] | None,
        flatten: bool,
        nonfinite: str,
    ) -> None:
        self._masks = dict(exp_avg_mask or {})
        super().__init__(
            params,
            type(self)._factory,
            comm,
            defaults=defaults,
            flatten=flatten,
            sync_grads=False,
            nonfinite=nonfinite,
        )
        unused = [tuple(m.shape) for p, m in self._masks.items() if not self._has_param(p)]
        if unused:
            raise ValueError(
                f"exp_avg_mask has masks (shapes {unused}) for tensors that are not trainable "
                "params of this optimizer"
            )

    def _has_param(self, p: torch.Tensor) -> bool:
        return any(p is q for group in self.param_groups for q in group["params"])

    def _make_transform(self, index: int, hyper: dict[str, Any]) -> Transform:
        params = self.param_groups[index]["params"]
        return type(self)._factory(**hyper, comm=self.comm, exp_avg_mask=self._group_mask(params))

    def _group_mask(self, params: list[torch.Tensor]) -> Any:
        """The group's masks as the transform's pytree: one flat mask, or per-param masks."""
        masks = []
        for p in params:
            mask = self._masks.get(p)
            if mask is not None:
                try:
                    mask = mask.to(device=p.device, dtype=torch.float32).expand(p.shape)
                except RuntimeError as err:
                    raise ValueError(
                        f"exp_avg_mask of shape {tuple(mask.shape)} does not broadcast to its "
                        f"param's shape {tuple(p.shape)}"
                    ) from err
            masks.append(mask)
        if all(m is None for m in masks):
            return None
        if not self.flatten:
            return masks
        return torch.cat(
            [
                torch.ones(p.numel(), device=p.device) if m is None else m.reshape(-1)
                for p, m in zip(params, masks, strict=True)
            ]
        )


class OnebitAdam(_OnebitFamily):
    """1-bit Adam (``fn.onebit_adam``) as a ``torch.optim.Optimizer``; one flat leaf per group.

    Args:
        params: tensors or param-group dicts; every argument below except ``comm``,
            ``exp_avg_mask`` and ``nonfinite`` can be set per group.
        lr, freeze_step, betas, eps, weight_decay: as ``fn.onebit_adam``.
        non_freeze: the group is never compressed (DeepSpeed's ``non_freeze`` groups).
        comm: ``None`` gives :func:`default_comm`.
        exp_avg_mask: ``{param: mask}``, masks broadcastable to their param's shape, multiplied
            into the momentum after every compressed allreduce.
        nonfinite: ``"raise"`` or ``"skip"`` (see :class:`FunctionalOptimizer`).
    """

    @staticmethod
    def _factory(*, non_freeze: bool, **kwargs: Any) -> CompressedOptimizer:
        return onebit_adam(**kwargs, non_freeze=bool(non_freeze) or None)

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        non_freeze: bool = False,
        *,
        comm: Any = None,
        exp_avg_mask: Mapping[torch.Tensor, torch.Tensor] | None = None,
        nonfinite: str = "raise",
    ) -> None:
        defaults = dict(
            lr=lr,
            freeze_step=freeze_step,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            non_freeze=non_freeze,
        )
        super().__init__(params, defaults, comm, exp_avg_mask, True, nonfinite)


class ZeroOneAdam(_OnebitFamily):
    """0/1 Adam (``fn.zero_one_adam``) as a ``torch.optim.Optimizer``; one flat leaf per group.

    Args:
        params: tensors or param-group dicts; every argument below except ``comm``,
            ``exp_avg_mask`` and ``nonfinite`` can be set per group.
        lr, betas, eps, weight_decay, var_freeze_step, var_update_scaler, local_step_scaler,
            local_step_clipper: as ``fn.zero_one_adam``.
        comm: ``None`` gives :func:`default_comm`.
        exp_avg_mask: ``{param: mask}`` (see :class:`OnebitAdam`).
        nonfinite: ``"raise"`` or ``"skip"``.

    Between synchronizations the ranks' params differ by design (local steps).
    """

    _factory = staticmethod(zero_one_adam)

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        *,
        comm: Any = None,
        exp_avg_mask: Mapping[torch.Tensor, torch.Tensor] | None = None,
        nonfinite: str = "raise",
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            var_freeze_step=var_freeze_step,
            var_update_scaler=var_update_scaler,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
        )
        super().__init__(params, defaults, comm, exp_avg_mask, True, nonfinite)


class OnebitLamb(_OnebitFamily):
    """1-bit LAMB (``fn.onebit_lamb``) as a ``torch.optim.Optimizer``.

    The transform sees per-param views of the group's flat buffer (trust ratios are per tensor);
    it fuses all momenta into one compressed allreduce itself. Warmup steps make one dense
    allreduce per param.

    Args:
        params: tensors or param-group dicts; every argument below except ``comm``,
            ``exp_avg_mask`` and ``nonfinite`` can be set per group.
        lr, freeze_step, betas, eps, weight_decay, max_coeff, min_coeff, coeff_beta,
            factor_max, factor_min, factor_threshold: as ``fn.onebit_lamb``.
        comm: ``None`` gives :func:`default_comm`.
        exp_avg_mask: ``{param: mask}`` (see :class:`OnebitAdam`).
        nonfinite: ``"raise"`` or ``"skip"``.
    """

    _factory = staticmethod(onebit_lamb)

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        *,
        comm: Any = None,
        exp_avg_mask: Mapping[torch.Tensor, torch.Tensor] | None = None,
        nonfinite: str = "raise",
    ) -> None:
        defaults = dict(
            lr=lr,
            freeze_step=freeze_step,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
        )
        super().__init__(params, defaults, comm, exp_avg_mask, False, nonfinite)


# -------------------------------------------------------------------- helpers


def check_same_shapes(comm: Any, index: int, params: list[torch.Tensor]) -> None:
    """Raises the same ``ValueError`` on every rank if the ranks' params of group ``index``
    differ in number, shape or dtype (two small all_gathers; nothing with one rank).

    Args:
        comm: the communicator.
        index: the group's index (for the message).
        params: this rank's params of the group.
    """
    if comm.world_size == 1:
        return
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    rows = [[dtypes.index(p.dtype) if p.dtype in dtypes else -3, p.dim(), *p.shape] for p in params]
    # on the params' device, like all of the optimizer's traffic (NCCL takes only GPU tensors)
    device = params[0].device if params else torch.device("cpu")
    size = torch.tensor([len(rows), max((len(r) for r in rows), default=0)], device=device)
    sizes = comm.all_gather(size).cpu()  # [W, 2]: params, longest row
    counts = [int(n) for n in sizes[:, 0]]
    for rank in range(1, comm.world_size):
        if counts[rank] != counts[0]:
            raise ValueError(
                f"fn.optim: param group {index} has {counts[0]} trainable params on rank 0 "
                f"but {counts[rank]} on rank {rank}; every rank must build the optimizer "
                "over the same model"
            )
    n_rows, width = (int(x) for x in sizes.amax(0))
    if n_rows == 0:
        return
    table = torch.full((n_rows, width), -2, dtype=torch.int64)
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
    tables = comm.all_gather(table.to(device)).cpu()  # [W, n_rows, width]
    for i in range(n_rows):
        for rank in range(1, comm.world_size):
            if not torch.equal(tables[rank, i], tables[0, i]):
                raise ValueError(
                    f"fn.optim: param group {index}, param {i} differs across ranks: "
                    f"{_describe(tables[0, i], dtypes)} on rank 0 but "
                    f"{_describe(tables[rank, i], dtypes)} on rank {rank}"
                )


def _describe(row: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> str:
    code, ndim = int(row[0]), int(row[1])
    shape = tuple(int(d) for d in row[2 : 2 + ndim])
    dtype = dtypes[code] if 0 <= code < len(dtypes) else "other dtype"
    return f"shape {shape} ({dtype})"


def _check_shapes(index: int, saved: list[tuple], current: list[tuple]) -> None:
    if len(saved) != len(current):
        raise ValueError(
            f"the checkpoint does not match this model: param group {index} has {len(saved)} "
            f"params in the checkpoint, {len(current)} here"
        )
    for i, (a, b) in enumerate(zip(saved, current, strict=True)):
        if tuple(a) != tuple(b):
            raise ValueError(
                f"the checkpoint does not match this model: param group {index}, param {i} has "
                f"shape {tuple(a)} in the checkpoint, {tuple(b)} here"
            )


def _shortest_float(x: torch.Tensor) -> float:
    """The shortest decimal that rounds to the fp32 ``x`` (``1e-2``, not ``0.009999999776``)."""
    return float(str(numpy.float32(x.item())))


def _state_to_dict(state: Any) -> dict[str, Any]:
    leaves, _ = pytree.tree_flatten_with_path(state)
    return {pytree.keystr(path): leaf for path, leaf in leaves}


def _state_from_dict(index: int, saved: Mapping[str, Any], template: Any, reset: bool) -> Any:
    """The state of ``template``'s structure with ``saved``'s leaves (error feedback from the
    template when ``reset``)."""
    leaves, spec = pytree.tree_flatten_with_path(template)
    keys = [pytree.keystr(path) for path, _ in leaves]
    is_error = error_feedback_leaves(template)
    if set(keys) != set(saved):
        missing, extra = sorted(set(keys) - set(saved)), sorted(set(saved) - set(keys))
        raise ValueError(
            f"param group {index}: the checkpoint's optimizer state has another structure "
            f"(missing {missing[:4]}, unexpected {extra[:4]}); was it saved by another optimizer?"
        )
    out = []
    for (_, leaf), key, error in zip(leaves, keys, is_error, strict=True):
        value = saved[key]
        if reset and error:
            out.append(leaf)
            continue
        if isinstance(leaf, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.shape != leaf.shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"param group {index}: state entry {key!r} has shape {got} in the checkpoint, "
                    f"{tuple(leaf.shape)} here"
                )
            value = value.to(device=leaf.device, dtype=leaf.dtype, copy=True)
        out.append(value)
    return pytree.tree_unflatten(out, spec)
