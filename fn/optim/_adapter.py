"""``FunctionalOptimizer``: any fn transform as a stateful ``torch.optim.Optimizer``.

The policies (gradient communication, flat buffers, mixed precision, non-finite gradients,
``GradScaler``, checkpoints) are described in the docstring of :mod:`fn.optim`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import torch

from fn.base import CompressedOptimizer
from fn.errors import NonFiniteError, check_int
from fn.optim._checkpoint import GatheredErrorFeedback, load, plan_load, save_state
from fn.optim._consensus import (
    SyncCheckSchedule,
    check_in_sync,
    check_same_group,
    group_settings,
    process_comm,
    refuse_unusable,
    vote_on_gradients,
)
from fn.optim._ddp_detection import warn_if_averaged
from fn.optim._step import (
    NONFINITE_GRADIENTS,
    AveragedOverflow,
    GroupRuntime,
    Transform,
    check_fixed_group,
    check_group,
    check_params,
    gather_step_grads,
    is_fixed,
    read_lr,
    split_frozen,
)

_EAGER_STEP = (
    "an fn.optim step runs eagerly: its host-side checks and fused kernels are its boundary in "
    "a compiled training step (call it outside a fullgraph=True function)"
)


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
        local_world_size: the ranks per node that the transform's compressed collectives were
            built with (``None``: flat). Their error feedback is sized by it, so checkpoints
            record it, and one loaded under another value gets its error feedback reset (with a
            warning), as under another world size.

    Building the optimizer and ``add_param_group`` check that every rank built the group the same
    way, and the first ``step()`` (after any ``load_state_dict``) runs :meth:`check_consistency`:
    a mismatch is a ``ValueError`` on every rank, not a hang or diverging ranks.

    The learning rate of each group (``group["lr"]``, so ``torch.optim.lr_scheduler`` works) is
    written into the functional state with ``fn.set_hyperparams`` before every step; it defaults
    to the transform's ``lr`` state field. A transform that schedules its own lr ignores it: a
    group lr set to another value than it showed raises ``ValueError`` at the update given it or
    the next (nothing changed). A ``CompressedOptimizer`` gets ``step=t``, the
    1-based count of the group's updates (skipped steps do not count).

    Buffers: each step donates the group's state from two steps back and its gradient buffer
    (into which the ``.grad`` are copied, and the updates written), never the live state, so
    the group keeps two states and one gradient buffer (README, "Buffer donation").

    Attributes:
        skipped_steps: how many steps were skipped for non-finite gradients.
        last_step_skipped: whether the last ``step()`` made no update: skipped, or a step
            without any gradient (see :meth:`step`).

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
    # every rank's error feedback, on rank 0 after gather_error_feedback()
    _gathered: GatheredErrorFeedback | None = None

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
        local_world_size: int | None = None,
    ) -> None:
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be one of ('raise', 'skip'), got {nonfinite!r}")
        self.comm = process_comm(comm)
        self.local_world_size = local_world_size
        self._fixed = is_fixed(transform, defaults)
        self.flatten = flatten
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.check_every = check_int("check_every", check_every)
        self._sync_checks = SyncCheckSchedule()
        # Whether the first step still has to look for gradients averaged before it (DDP that
        # fn was not told about; fn.optim._ddp_detection): once per optimizer.
        self._averaging_unchecked = True
        self._transform = transform
        self._sync_grads = sync_grads
        self._groups: list[GroupRuntime] = []
        super().__init__(params, dict(defaults or {}))
        # Made here, not where the class is defined: importing fn must not import dynamo
        # (torch.optim's own constructor imports it anyway).
        self._eager_step = torch.compiler.disable(self._step, reason=_EAGER_STEP)

    # ---------------------------------------------------------------- construction

    @property
    def group_runtimes(self) -> list[Any]:
        """Each param group's runtime, in ``param_groups`` order, with its transform,
        hyperparameters, functional state and flat layout (what fn.optim's checkpoints, the
        DeepSpeed import and the DDP detection read; change them through the optimizer's
        methods).

        Example:
            >>> params = [torch.nn.Parameter(torch.zeros(2))]
            >>> opt = fn.optim.FunctionalOptimizer(params, fn.sgd(0.1))
            >>> [runtime.step for runtime in opt.group_runtimes]
            [0]
        """
        return self._groups

    def _make_transform(self, index: int, hyper: dict[str, Any]) -> Transform:
        """The transform of group ``index`` (for subclasses) built from its hyperparameters."""
        return self._transform if self._fixed else self._transform(**hyper)

    def _hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        return read_lr({k: v for k, v in group.items() if k in self.defaults})

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
        options = dict(flatten=self.flatten, sync_grads=self._sync_grads, nonfinite=self.nonfinite)
        options["local_world_size"] = self.local_world_size
        return group_settings(type(self), options, self._transform, self._fixed, group)

    def _build_group(self, index: int) -> None:
        group = self.param_groups[index]
        frozen = split_frozen(index, group)
        # First, before anything that can raise on one rank only: the others would wait for it.
        check_same_group(self.comm, index, self._settings(group), group["params"])
        check_group(index, group, self._fixed)
        hyper = self._hyper(group)
        transform = self._make_transform(index, hyper)
        self._groups.append(
            GroupRuntime(index, group, transform, hyper, self._sync_grads, self.flatten, frozen)
        )

    # ---------------------------------------------------------------- consistency

    def check_consistency(self) -> None:
        """Checks that every rank holds the same params, step counts and hyperparameters (a
        collective: every rank must call it; one pass over the params and one all_gather of seven
        int64 per group).

        Params are compared as closely as the transform declares
        (``CompressedOptimizer.param_agreement``): bit for bit, except 0/1 Adam once its
        variance froze: right after a sync to a relative ``1e-4`` of their sums, not after a
        local step (its ranks differ there by design).

        Raises:
            ValueError: on every rank, naming the groups, what differs and the ranks.
        """
        snapshots = [
            runtime.snapshot(self._settings(group))
            for group, runtime in zip(self.param_groups, self._groups, strict=True)
        ]
        check_in_sync(self.comm, snapshots)

    # ---------------------------------------------------------------- step

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every group, or none: all or nothing (the policies of :mod:`fn.optim`).

        A step that fails or is skipped at any point leaves every group exactly as it was. A
        step at which no param of any group has a gradient (every ``.grad`` is ``None``, after
        the closure if one is given) on any rank is no update: nothing changes on any rank,
        ``last_step_skipped`` becomes ``True`` and ``skipped_steps`` is not counted. Gradients
        that are zero tensors (``zero_grad(set_to_none=False)``) are gradients.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            fn.NonFiniteError: ``nonfinite="raise"`` and a gradient is non-finite on some
                rank, or a group's averaged gradient overflows (on every rank). Nothing was
                changed.
            ValueError: an invalid hyperparameter in ``param_groups`` (also a group lr that a
                transform scheduling its own ignores), a gradient the optimizer
                cannot take (sparse) on some rank (on every rank), or (at the first step after
                building or ``load_state_dict``) ranks whose step counts, hyperparameters or
                params differ. Nothing was changed.
            RuntimeError: a param no longer lives in the flat buffer, or a param frozen when its
                group was built now requires a gradient. Nothing was changed.
        """
        if torch.compiler.is_compiling():  # dynamo traces this: break the graph here
            return self._eager_step(closure)
        return self._step(closure)  # eager: without the wrapper's per-call cost

    @torch.no_grad()
    def _step(self, closure: Callable[[], Any] | None) -> Any:
        """:meth:`step`, run eagerly also inside a compiled function (``_eager_step``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        check_params(self._groups, self.param_groups)
        if self._sync_checks.start_due:  # until the first update (a no-op step does not count)
            self.check_consistency()
        plans = self._plans()
        mine = gather_step_grads(self._groups, grad_scale, self._checks_gradients)
        vote = vote_on_gradients(
            self.comm, mine.counted, found_inf, bool(mine.unusable), mine.holding, mine.device
        )
        if not vote.holding:
            # no param of any group has a gradient on any rank: no update
            self.last_step_skipped = True
            return loss
        self._sync_checks.start_due = False
        refuse_unusable(self.comm, vote, mine.unusable)
        if self._averaging_unchecked:
            self._averaging_unchecked = False
            warn_if_averaged(self, mine.grads)
        if vote.nonfinite > 0:
            return self._skip(loss, found_inf, NONFINITE_GRADIENTS)
        grads = self._step_gradients(plans, mine.grads)
        # the last group, after which nothing can reject the step any more, applies its update
        # in the same step (GroupRuntime.update's apply); the others' are added by commit()
        last = len(self._groups) - 1
        try:
            results = [
                runtime.update(self.comm, index, transform, lr, g, apply=index == last)
                for index, (runtime, (transform, _, lr), g) in enumerate(
                    zip(self._groups, plans, grads, strict=True)
                )
            ]
        except AveragedOverflow as err:
            return self._skip(loss, found_inf, str(err))
        self.last_step_skipped = False
        for runtime, plan, result in zip(self._groups, plans, results, strict=True):
            runtime.commit(plan, result)
        if self._sync_checks.due_after_update(self.check_every, self._groups):
            self.check_consistency()
        return loss

    def _step_gradients(
        self, plans: list[tuple[Transform, dict[str, Any], float | None]], grads: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The gradients the groups' updates take, from every group's gathered gradient, once
        the ranks' vote passed (here ``grads`` themselves; a subclass may clip them)."""
        del plans
        return grads

    def _skip(self, loss: Any, found_inf: torch.Tensor | None, message: str) -> Any:
        """Records a skipped step (``nonfinite="skip"`` or a ``GradScaler`` overflow), or raises
        ``NonFiniteError(message)`` under ``nonfinite="raise"``."""
        self.last_step_skipped = True
        if self.nonfinite == "raise" and found_inf is None:
            raise NonFiniteError(message)
        self.skipped_steps += 1
        return loss

    def _plans(self) -> list[tuple[Transform, dict[str, Any], float | None]]:
        """Every group's next transform, hyperparameters and checked lr (``GroupRuntime.plan``:
        the transform rebuilt where a hyperparameter other than lr changed); nothing is
        committed.

        Raises:
            ValueError: a hyperparameter set through ``param_groups`` is invalid (naming the
                group).
        """
        if self._fixed:
            for index, group in enumerate(self.param_groups):
                check_fixed_group(index, group)
        return [
            runtime.plan(index, group, self._hyper(group), partial(self._make_transform, index))
            for index, (group, runtime) in enumerate(
                zip(self.param_groups, self._groups, strict=True)
            )
        ]

    def next_update_compressed(self) -> list[bool]:
        """Per param group: whether the next ``step()`` runs a compressed update.

        The schedule of a ``CompressedOptimizer`` at the group's next update count, a host-side
        function of the count (with ``freeze_step="auto"``, of the switch decided in the
        group's state: the same on every rank); ``False`` for a
        ``GradientTransformation``. ``fn.ddp.register`` asks this before every backward pass.
        Changed group hyperparameters count, as in ``step()`` (nothing is committed). An invalid
        one is ``step()``'s to raise (``fn.ddp``'s hook asks this inside DDP's backward, where
        nothing may raise): the schedule is then that of the transforms of the last update, the
        same on every rank.

        Returns:
            One bool per param group.
        """
        try:
            transforms = [transform for transform, _, _ in self._plans()]
        except ValueError:
            transforms = [runtime.transform for runtime in self._groups]
        return [
            isinstance(transform, CompressedOptimizer)
            and transform.compressed_at(runtime.step + 1, runtime.state)
            for transform, runtime in zip(transforms, self._groups, strict=True)
        ]

    def warn_if_never_compressed(self, updates: int, source: str = "this run") -> bool:
        """Warns (``UserWarning``) when a param group's ``CompressedOptimizer`` would make no
        compressed update among the first ``updates`` updates (e.g. a ``freeze_step`` beyond a
        run's length; with ``freeze_step="auto"``, a ``max_updates`` that is not below it while
        the switch is undecided): every update might be a dense allreduce, Adam's traffic, and
        the run would save no bandwidth. ``fn.integrations`` calls it with the run's length.

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
            and runtime.transform.first_compressed_update(updates, runtime.state) is None
        ]
        if idle:
            warnings.warn(
                f"fn.optim: param groups {idle} make no compressed update within {source} "
                f'({updates} updates), or with freeze_step="auto" none is certain: until one '
                "is, every update is a dense allreduce, as plain Adam's, and saves no "
                "bandwidth; set freeze_step (0/1 Adam: var_freeze_step), or "
                f"freeze_step=fn.AutoFreeze(max_updates=...), below {updates}",
                stacklevel=2,
            )
        return bool(idle)

    def reset_state(self) -> None:
        """Restarts every group's state as a fresh optimizer's: the transform's initial state
        (moments, error feedback), step count 0. The params, their fp32 masters and the groups'
        hyperparameters are kept, and the first ``step()`` after it checks the ranks'
        consistency again. No collective: every rank of ``comm`` resets alike, or that check
        fails (``fn.diloco.DiLoCo`` resets a worker's inner optimizer, of one rank, when the
        worker sat out an outer step).

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.adam(lr=1e-3),
            ...                                    comm=fn.collectives.Local())
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> opt.step()
            >>> opt.reset_state()
            >>> opt.state_dict()["state"][0]["step"]
            0
        """
        for group, runtime in zip(self.param_groups, self._groups, strict=True):
            runtime.restore(runtime.initial_state(runtime.transform), 0, group)
        self._gathered = None
        self._sync_checks.start_due = True

    # ---------------------------------------------------------------- checkpoints

    def gather_error_feedback(self) -> None:
        """Sends every rank's error feedback to rank 0, where the next :meth:`state_dict` (until
        the next update) holds it, so that a checkpoint saved by rank 0 alone resumes every rank
        bit for bit. A collective call: every rank must call it.

        Hugging Face ``Trainer``, ``accelerate`` and PyTorch Lightning save only rank 0's
        optimizer state and load it on every rank; ``fn.integrations`` calls this before their
        saves. Without it, a rank that loads another rank's state resets its error feedback to
        zero (with a warning).

        Memory: rank 0 holds ``W`` ranks' error-feedback buffers until the next update, and
        every rank reads all ``W`` when it loads the checkpoint: for 1-bit Adam over ``n``
        params about ``4 n (W + 1)`` bytes (``W`` worker errors of ``n`` fp32 elements and ``W``
        server errors of ``n / W``), i.e. ``W + 1`` times the params in fp32. The transfer goes
        around fn's byte counters. Nothing happens on one rank.
        """
        self._gathered = GatheredErrorFeedback.gather(self.comm, self._groups)

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state in ``torch.optim``'s layout.

        Returns:
            ``{"state": {group_index: record}, "param_groups": [...]}`` where ``param_groups``
            holds each group's hyperparameters and param indices (as ``torch.optim``) and a
            record is ``{"step": int, "world_size": int, "rank": int, "local_world_size": int
            (hierarchical collectives only), "shapes": [[...], ...],
            "functional": {path: tensor}, "master": fp32 tensor (fp16/bf16 params only),
            "error_feedback_by_rank": [...] (on rank 0 after gather_error_feedback() only)}``;
            ``functional`` is the functional state flattened by pytree key path
            (e.g. ``".worker_error"``). The tensors are the live (never mutated) state tensors,
            the master is a copy, taken after writes to the params are synced into it as before a
            step.
        """
        # the hooks of torch.optim.Optimizer.register_state_dict_pre_hook / _post_hook, as
        # torch.optim runs them
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        if self._gathered is not None and not self._gathered.current(self._groups):
            self._gathered = None  # stale: free it (it holds every rank's error feedback)
        state = save_state(self, self._gathered)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state)
            state = state if returned is None else returned
        return state

    def _refuse_unloadable(self, state_dict: Mapping[str, Any]) -> None:
        """Raises ``ValueError`` for a checkpoint that a subclass cannot load, before anything
        is checked or loaded (none here)."""

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict`: the functional state (error feedback included), the step
        counts, the fp32 master copies and the groups' hyperparameters.

        ``exp_avg_mask``, the comm and ``local_world_size`` come from the constructor, not the
        checkpoint. Error feedback saved with another world size or ``local_world_size``, or on
        another rank without every rank's (:meth:`gather_error_feedback`), is reset to zero
        with a warning (the "Checkpoints" policy of :mod:`fn.optim`). All or nothing: every
        group's record is checked before any is loaded.

        Raises:
            ValueError: a checkpoint that does not fit: a different number of groups or params,
                different param shapes, a functional state of another structure (another
                optimizer's), an invalid hyperparameter, a non-finite value or a negative second
                moment; the message names the group and the field. Nothing was changed.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        self._refuse_unloadable(state_dict)
        load(plan_load(state_dict, self, self._hyper, self._make_transform), self)
        self._sync_checks.start_due = True
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)
