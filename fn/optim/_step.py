"""One param group of the ``torch.optim`` adapter at run time, and its update.

A :class:`GroupRuntime` holds the group's flat buffers, transform, hyperparameters, functional
state and step count. ``FunctionalOptimizer.step()`` checks everything first (the params,
:func:`check_params`; this rank's gradients, :func:`gather_step_grads`, on which the ranks then
vote), then asks every group for its updates and new state (:meth:`GroupRuntime.update`, which
writes only the group's gradient buffer and spare state), and commits all groups last
(:meth:`GroupRuntime.commit`): a step that fails or is skipped in any group leaves every group as
it was.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy
import torch
from torch.utils import _pytree as pytree

from fn.base import (
    CompressedOptimizer,
    GradientTransformation,
    get_hyperparam,
    set_hyperparams,
    update_and_apply,
)
from fn.errors import NonFiniteError, all_finite
from fn.optim._consensus import GroupSnapshot
from fn.optim._flat import FlatGroup
from fn.tree import storages_of, tree_map

Transform = GradientTransformation | CompressedOptimizer
# What a step with a non-finite gradient on some rank raises under nonfinite="raise".
NONFINITE_GRADIENTS = (
    "fn.optim: non-finite gradients (NaN or Inf) on some rank; no update was made and the "
    "optimizer state is unchanged (nonfinite='skip' skips such steps)"
)
# Group keys that are not hyperparameters of the transform.
_GROUP_META = frozenset({"params", "param_names", "initial_lr"})
# The hyperparameters users and schedulers set in torch.optim's groups (OneCycleLR's "max_lr"
# and the like are a scheduler's own records, not settings of the optimizer)
_TORCH_HYPERPARAMETERS = frozenset(
    {"betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad", "maximize"}
)


class AveragedOverflow(NonFiniteError):
    """A group's gradient averaged over the ranks (or a quantity the transform derives from it)
    is non-finite: a step to skip under ``nonfinite="skip"``, the same on every rank."""


class GroupRuntime:
    """The runtime of one param group: flat buffers, transform, functional state, step count,
    and the params left out because they were frozen (``requires_grad=False``) when it was
    built. ``flatten`` (the optimizer's): whether the transform sees one flat leaf (else
    per-param views).

    Double buffering: ``spare``, the state before ``state`` (or ``None``), is the next update's
    donated state, never the live ``state``; ``exported`` holds weak references to the tensors
    handed out by ``state_dict()``, which are never donated.
    """

    def __init__(
        self,
        index: int,
        group: dict[str, Any],
        transform: Transform,
        hyper: dict[str, Any],
        sync_grads: bool | None,
        flatten: bool,
        frozen: list[torch.Tensor],
    ) -> None:
        """The runtime of param group ``index`` (its trainable params, checked already; the
        ``frozen`` ones left out), with the transform's initial state; sets ``group["lr"]`` to
        the state's lr if it has none. ``sync_grads``: the optimizer's (``None``: only a
        ``GradientTransformation``'s gradients are averaged by the adapter).

        Raises:
            ValueError: the group sets an lr, but the transform has no lr state field.
        """
        if sync_grads is None:
            sync_grads = not isinstance(transform, CompressedOptimizer)
        self.flat = FlatGroup(group["params"])
        self.flatten = flatten
        self.frozen = frozen
        self.transform = transform
        self.hyper = hyper
        self.sync = sync_grads
        self.state: Any = self.initial_state(transform)
        self.spare: Any = None
        self.exported: list[weakref.ref] = []
        self.step = 0
        # The lr written into the state at the last update (None: no update since the build,
        # a load or a reset), and the group's lr as the runtime itself showed it (None: the
        # group set one): what tells a group lr that a scheduling transform ignores.
        self.lr_given: float | None = None
        self.lr_own: float | None = None
        try:
            own = _shortest_float(get_hyperparam(self.state, "lr"))
        except KeyError:
            if "lr" in group:
                raise ValueError(
                    f"param group {index} sets lr, but the transform has no lr state field"
                ) from None
        else:
            if "lr" not in group:
                group["lr"] = self.lr_own = own

    def initial_state(self, transform: Transform) -> Any:
        """``transform``'s initial state for the group's params (its master)."""
        return transform.init(self.flat.tree(self.flat.master, self.flatten))

    def state_structure(self, transform: Transform) -> pytree.TreeSpec:
        """The structure of ``transform``'s initial state, built from meta tensors (no memory:
        a scheduler may change a hyperparameter at every step) where its ``init`` runs on them.
        """
        tree = self.flat.tree(self.flat.master, self.flatten)
        try:
            return pytree.tree_structure(transform.init(tree_map(_on_meta, tree)))
        except Exception:  # an init that reads values (a user's transform): on the real ones
            return pytree.tree_structure(transform.init(tree))

    def plan(
        self,
        index: int,
        group: Mapping[str, Any],
        hyper: dict[str, Any],
        make_transform: Callable[[dict[str, Any]], Transform],
    ) -> tuple[Transform, dict[str, Any], float | None]:
        """The group's next transform (rebuilt with ``make_transform`` when a hyperparameter
        other than lr changed), its hyperparameters ``hyper`` (as ``group`` sets them) and its
        checked lr; nothing is committed.

        Raises:
            ValueError: a hyperparameter set through ``param_groups`` is invalid or changes the
                state's structure (naming the group).
        """
        lr = lr_value(index, group["lr"]) if "lr" in group else None
        if lr is not None:
            self.refuse_ignored_lr(index, lr)
        changed = {k for k in hyper if k != "lr" and hyper[k] != self.hyper.get(k)}
        if not changed:
            return self.transform, self.hyper, lr
        values = ", ".join(f"{k}={hyper[k]!r}" for k in sorted(changed))
        try:
            transform = make_transform(hyper)
            structure = self.state_structure(transform)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"fn.optim: param group {index} sets {values}: {err}; no update was made"
            ) from err
        # against a fresh state of the live transform: the live state's own structure can
        # differ by phase (1-bit Adam's momentum is packed signs once compressed)
        if structure != self.state_structure(self.transform):
            raise ValueError(
                f"fn.optim: param group {index} sets {values}, which gives the transform a state "
                "of another structure than the group's (e.g. momentum from 0 to non-zero): "
                "such a change needs a new optimizer; no update was made"
            )
        return transform, hyper, lr

    def refuse_ignored_lr(self, index: int, lr: float) -> None:
        """Refuses a group lr that the transform does not use: one that schedules its own
        (``fn.adam(lr=schedule)``) replaces at every update the lr written into its state.

        That shows as a state lr other than the one the last update was given. Only a group lr
        set by someone (a user, a ``torch.optim.lr_scheduler``, a Trainer), now (``lr``) or at
        the last update, is refused; the lr the runtime itself showed is not. The state is read
        on the host only then.

        Raises:
            ValueError: naming the group and the lr that is or was ignored.
        """
        given = self.lr_given
        if given is None or (lr == self.lr_own and given == self.lr_own):
            return
        used = get_hyperparam(self.state, "lr")
        if torch.equal(used, torch.full_like(used, given)):
            return
        ignored = lr if given == self.lr_own else given
        raise ValueError(
            f"fn.optim: param group {index} sets lr={ignored!r}, but its transform schedules its "
            f"own learning rate (its last update used {_shortest_float(used.flatten()[0])} "
            "instead of the lr it was given), so the group's lr is ignored: give the transform "
            "a constant lr to drive it from param_groups (a torch.optim.lr_scheduler, a "
            "Trainer's scheduler), or leave the group's lr as the optimizer set it; no update "
            "was made"
        )

    def param_agreement(self) -> float | None:
        """How closely the ranks' params agree after the group's last update (``check_in_sync``'s
        ``tolerance``): as its ``CompressedOptimizer`` declares, else bit for bit."""
        if isinstance(self.transform, CompressedOptimizer):
            return self.transform.param_agreement(self.step)
        return 0.0

    def snapshot(self, settings: Mapping[str, str]) -> GroupSnapshot:
        """What ``check_in_sync`` compares of the group, its params synced with their master
        first; ``settings`` describes the group (``group_settings``)."""
        self.flat.sync_master()
        described = "\n".join(f"{k}: {v}" for k, v in settings.items())
        return GroupSnapshot(self.step, described, self.flat.master, self.param_agreement())

    def donation(self) -> Any:
        """The donated state of the next update: ``spare`` with every leaf that shares memory
        with the live state, the flat buffers or an exported tensor replaced by an empty
        tensor (which fits no result, so the update allocates that one); ``None`` without a
        spare."""
        if self.spare is None:
            return None
        self.exported = [ref for ref in self.exported if ref() is not None]
        exported = [ref() for ref in self.exported]
        flat = self.flat
        kept = storages_of((self.state, flat.master, flat.model, flat.grads, exported))

        def leaf(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not storages_of(x).isdisjoint(kept):
                return torch.empty(0, dtype=x.dtype, device=x.device)
            return x

        return pytree.tree_map(leaf, self.spare)

    def restore(self, state: Any, step: int, group: Mapping[str, Any]) -> None:
        """Makes ``state`` the live state at update count ``step`` (a load or a reset), with no
        spare; ``group``'s lr counts as the runtime's own from here."""
        self.state, self.spare, self.step = state, None, step
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = lr.item()
        self.lr_given = None
        self.lr_own = float(lr) if isinstance(lr, (int, float)) else None

    def export(self, record: Any) -> None:
        """Notes the tensors of ``record`` (handed out by ``state_dict()``): never donated."""
        self.exported += [
            weakref.ref(x) for x in pytree.tree_leaves(record) if isinstance(x, torch.Tensor)
        ]

    def commit(self, plan: tuple[Transform, dict[str, Any], Any], result: tuple[Any, Any]) -> None:
        """Adds the updates of :meth:`update`'s ``result`` to the params and makes its plan's
        transform and hyperparameters and its new state live (the old live state the spare),
        counting the update; releases the gradient buffer if the new state kept it."""
        updates, state = result
        self.flat.add(updates)  # None (applied already): only cast into the params
        self.transform, self.hyper, self.lr_given = plan
        self.spare, self.state = self.state, state
        self.step += 1
        if not storages_of(state).isdisjoint(storages_of(self.flat.grads)):
            self.flat.release_grads()

    def update(
        self,
        comm: Any,
        index: int,
        transform: Transform,
        lr: float | None,
        g: torch.Tensor,
        *,
        apply: bool = False,
    ) -> tuple[Any, Any]:
        """The group's updates and new state, writing only the gradient buffer ``g`` and the
        spare state (donated), never the live state; with ``apply`` (once the group has a spare)
        the update is added to the params' master in the same step (``fn.update_and_apply``) and
        the updates returned are ``None``.

        Args:
            comm: the optimizer's communicator.
            index: the group's index (for the messages).
            transform: the transform of this update (rebuilt if a hyperparameter changed).
            lr: the group's learning rate, written into the state; ``None``: the state's own.
            g: the group's gathered (and unscaled) flat gradient.
            apply: add the update to the params' master in the same step.

        Returns:
            ``(updates, state)``.

        Raises:
            AveragedOverflow: the gradient averaged over the ranks is non-finite (the same on
                every rank: they all hold the same average), or the transform rejected a
                non-finite value (before writing anything).
            ValueError: ``lr`` is given but the transform has no lr state field.
        """
        if self.sync and comm.world_size > 1 and g.numel() > 0:
            g = comm.all_reduce(g, op="mean")
            if not all_finite(g):
                raise AveragedOverflow(
                    f"fn.optim: param group {index}: the gradient averaged over the ranks is "
                    "non-finite (NaN or Inf) although every rank's gradient is finite (the sum "
                    "overflows); no update was made and the optimizer state is unchanged "
                    "(nonfinite='skip' skips such steps)"
                )
        state = self.state
        if lr is not None:
            try:
                state = set_hyperparams(state, lr=lr)
            except KeyError as err:
                raise ValueError(
                    f"fn.optim: param group {index} sets lr, but its transform has no lr state "
                    "field; no update was made"
                ) from err
        flat = self.flat
        params = flat.tree(flat.master, self.flatten)
        grads = flat.tree(g, self.flatten)
        donated = self.donation()
        try:
            if (
                apply
                and donated is not None
                and storages_of(flat.master).isdisjoint(storages_of(state))
            ):
                _, new_state = update_and_apply(
                    transform, grads, state, params, donate=donated, step=self.step + 1
                )
                return None, new_state
            return transform.update(grads, state, params, step=self.step + 1, donate=donated)
        except NonFiniteError as err:
            raise AveragedOverflow(
                f"fn.optim: param group {index}: {err} (nonfinite='skip' skips such steps)"
            ) from err


class StepGradients(NamedTuple):
    """This rank's gradients at a step, as the ranks' vote takes them (``vote_on_gradients``)."""

    grads: list[torch.Tensor]  # every group's gathered (and unscaled) flat gradient
    counted: list[torch.Tensor]  # those whose non-finite elements the vote counts
    unusable: list[str]  # the gradients the optimizer cannot take, described by group
    holding: bool  # whether some param of some group has a gradient (``.grad`` not ``None``)
    device: torch.device | None  # where the gradients are (``None``: no group)


def gather_step_grads(
    groups: Sequence[GroupRuntime], grad_scale: torch.Tensor | None, checks_gradients: bool
) -> StepGradients:
    """Every group's gradient gathered into its buffer (``FlatGroup.gather_grads``) and divided
    in place by a ``GradScaler``'s scale (a power of two: exact; ``grad_scale=None``: no scaler).

    ``checks_gradients``: whether the transforms reject non-finite gradients themselves, on
    every rank and before any write; then the vote counts none of them (no pass of its own over
    them), nor does it when some gradient is unusable (the step is refused anyway).
    """
    grads = [runtime.flat.gather_grads() for runtime in groups]
    unusable = [
        f"param group {index}: {runtime.flat.unusable}"
        for index, runtime in enumerate(groups)
        if runtime.flat.unusable is not None
    ]
    holding = any(p.grad is not None for runtime in groups for p in runtime.flat.params)
    if grad_scale is not None:
        inv_scale = grad_scale.double().reciprocal().float()
        for g in grads:
            g.mul_(inv_scale.to(g.device))
    counted = [] if checks_gradients or unusable else grads
    return StepGradients(grads, counted, unusable, holding, grads[0].device if grads else None)


def is_fixed(transform: Any, defaults: Mapping[str, Any] | None) -> bool:
    """Whether the adapter's ``transform`` is a transform (else a factory of transforms).

    Raises:
        TypeError: ``transform`` is neither.
        ValueError: ``defaults`` for a transform (they are a factory's).
    """
    fixed = isinstance(transform, (GradientTransformation, CompressedOptimizer))
    if not fixed and not callable(transform):
        raise TypeError(f"transform must be a transform or a factory, got {transform!r}")
    if fixed and defaults:
        raise ValueError("defaults are for a factory transform; this one is fixed")
    return fixed


def check_group(index: int, group: Mapping[str, Any], fixed: bool) -> None:
    """Checks what a new param group sets: with a ``fixed`` transform only an lr, and the lr
    (:func:`lr_value`).

    Raises:
        ValueError: a fixed transform and another hyperparameter than lr, or an invalid lr.
    """
    if fixed:
        extra = set(group) - _GROUP_META - {"lr"}
        if extra:
            raise ValueError(
                f"param group {index} sets {sorted(extra)}, but a fixed transform only takes "
                "a per-group lr; pass a factory and defaults for per-group hyperparameters"
            )
    if "lr" in group:
        lr_value(index, group["lr"])


def check_fixed_group(index: int, group: Mapping[str, Any]) -> None:
    """Checks, before an update, that a group of a fixed transform sets no hyperparameter
    besides lr since it was built (a weight-decay schedule, say): the transform would ignore it.

    Raises:
        ValueError: naming the group and the settings.
    """
    ignored = sorted(set(group) & _TORCH_HYPERPARAMETERS)
    if ignored:
        raise ValueError(
            f"param group {index} sets {ignored}, but a fixed transform only reads a per-group "
            "lr: the setting would be ignored; pass a factory and defaults for per-group "
            "hyperparameters, or remove the keys; nothing was updated"
        )


def split_frozen(index: int, group: dict[str, Any]) -> list[torch.Tensor]:
    """Leaves the params with ``requires_grad=False`` (and their names) out of ``group`` and
    returns them.

    Raises:
        ValueError: a trainable param is on the meta device (it holds no values: the flat
            buffers and the state would have none either), naming the first.
    """
    keep = [i for i, p in enumerate(group["params"]) if p.requires_grad]
    frozen = [p for p in group["params"] if not p.requires_grad]
    group["params"] = [group["params"][i] for i in keep]
    if "param_names" in group:
        group["param_names"] = [group["param_names"][i] for i in keep]
    for i, p in enumerate(group["params"]):
        if p.is_meta:
            names = group.get("param_names")
            name = f" ({names[i]!r})" if names else ""
            raise ValueError(
                f"fn.optim: param group {index}, param {i}{name} of shape {tuple(p.shape)} is on "
                "the meta device; build the optimizer after the model's params hold their "
                "values: model.to_empty(device=...) and its initialization (or loading a "
                "checkpoint)"
            )
    return frozen


def check_params(groups: Sequence[GroupRuntime], param_groups: Sequence[Mapping]) -> None:
    """A step's first checks, on this rank: no param left out as frozen now requires a gradient,
    and every param still lives in its group's flat buffer (``FlatGroup.check_params``).

    Raises:
        RuntimeError: a param that was frozen when its group was built now requires a gradient,
            or as ``FlatGroup.check_params``.
    """
    for index, runtime in enumerate(groups):
        for p in runtime.frozen:
            if p.requires_grad and not any(p is q for g in param_groups for q in g["params"]):
                raise RuntimeError(
                    f"fn.optim: a param of shape {tuple(p.shape)} in param group {index} had "
                    "requires_grad=False when the group was built, so it has no place in the "
                    "group's flat buffer and would never be trained; it now requires a "
                    "gradient: unfreeze params before building the optimizer, or add them "
                    "with add_param_group. No update was made"
                )
    for runtime in groups:
        runtime.flat.check_params()


def lr_value(index: int, lr: Any, where: str = "") -> float:
    """A group's ``lr`` as a Python float.

    As in ``torch.optim``, ``lr`` may be a one-element floating-point tensor (which a scheduler
    then writes in place): its value is read at each step and written into the functional
    state, never the tensor itself.

    Raises:
        ValueError: unless ``lr`` is a finite number >= 0, as a Python number or such a tensor.
    """
    value = lr
    if isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.is_floating_point():
        value = lr.item()
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0:
        place = f" {where}" if where else ""
        raise ValueError(
            f"param group {index}: lr{place} must be a finite Python number >= 0 (or a "
            f"one-element floating-point tensor holding one), got {lr!r}; nothing was changed"
        )
    return float(value)


def read_lr(hyper: dict[str, Any]) -> dict[str, Any]:
    """``hyper`` with a tensor ``lr`` read as a Python float (the factories take numbers)."""
    if isinstance(hyper.get("lr"), torch.Tensor):
        return {**hyper, "lr": hyper["lr"].item()}
    return hyper


def _shortest_float(x: torch.Tensor) -> float:
    """The shortest decimal that rounds to the fp32 ``x`` (``1e-2``, not ``0.009999999776``)."""
    return float(str(numpy.float32(x.item())))


def _on_meta(x: Any) -> Any:
    return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x
