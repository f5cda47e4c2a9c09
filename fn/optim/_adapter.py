"""``FunctionalOptimizer``: any fn transform as a stateful ``torch.optim.Optimizer``.

The policies (gradient communication, flat buffers, mixed precision, non-finite gradients,
``GradScaler``, checkpoints) are described in the docstring of :mod:`fn.optim`.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fn.base import (
    CompressedOptimizer,
    GradientTransformation,
    set_hyperparams,
    update_and_apply,
)
from fn.base import get_hyperparam as _get_hyperparam
from fn.collectives import Local, ProcessGroup, Simulated, SimulatedGroup
from fn.errors import NonFiniteError, all_finite, check_int
from fn.optim._checkpoint import (
    GroupRecord,
    check_master,
    check_state_values,
    checkpoint_parts,
    error_feedback_keys,
    gather_error_feedback,
    own_error_feedback,
    state_from_dict,
    state_to_dict,
)
from fn.optim._consensus import (
    GroupSnapshot,
    check_in_sync,
    check_same_group,
    count_nonfinite,
    settings_of,
)
from fn.optim._flat import FlatGroup
from fn.tree import storages_of

Transform = GradientTransformation | CompressedOptimizer
NONFINITE_POLICIES = ("raise", "skip")
# Group keys that are not hyperparameters of the transform.
_GROUP_META = frozenset({"params", "param_names", "initial_lr"})


def default_comm() -> Any:
    """``ProcessGroup()`` when ``torch.distributed`` is initialized, else ``Local()``.

    Returns:
        The communicator an optimizer built with ``comm=None`` uses.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized but the environment says this
            process is one of several (``WORLD_SIZE`` > 1, as set by ``torchrun``): a
            single-process optimizer there would silently let the ranks drift apart.

    Example:
        >>> fn.optim.default_comm()  # one process, no torch.distributed
        Local()
    """
    if dist.is_available() and dist.is_initialized():
        return ProcessGroup()
    world_size = os.environ.get("WORLD_SIZE", "1")
    if world_size.strip() not in ("", "0", "1"):
        raise RuntimeError(
            f"WORLD_SIZE={world_size} in the environment, but torch.distributed is not "
            "initialized: call torch.distributed.init_process_group() before building the "
            "optimizer (Trainer and Accelerate do it when they are created: build the optimizer "
            "after TrainingArguments/Accelerator), or pass comm=fn.collectives.Local() to run "
            "each process alone on purpose"
        )
    return Local()


class _Group:
    """The runtime of one param group: flat buffers, transform, functional state, step count,
    and the params left out because they were frozen (``requires_grad=False``) when it was
    built.

    Double buffering: ``spare`` is the state before ``state`` (or ``None``), which nothing
    references any more; the next update gets it as its donated state and writes its new state
    into it, so that the live ``state`` is never written and a failed or skipped step leaves it
    as it was. ``exported`` holds weak references to the tensors handed out by ``state_dict()``:
    those are never donated.
    """

    def __init__(self, flat: FlatGroup, transform: Transform, hyper: dict, sync: bool) -> None:
        self.flat = flat
        self.frozen: list[torch.Tensor] = []
        self.transform = transform
        self.hyper = hyper
        self.sync = sync
        self.state: Any = None
        self.spare: Any = None
        self.exported: list[weakref.ref] = []
        self.step = 0

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

    def commit(self, state: Any) -> None:
        """Makes ``state`` the live state and the old live state the spare; releases the
        gradient buffer if the new state kept it."""
        self.spare, self.state = self.state, state
        if not storages_of(state).isdisjoint(storages_of(self.flat.grads)):
            self.flat.release_grads()


class FunctionalOptimizer(torch.optim.Optimizer):
    """Any fn transform as a ``torch.optim.Optimizer`` (the policies: :mod:`fn.optim`).

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
        nonfinite: ``"raise"`` or ``"skip"``: what a step with a non-finite gradient on any rank,
            or with finite gradients whose average overflows, does (nothing changes either way).
        check_every: run :meth:`check_consistency` after every ``check_every``-th step that was
            not skipped (0/1 Adam: at the first sync from then on; ``0``: never; also settable
            later as ``opt.check_every``).

    Building the optimizer and ``add_param_group`` check that every rank built the group the same
    way (optimizer, transform and its settings, hyperparameters, the params' number, shapes and
    dtypes), and the first ``step()`` (after any ``load_state_dict``) checks that the ranks hold
    the same step counts and params (:meth:`check_consistency`), so a mismatch is a
    ``ValueError`` on every rank naming the fields and the ranks rather than a hang or diverging
    ranks.

    The learning rate of each group (``group["lr"]``, so ``torch.optim.lr_scheduler`` works) is
    written into the functional state with ``fn.set_hyperparams`` before every step; it defaults
    to the transform's ``lr`` state field. A ``CompressedOptimizer`` gets ``step=t``, the
    1-based count of the group's updates (skipped steps do not count).

    Buffers: each step donates (``update(..., donate=...)``) the group's state from two steps
    back and the group's gradient buffer, so in steady state a step makes no new full-size
    tensor, and the live state is never written (a failed or skipped step leaves it as it was).
    The group therefore keeps two states and one gradient buffer, into which the params'
    ``.grad`` are copied before every step (the updates are written into it, so it cannot be
    the ``.grad`` themselves, which a step leaves as they were).

    Attributes:
        skipped_steps: how many steps were skipped for non-finite gradients.
        last_step_skipped: whether the last ``step()`` was skipped.

    Example:
        SGD with momentum, ``u = 0.9 u + g`` and ``p = p - 0.1 u``, on a constant gradient:

        >>> import torch
        >>> import fn
        >>> from fn.collectives import Local
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> _ = torch.nn.init.zeros_(model.weight)
        >>> tx = fn.sgd(0.1, momentum=0.9)
        >>> opt = fn.optim.FunctionalOptimizer(model.parameters(), tx, comm=Local())
        >>> for _ in range(2):
        ...     opt.zero_grad()
        ...     model(torch.ones(1, 2)).sum().backward()  # gradient 1 for every weight
        ...     opt.step()
        ...     print(model.weight.detach())
        tensor([[-0.1000, -0.1000]])
        tensor([[-0.2900, -0.2900]])
        >>> opt.state_dict()["state"][0]["step"]
        2
    """

    _step_supports_amp_scaling = True
    # Whether the transform's updates raise NonFiniteError on every rank, before writing
    # anything, when any rank's gradient is not finite: then step() makes no pass of its own
    # over the gradients.
    _checks_gradients = False
    # (the groups' states it was taken from, each group's error feedback by rank), on rank 0
    _gathered: tuple[list[Any], list[tuple[dict[str, torch.Tensor], ...]]] | None = None

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
        check_every: int = 0,
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
        self.check_every = check_int("check_every", check_every)
        self._steps_since_check = 0
        # Whether the ranks' starting point was compared: at the first step() after building or
        # load_state_dict, once the weights and the state that the ranks start from are final.
        self._start_checked = False
        self._transform = transform
        self._sync_grads = sync_grads
        self._groups: list[_Group] = []
        super().__init__(params, dict(defaults or {}))
        self.register_step_post_hook(FunctionalOptimizer._after_step)

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

    def _settings(self, group: dict[str, Any]) -> dict[str, str]:
        """What every rank must build a group with, described (for ``check_same_group``)."""
        cls = type(self)
        settings = {
            "optimizer": f"{cls.__module__}.{cls.__qualname__}",
            "flatten": repr(self.flatten),
            "sync_grads": repr(self._sync_grads),
            "nonfinite": repr(self.nonfinite),
        }
        if isinstance(self._transform, (GradientTransformation, CompressedOptimizer)):
            settings.update(settings_of(self._transform))
        else:
            settings.update(settings_of(self._transform, "transform factory"))
        for key in sorted(k for k in group if k not in ("params", "param_names")):
            value = group[key]
            settings[key] = repr(tuple(value) if isinstance(value, list) else value)
        return settings

    def _build_group(self, index: int) -> None:
        group = self.param_groups[index]
        keep = [i for i, p in enumerate(group["params"]) if p.requires_grad]
        frozen = [p for p in group["params"] if not p.requires_grad]
        group["params"] = [group["params"][i] for i in keep]
        if "param_names" in group:
            group["param_names"] = [group["param_names"][i] for i in keep]
        _check_not_meta(index, group)
        # First, before anything that can raise on one rank only: the others would wait for it.
        check_same_group(self.comm, index, self._settings(group), group["params"])
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

        flat = FlatGroup(group["params"])
        hyper = self._hyper(group)
        transform = self._make_transform(index, hyper)
        sync = (
            not isinstance(transform, CompressedOptimizer)
            if self._sync_grads is None
            else self._sync_grads
        )
        runtime = _Group(flat, transform, hyper, sync)
        runtime.frozen = frozen
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

    # ---------------------------------------------------------------- consistency

    def check_consistency(self) -> None:
        """Checks that every rank holds the same params, step counts and hyperparameters (a
        collective: every rank must call it; one pass over the params and one all_gather of seven
        int64 per group).

        Params are compared as closely as the transform declares that the ranks' params agree
        after the group's last update (``CompressedOptimizer.param_agreement``): bit for bit for
        every fn optimizer (the ranks apply identical updates), except 0/1 Adam once its variance
        froze, whose ranks differ by design between synchronizations: its params are compared
        right after a sync to a relative tolerance of ``1e-4`` of their sums (a sync equalizes
        them up to fp32 rounding), and not after a local step.

        Raises:
            ValueError: on every rank, naming the groups, what differs and the ranks.
        """
        snapshots = []
        for group, runtime in zip(self.param_groups, self._groups, strict=True):
            runtime.flat.sync_master()
            described = self._settings(group)
            settings = "\n".join(f"{k}: {v}" for k, v in described.items())
            snapshots.append(
                GroupSnapshot(
                    runtime.step, settings, runtime.flat.master, _param_agreement(runtime)
                )
            )
        check_in_sync(self.comm, snapshots)

    def _after_step(self, args: Any, kwargs: Any) -> None:
        """The step post-hook: :meth:`check_consistency` every ``check_every`` steps taken."""
        del args, kwargs
        if not self.check_every or self.last_step_skipped:
            return
        self._steps_since_check += 1
        # 0/1 Adam: postponed to the next step after which the ranks' params agree (a sync)
        due = self._steps_since_check >= self.check_every
        if due and all(_param_agreement(runtime) is not None for runtime in self._groups):
            self._steps_since_check = 0
            self.check_consistency()

    # ---------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every group, or none: all or nothing.

        Everything is checked first (the params' storage, frozen params made trainable, every
        group's hyperparameters, the gradients on every rank); then every group's update and new
        state are computed into the group's gradient buffer and spare state (neither the live
        state nor the params are written), the last group's update added to its params in the
        same step (``fn.update_and_apply``) once every other group's exists; the other groups'
        params, the states, the transforms and the step counts of all groups are committed
        last. A step that fails or is skipped at any point leaves every group exactly as it
        was.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            fn.NonFiniteError: ``nonfinite="raise"`` and a gradient is non-finite on some
                rank, or a group's averaged gradient overflows (on every rank). Nothing was
                changed.
            ValueError: an invalid hyperparameter in ``param_groups``, or (at the first step after
                building or ``load_state_dict``) ranks whose step counts, hyperparameters or
                params differ. Nothing was changed.
            RuntimeError: a param no longer lives in the flat buffer, or a param frozen when its
                group was built now requires a gradient. Nothing was changed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        self._check_unfrozen()
        for runtime in self._groups:
            runtime.flat.check_params()
        if not self._start_checked:
            self.check_consistency()
            self._start_checked = True
        plans = [
            self._plan_hyperparams(index, group, runtime)
            for index, (group, runtime) in enumerate(
                zip(self.param_groups, self._groups, strict=True)
            )
        ]
        grads = [runtime.flat.gather_grads() for runtime in self._groups]
        if grad_scale is not None:
            _unscale(grads, grad_scale)
        # Transforms that reject non-finite gradients themselves, on every rank and before
        # any write, need no separate pass over their gradients.
        unchecked = [
            g
            for g, (transform, _, _) in zip(grads, plans, strict=True)
            if not self._checks_gradients
        ]
        if count_nonfinite(self.comm, unchecked, found_inf) > 0:
            return self._skip(
                loss,
                found_inf,
                "fn.optim: non-finite gradients (NaN or Inf) on some rank; no update was made and "
                "the optimizer state is unchanged (nonfinite='skip' skips such steps)",
            )
        # Every group but the last computes its update (writing only its spare state and
        # gradient buffer); the last one, after which nothing can reject the step any more,
        # updates its params in the same step (fn.update_and_apply); then the others add theirs.
        last = len(self._groups) - 1
        try:
            results = [
                self._compute_update(index, runtime, transform, lr, g, apply=index == last)
                for index, (runtime, (transform, _, lr), g) in enumerate(
                    zip(self._groups, plans, grads, strict=True)
                )
            ]
        except _AveragedOverflow as err:
            return self._skip(loss, found_inf, str(err))
        self.last_step_skipped = False
        for runtime, (transform, hyper, _), (updates, state) in zip(
            self._groups, plans, results, strict=True
        ):
            runtime.flat.add(updates)  # None (applied already): only cast into the params
            runtime.transform, runtime.hyper = transform, hyper
            runtime.commit(state)
            runtime.step += 1
        return loss

    def _skip(self, loss: Any, found_inf: torch.Tensor | None, message: str) -> Any:
        """Records a skipped step (``nonfinite="skip"`` or a ``GradScaler`` overflow), or raises
        ``NonFiniteError(message)`` under ``nonfinite="raise"``."""
        self.last_step_skipped = True
        if self.nonfinite == "raise" and found_inf is None:
            raise NonFiniteError(message)
        self.skipped_steps += 1
        return loss

    def _check_unfrozen(self) -> None:
        """Raises ``RuntimeError`` if a param left out as frozen now requires a gradient."""
        for index, runtime in enumerate(self._groups):
            for p in runtime.frozen:
                if p.requires_grad and not any(
                    p is q for g in self.param_groups for q in g["params"]
                ):
                    raise RuntimeError(
                        f"fn.optim: a param of shape {tuple(p.shape)} in param group {index} had "
                        "requires_grad=False when the group was built, so it has no place in the "
                        "group's flat buffer and would never be trained; it now requires a "
                        "gradient: unfreeze params before building the optimizer, or add them "
                        "with add_param_group. No update was made"
                    )

    def _plan_hyperparams(
        self, index: int, group: dict[str, Any], runtime: _Group
    ) -> tuple[Transform, dict[str, Any], float | None]:
        """The group's transform (rebuilt when a hyperparameter other than lr changed), its
        hyperparameters and its checked lr; nothing is committed.

        Raises:
            ValueError: a hyperparameter set through ``param_groups`` is invalid (naming the
                group).
        """
        lr = group.get("lr")
        if "lr" in group:
            _check_lr(index, lr)
        hyper = self._hyper(group)
        changed = {k for k in hyper if k != "lr" and hyper[k] != runtime.hyper.get(k)}
        if not changed:
            return runtime.transform, runtime.hyper, lr
        values = ", ".join(f"{k}={hyper[k]!r}" for k in sorted(changed))
        try:
            transform = self._make_transform(index, hyper)
            fresh = transform.init(runtime.flat.tree(runtime.flat.master, self.flatten))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f"fn.optim: param group {index} sets {values}: {err}; no update was made"
            ) from err
        if pytree.tree_structure(fresh) != pytree.tree_structure(runtime.state):
            raise ValueError(
                f"fn.optim: param group {index} sets {values}, which gives the transform a state "
                "of another structure than the group's (e.g. momentum from 0 to non-zero): "
                "such a change needs a new optimizer; no update was made"
            )
        return transform, hyper, lr

    def _compute_update(
        self,
        index: int,
        runtime: _Group,
        transform: Transform,
        lr: float | None,
        g: torch.Tensor,
        *,
        apply: bool = False,
    ) -> tuple[Any, Any]:
        """The group's updates and new state. Only the gradient buffer ``g`` and the group's
        spare state are written (donated), and with ``apply`` (once the group has a spare) the
        params' master: the update is then added to it in the same step
        (``fn.update_and_apply``, one pass where the transform has a fused step) and the updates
        returned are ``None`` (``FlatGroup.add`` then only casts the master into the params).
        The live state is not written.

        Raises:
            _AveragedOverflow: the gradient averaged over the ranks is non-finite (the same on
                every rank: they all hold the same average), or the transform rejected a
                non-finite value (before writing anything).
        """
        if runtime.sync and self.comm.world_size > 1 and g.numel() > 0:
            g = self.comm.all_reduce(g, op="mean")
            if not all_finite(g):
                raise _AveragedOverflow(
                    f"fn.optim: param group {index}: the gradient averaged over the ranks is "
                    "non-finite (NaN or Inf) although every rank's gradient is finite (the sum "
                    "overflows); no update was made and the optimizer state is unchanged "
                    "(nonfinite='skip' skips such steps)"
                )
        state = runtime.state
        if lr is not None:
            try:
                state = set_hyperparams(state, lr=lr)
            except KeyError as err:
                raise ValueError(
                    f"fn.optim: param group {index} sets lr, but its transform has no lr state "
                    "field; no update was made"
                ) from err
        flat = runtime.flat
        params = flat.tree(flat.master, self.flatten)
        grads = flat.tree(g, self.flatten)
        donated = runtime.donation()
        try:
            if (
                apply
                and donated is not None
                and storages_of(flat.master).isdisjoint(storages_of(state))
            ):
                _, new_state = update_and_apply(
                    transform, grads, state, params, donate=donated, step=runtime.step + 1
                )
                return None, new_state
            return transform.update(grads, state, params, step=runtime.step + 1, donate=donated)
        except NonFiniteError as err:
            raise _AveragedOverflow(
                f"fn.optim: param group {index}: {err} (nonfinite='skip' skips such steps)"
            ) from err

    def next_update_compressed(self) -> list[bool]:
        """Per param group: whether the next ``step()`` runs a compressed update.

        The schedule of a ``CompressedOptimizer`` at the group's next update count, a host-side
        function of the count (the same on every rank); ``False`` for a
        ``GradientTransformation``. ``fn.ddp.register`` asks this before every backward pass.
        Changed group hyperparameters count, as in ``step()`` (nothing is committed).

        Returns:
            One bool per param group.

        Raises:
            ValueError: an invalid hyperparameter in ``param_groups`` (naming the group).
        """
        transforms = [
            self._plan_hyperparams(index, group, runtime)[0]
            for index, (group, runtime) in enumerate(
                zip(self.param_groups, self._groups, strict=True)
            )
        ]
        return [
            isinstance(t, CompressedOptimizer) and t.is_compressed(r.step + 1)
            for t, r in zip(transforms, self._groups, strict=True)
        ]

    def warn_if_never_compressed(self, updates: int, source: str = "this run") -> bool:
        """Warns (``UserWarning``) when a param group's ``CompressedOptimizer`` would make no
        compressed update among the first ``updates`` updates (e.g. a ``freeze_step`` beyond a
        run's length): every update would be a dense allreduce, Adam's traffic, and the run would
        save no bandwidth. ``fn.integrations`` calls it with the run's length.

        Args:
            updates: the number of updates the run makes.
            source: where ``updates`` comes from, for the message (e.g. ``"max_steps"``).

        Returns:
            Whether it warned.
        """
        idle = [
            index
            for index, runtime in enumerate(self._groups)
            if isinstance(runtime.transform, CompressedOptimizer)
            and runtime.transform.first_compressed_update(updates) is None
        ]
        if idle:
            warnings.warn(
                f"fn.optim: param groups {idle} make no compressed update within {source} "
                f"({updates} updates): every update is a dense allreduce, as plain Adam's, and "
                "saves no bandwidth; set freeze_step (0/1 Adam: var_freeze_step) below "
                f"{updates}",
                stacklevel=2,
            )
        return bool(idle)

    # ---------------------------------------------------------------- checkpoints

    def gather_error_feedback(self) -> None:
        """Sends every rank's error feedback to rank 0, where the next :meth:`state_dict` (until
        the next update) holds it, so that a checkpoint saved by rank 0 alone resumes every rank
        bit for bit. A collective call: every rank must call it.

        Hugging Face ``Trainer`` and ``accelerate`` save only rank 0's optimizer state and load
        it on every rank; ``fn.integrations`` calls this before their saves. Without it, a rank
        that loads another rank's state resets its error feedback to zero (with a warning).

        Memory: rank 0 holds ``W`` ranks' error-feedback buffers until the next update, and
        every rank reads all ``W`` when it loads the checkpoint: for 1-bit Adam over ``n``
        params about ``4 n (W + 1)`` bytes (``W`` worker errors of ``n`` fp32 elements and ``W``
        server errors of ``n / W``), i.e. ``W + 1`` times the params in fp32. The transfer goes
        around fn's byte counters. Nothing happens on one rank.
        """
        if self.comm.world_size == 1:
            return
        rank = self.comm.rank
        states = [runtime.state for runtime in self._groups]
        by_rank = [
            gather_error_feedback(
                self.comm.group, rank, state_to_dict(state), error_feedback_keys(state)
            )
            for state in states
        ]
        self._gathered = (states, by_rank) if rank == 0 else None

    def _gathered_error_feedback(self, index: int) -> tuple[dict[str, torch.Tensor], ...] | None:
        """Group ``index``'s gathered error feedback if it was gathered from the current state."""
        if self._gathered is None:
            return None
        states, by_rank = self._gathered
        if not all(s is r.state for s, r in zip(states, self._groups, strict=True)):
            self._gathered = None  # stale: free it
            return None
        return by_rank[index]

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state in ``torch.optim``'s layout.

        Returns:
            ``{"state": {group_index: record}, "param_groups": [...]}`` where ``param_groups``
            holds each group's hyperparameters and param indices (as ``torch.optim``) and a
            record is ``{"step": int, "world_size": int, "rank": int, "shapes": [[...], ...],
            "functional": {path: tensor}, "master": fp32 tensor (fp16/bf16 params only),
            "error_feedback_by_rank": [...] (on rank 0 after gather_error_feedback() only)}``;
            ``functional`` is the functional state flattened by pytree key path
            (e.g. ``".worker_error"``). The tensors are the live (never mutated) state tensors,
            the master is a copy, taken after writes to the params are synced into it as before a
            step (see ``fn.optim._checkpoint.GroupRecord``).
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
            master = runtime.flat.master.clone() if runtime.flat.has_master_copy else None
            record = GroupRecord(
                step=runtime.step,
                world_size=self.comm.world_size,
                shapes=tuple(runtime.flat.shapes),
                functional=state_to_dict(runtime.state),
                master=master,
                rank=getattr(self.comm, "rank", 0),
                error_feedback_by_rank=self._gathered_error_feedback(index),
            )
            state[index] = record.to_dict()
            runtime.exported += [
                weakref.ref(x)
                for x in pytree.tree_leaves(state[index])
                if isinstance(x, torch.Tensor)
            ]
        return {"state": state, "param_groups": param_groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict`: the functional state (error feedback included), the step
        counts, the fp32 master copies and the groups' hyperparameters.

        ``exp_avg_mask`` and the comm come from the constructor, not the checkpoint. A checkpoint
        saved with another world size gets its error-feedback buffers reset for this one (with a
        warning). A checkpoint saved on another rank gives this rank its own error feedback if it
        holds every rank's (:meth:`gather_error_feedback`), else zero error feedback (with a
        warning): never another rank's. All or nothing: every group's record is read and checked
        (structure, shapes, hyperparameters, finite values, non-negative second moments) before
        any is loaded.

        Raises:
            ValueError: a checkpoint that does not fit: a different number of groups or params,
                different param shapes, a functional state of another structure (another
                optimizer's), an invalid hyperparameter, a non-finite value or a negative second
                moment; the message names the group and the field. Nothing was changed.
        """
        saved_groups, records = checkpoint_parts(state_dict, len(self.param_groups))
        plans = []
        worlds, foreign = set(), set()
        for index, (group, saved, runtime) in enumerate(
            zip(self.param_groups, saved_groups, self._groups, strict=True)
        ):
            if index not in records:
                raise ValueError(
                    f"the checkpoint has no state for param group {index} (its 'state' is keyed "
                    f"by {sorted(map(repr, records))[:4]}; fn.optim keys it by group index)"
                )
            record = GroupRecord.from_dict(records[index], index)
            record.check_shapes(index, runtime.flat.shapes)
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {index}: {len(saved['params'])} params in the checkpoint, "
                    f"{len(group['params'])} here"
                )
            if "lr" in saved:
                _check_lr(index, saved["lr"], "in the checkpoint")
            hyper = {k: saved.get(k, v) for k, v in self._hyper(group).items()}
            try:
                transform = self._make_transform(index, hyper)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"param group {index}: the checkpoint's hyperparameters are invalid: {err}"
                ) from err
            tree = runtime.flat.tree(runtime.flat.master, self.flatten)
            functional, reset = own_error_feedback(
                record,
                getattr(self.comm, "rank", 0),
                self.comm.world_size,
                error_feedback_keys(runtime.state),
            )
            if record.world_size != self.comm.world_size:
                worlds.add(record.world_size)
            elif reset:
                foreign.add(record.rank)
            fresh = transform.init(tree) if reset else runtime.state
            state = state_from_dict(index, functional, fresh, reset)
            check_state_values(index, state)
            if runtime.flat.has_master_copy:
                check_master(index, record.master, runtime.flat.numel)
            plans.append((group, saved, runtime, transform, hyper, state, record))
        if worlds:
            warnings.warn(
                f"fn.optim: the checkpoint was saved with world_size {sorted(worlds)}, this run "
                f"has world_size {self.comm.world_size}: the error-feedback buffers are reset to "
                "zero for the new world size",
                stacklevel=2,
            )
        if foreign:
            warnings.warn(
                f"fn.optim: rank {self.comm.rank} loads the optimizer state of rank "
                f"{sorted(foreign)}, which holds only that rank's error feedback: this rank's is "
                "reset to zero (call opt.gather_error_feedback() on every rank before rank 0 "
                "saves, or use fn.integrations, to resume bit for bit)",
                stacklevel=2,
            )
        for group, saved, runtime, transform, hyper, state, record in plans:
            group.update({k: v for k, v in saved.items() if k != "params"})
            runtime.transform, runtime.hyper = transform, hyper
            runtime.state, runtime.spare, runtime.step = state, None, record.step
            runtime.flat.load_master(record.master)
        self._start_checked = False


class _AveragedOverflow(NonFiniteError):
    """A group's gradient averaged over the ranks (or a quantity the transform derives from it)
    is non-finite: a step to skip under ``nonfinite="skip"``, the same on every rank."""


def _check_not_meta(index: int, group: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the first param of ``group`` on the meta device (it holds no
    values: the flat buffers and the state would have none either)."""
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


def _check_lr(index: int, lr: Any, where: str = "") -> None:
    """Raises ``ValueError`` unless ``lr`` is a finite Python number >= 0."""
    number = isinstance(lr, (int, float)) and not isinstance(lr, bool)
    if not number or not math.isfinite(lr) or lr < 0:
        place = f" {where}" if where else ""
        raise ValueError(
            f"param group {index}: lr{place} must be a finite Python number >= 0, got {lr!r}; "
            "nothing was changed"
        )


def _param_agreement(runtime: _Group) -> float | None:
    """How closely the ranks' params of a group agree after its last update (``check_in_sync``'s
    ``tolerance``): as its ``CompressedOptimizer`` declares, else bit for bit."""
    transform = runtime.transform
    if isinstance(transform, CompressedOptimizer):
        return transform.param_agreement(runtime.step)
    return 0.0


def _shortest_float(x: torch.Tensor) -> float:
    """The shortest decimal that rounds to the fp32 ``x`` (``1e-2``, not ``0.009999999776``)."""
    return float(str(numpy.float32(x.item())))


def _unscale(grads: list[torch.Tensor], grad_scale: torch.Tensor) -> None:
    """Divides the gathered gradients by a ``GradScaler``'s scale in place (a power of two:
    exact)."""
    inv_scale = grad_scale.double().reciprocal().float()
    for g in grads:
        g.mul_(inv_scale.to(g.device))
