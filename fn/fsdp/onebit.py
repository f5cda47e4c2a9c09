"""1-bit Adam and 1-bit LAMB on a model sharded by FSDP2, the 1-bit allreduce of every FSDP2
module's momentum made once per update in ``step()``: :class:`ShardedOnebitOptimizer` (the
machinery) and :class:`OnebitAdam` (``fn.fsdp.onebit_lamb`` has :class:`~fn.fsdp.OnebitLamb`).

Each FSDP2 module's gradients are one vector ``X`` in FSDP2's layout (``W`` rows, row ``j`` rank
``j``'s shard, each padded to a multiple of ``lcm(W, 8)``), so that chunk ``j`` of
``fn.collectives.compressed_allreduce`` is rank ``j``'s shard. Every micro-batch's
reduce-scatter hands its gradient to the module's ``OnebitModule`` (``fn/fsdp/onebit_module.py``),
which accumulates it; ``step()`` averages it densely (warmup) or runs the collective's phases
on the momentum and keeps it, full size, as its packed signs (compressed), then runs the
per-leaf rule of ``fn.onebit_adam`` (or ``fn.onebit_lamb``) on every shard
(``fn.transforms.onebit_adam_sharded``, ``onebit_lamb_sharded``). The rule, the buffers each
rank holds and the bytes it sends are in docs/algorithms.md, "1-bit Adam and 1-bit LAMB on
FSDP2", and its accumulation and clipping in "Accumulation and clipping on FSDP2 and HSDP".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from fn.base import CompressedOptimizer, apply_updates, set_hyperparams
from fn.collectives import Local, local_shard
from fn.collectives.comm import HOPS
from fn.collectives.dcp import called_by_state_dict_api
from fn.errors import NonFiniteError, user_stacklevel
from fn.fsdp._fsdp2 import reduce_scatters_stopped
from fn.fsdp.onebit_checks import Options, agreed_setup
from fn.fsdp.onebit_gradients import GRAD_CHANGED, checked_totals, first_exchange, gradient_stats
from fn.fsdp.onebit_layout import ModuleLayout, canonical_name, fsdp_groups, module_layout
from fn.fsdp.onebit_masks import module_mask
from fn.fsdp.onebit_mesh import HsdpMesh, ShardMesh
from fn.fsdp.onebit_module import OnebitModule
from fn.fsdp.onebit_reduce_scatter import FailedCollectives, OnebitReduceScatter
from fn.fsdp.onebit_state import (
    StateFormat,
    adam_started,
    checkpoint_template,
    fingerprints,
    not_torch_format,
    onebit_state_dict,
    restored,
)
from fn.fsdp.reduce_scatter import CommCache
from fn.transforms import onebit_adam, onebit_adam_sharded
from fn.transforms.clipping import check_max_norm, clip_factor
from fn.transforms.hyperparameters import bind_arguments, option, signature_with

__all__ = ["OPTIONS", "Input", "OnebitAdam", "ShardedOnebitOptimizer", "ZeroOneAdam"]

Input = tuple[Tensor, Tensor | None, float]  # what a module compresses: (x, grad, beta)

# The optimizers' own options, beside their rule's hyperparameters (exp_avg_mask takes the
# rule's place; the comm is the FSDP2 modules' mesh's)
OPTIONS = (
    option("exp_avg_mask", None, "Mapping[torch.Tensor, torch.Tensor] | str | None"),
    option("nonfinite", "raise", "str"),
    option("replicate", None, "DeviceMesh | None"),
    option("max_grad_norm", None, "float | None"),
    option("accumulate_dtype", torch.float32, "torch.dtype"),
    option("world", None, "torch.distributed.ProcessGroup | None"),
)


class ShardedOnebitOptimizer(torch.optim.Optimizer):
    """What the 1-bit optimizers on FSDP2 share (:class:`OnebitAdam`,
    :class:`~fn.fsdp.OnebitLamb`): what spans the model's FSDP2 modules. Each module's state is
    an ``OnebitModule`` (``fn/fsdp/onebit_module.py``: its layout, packed momentum and errors,
    mask and accumulated gradient), with the reduce-scatter installed on it; the mesh (1-D or
    HSDP) is an object of ``fn/fsdp/onebit_mesh.py``. Here: the rule, the comms, ``step()``
    (the checks of ``fn/fsdp/onebit_gradients.py``, the update's exchange across the ranks,
    then the rule on the shards) and the DCP state dict (``fn/fsdp/onebit_state.py``).

    A subclass names the rule (``sharded_rule``, ``fn.transforms``' rule on the shards, and
    ``replicated_rule``, the rule with one rank), what each module's compressed vector is
    (``_momentum_input``; 1-bit Adam's by default) and its further state fields. It is
    constructed through a subclass, whose arguments are those of :class:`OnebitAdam`.

    Args:
        *args: the subclass's arguments, bound to its ``__signature__``.
        **kwargs: the same, by name.

    Example:
        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(2, 1), mesh=init_device_mesh("cpu", (1,)))
        >>> opt = fn.fsdp.OnebitLamb(model, lr=1e-2, freeze_step=2)
        >>> isinstance(opt, fn.fsdp.ShardedOnebitOptimizer), opt.count
        (True, 0)
        >>> dist.destroy_process_group()
    """

    sharded_rule: Callable[..., CompressedOptimizer]  # fn.transforms' rule on the shards
    replicated_rule: Callable[..., CompressedOptimizer]  # the rule with one rank
    norms_over_shards = False  # whether the sharded rule sums norms over the ranks (comm=)
    # The compressed phase keeps the momentum's fp32 shards in the state (the rule reads the
    # momentum before the update); else only the packed signs hold it.
    keeps_momentum_shards = False
    scalar_fields: tuple[str, ...] = ()  # the rule's per-param 0-dim fields (same on all ranks)
    optional_fields: tuple[str, ...] = ()  # the rule's further per-param shards, maybe None
    adam_start: str | None = None  # why load_adam_state is not built for the rule, or None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.name = f"fn.fsdp.{type(self).__name__}"
        arguments = bind_arguments(self.name, type(self).__signature__, args, kwargs)
        options = Options(**{k: arguments.pop(k) for k in Options._fields if k in arguments})
        model = arguments.pop("model")
        self._setup(model, {**arguments, "betas": _as_pair(arguments["betas"])}, options)

    def _setup(self, model: nn.Module, settings: dict[str, Any], options: Options) -> None:
        rule_name = self.sharded_rule.__name__
        agreed = agreed_setup(self.name, model, settings, options, self._make_rule, rule_name)
        self._auto_mask = isinstance(agreed.masks, str)  # exp_avg_mask="auto"
        self._mask_setting = agreed.mask_setting  # in the checkpoints' settings
        self._world = options.world  # the group the optimizer spans (None: the default)
        self._comms = CommCache(None)
        self.comm = self._comms(agreed.found[0][1][0][1].device_mesh.get_group(0))
        self._mesh = self._mesh_of(options.replicate)
        # step()'s checks over world's ranks, on a group of their own: a rank still in its
        # micro-batches (FSDP2's all-gathers, the user's collectives) never meets them in one
        # collective, which gloo aborts on when the sizes differ
        group = dist.new_group(agreed.world_ranks, use_local_synchronization=True)
        self._checks = self._comms(group)
        self.error_dtype, self._max_grad_norm = options.error_dtype, options.max_grad_norm
        # the next update freezes the variance though past freeze_step: a start from Adam's
        # state (load_adam_state) at a count past it
        self._freeze_due = False
        self.rank = self.comm.rank
        world_size, multiple = self.comm.world_size, self._mesh.multiple
        layouts = [module_layout(n, ps, world_size, multiple) for n, ps in agreed.found]
        self._modules = [
            OnebitModule(layout, self._mesh, rank=self.rank,
                         accumulate_dtype=options.accumulate_dtype,
                         **self._initial_mask(layout, agreed.masks))
            for layout in layouts
        ]  # fmt: skip
        self._install(model, settings)

    def _mesh_of(self, replicate: DeviceMesh | None) -> ShardMesh:
        """The mesh: HSDP with ``N > 1`` nodes, else the 1-D one (``N = 1``: its shard mesh)."""
        if replicate is None or replicate.size() == 1:
            return ShardMesh(self.comm)
        return HsdpMesh(self.comm, self._comms(replicate.get_group(0)))

    def _initial_mask(self, layout: ModuleLayout, masks: Any) -> dict[str, Any]:
        """A module's ``exp_avg_mask`` as bits in the layout of ``X``, or ``"auto"``'s record
        (all ones: no warmup update seen)."""
        if self._auto_mask:
            device = layout.slots[0].param.device
            size = (layout.padded_row // 8,)
            return {"record": torch.full(size, 255, dtype=torch.uint8, device=device)}
        return {} if masks is None else {"mask": module_mask(layout, masks, self.comm.world_size)}

    def _install(self, model: nn.Module, settings: dict[str, Any]) -> None:
        """The state and the reduce-scatters, once every rank agreed on the model and the
        settings (the modules built)."""
        self._b1 = float(settings["betas"][0])
        self._settings = settings
        self._setting_names = sorted(k for k in settings if k != "lr")
        super().__init__([slot.param for slot in self._slots()], dict(settings))
        self._rule = self._rule_for(self._momentum_masks())
        self._state = self._rule.init(self._shards())
        self._problems: list[Exception] = []  # what the reduce-scatters found, for step()
        self._failed = FailedCollectives()  # the collectives of this backward that failed
        self._grad_change_warned = False
        members = {canonical_name(name): member for name, member, _ in fsdp_groups(model)}
        # each module's FSDP2 group: its settings and reduce-scatter
        self._fsdp_modules = [members[module.layout.name] for module in self._modules]
        for module, member in zip(self._modules, self._fsdp_modules, strict=True):
            reduce_scatter = OnebitReduceScatter(
                module, self._comms, self._compresses, self._problems, self._failed
            )
            member.set_custom_reduce_scatter(reduce_scatter)
            if self.comm.world_size == 1:  # FSDP2 runs no reduce-scatter: its hook counts
                member.set_all_reduce_hook(reduce_scatter.all_reduce_hook)
            # every trainable param in every reduce-scatter: a missing gradient is a zero
            member.set_reduce_scatter_unused_params(True, recurse=False)

    @property
    def count(self) -> int:
        """The number of updates made."""
        return int(self._state.count)

    @property
    def world(self) -> dist.ProcessGroup | None:
        """The group that the agreement and the checks of every update span (``world=``;
        ``None``: the default group): the ranks this optimizer communicates with."""
        return self._world

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent through fn's communicators (reduce-scatters, the freeze's
        all-gathers and the checks; FSDP2's parameter all-gathers are not counted)."""
        return self._comms.bytes_sent

    @property
    def bytes_sent_by_hop(self) -> dict[str, int]:
        """The bytes this rank has sent, by level (a dict from ``"world"``, ``"intra"`` and
        ``"inter"`` to bytes): on HSDP ``"intra"`` is the shard group (inside a node),
        ``"inter"`` the replicate group (across the nodes) and ``"world"`` the checks over
        every rank of ``world`` (a few bytes an update); on a 1-D mesh every byte counts under
        ``"world"``."""
        counts = dict.fromkeys(HOPS, 0)
        for group, comm in self._comms.comms.items():
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            counts[self._mesh.hops.get(ranks, "world")] += comm.bytes_sent
        return counts

    @property
    def max_grad_norm(self) -> float | None:
        """As ``fn.optim.OnebitFamily.max_grad_norm`` (the same check, fn's one clipping
        definition; see the class's Args), compared across the
        ranks in the next ``step()``'s first exchange.

        Raises:
            ValueError: (on setting) as there; nothing changed.
        """
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self._max_grad_norm = check_max_norm(self.name, value)

    @property
    def state(self) -> Any:
        """``torch.optim``'s per-param state, which stays empty (the state is in the rule's
        fields and the compressed modules: :meth:`state_dict`).

        Raises:
            NotImplementedError: read by ``torch.distributed.checkpoint.state_dict``
                (``get_state_dict``, ``get_optimizer_state_dict``, ``set_state_dict``,
                ``set_optimizer_state_dict``, each of which reads it before anything else of
                the optimizer), which keeps only ``torch.optim``'s per-param form; nothing was
                changed.
        """
        # torch's API reads this first, then takes the optimizer for one of torch.optim's form
        if called_by_state_dict_api():
            raise NotImplementedError(not_torch_format(self.name))
        return self._per_param_state

    @state.setter
    def state(self, value: Any) -> None:
        self._per_param_state = value

    def warn_if_never_compressed(self, updates: int, source: str = "this run") -> bool:
        """Warns (``UserWarning``) when none of the first ``updates`` updates would be
        compressed (a ``freeze_step`` beyond the run; with ``freeze_step="auto"``, a
        ``max_updates`` not below it while the switch is undecided): every update would be a
        dense reduce-scatter, as plain Adam's. ``fn.integrations`` calls it with the run's
        length.

        Args:
            updates: the number of updates the run makes.
            source: where ``updates`` comes from, for the message.

        Returns:
            Whether it warned.
        """
        if self._rule.first_compressed_update(updates, self._state) is not None:
            return False
        warnings.warn(
            f"{self.name} makes no compressed update within {source} ({updates} updates), or "
            'with freeze_step="auto" none is certain: until one is, every update is a dense '
            "reduce-scatter, as plain Adam's, and saves no bandwidth; "
            "set freeze_step, or freeze_step=fn.AutoFreeze(max_updates=...), below "
            f"{updates}",
            stacklevel=2,
        )
        return True

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One update of every param shard (see the class docstring), from the gradients that
        FSDP2's backward delivered since the last ``step()``.

        Without such gradients on every rank (``step()`` before any backward, a second
        ``step()`` after one, gradients set by hand) it is a no-op: nothing changes, ``count``
        included. Every rank calls it (its first exchange compares the ranks' micro-batch
        counts, the backwards since the last ``step()``). A problem that a reduce-scatter of
        that backward found is raised here, on every rank, with no param changed; the next
        backward and ``step()`` train normally.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            fn.NonFiniteError: on every rank, if a gradient on some rank is not finite;
                no param and no ``v`` changed.
            RuntimeError: FSDP2 stopped reduce-scattering after an exception inside an earlier
                backward (not fn's: fn raises none there); or, on every rank, the ranks ran
                different numbers of micro-batches (the accumulated gradients are dropped);
                nothing changed.
            ValueError: on every rank, the ranks' ``max_grad_norm`` differ, or some rank's
                ``param_groups[0]`` sets another value of a setting fixed when built (all but
                ``lr``); nothing changed.
            fn.collectives.CollectiveTimeoutError: some rank never called ``step()`` (on a 1-D
                mesh, one that runs more micro-batches waits in FSDP2's next all-gather).
            Exception: what else a reduce-scatter of the last backward raised (a collective's
                timeout, say), the same on every rank.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if any(reduce_scatters_stopped(module) for module in self._fsdp_modules):
            raise RuntimeError(
                f"{self.name}: FSDP2 no longer reduce-scatters this model: an exception was "
                "raised inside an earlier backward (FSDP2 then never runs its end-of-backward "
                "callback again), so gradients no longer reach the optimizer; nothing was "
                "updated. Build the model and the optimizer anew (fully_shard, then this "
                "optimizer) and reload the last checkpoint (fn.fsdp.TrainingCheckpoint.load)"
            )
        batches = max(module.backwards for module in self._modules)
        problems, failed = list(self._problems), self._failed.take()
        self._problems.clear()
        changed = self._changed_settings()
        if changed is not None:  # raised by the first exchange, on every rank
            problems.insert(0, changed)
        try:
            if failed.groups:  # this rank's collective failed: its group is unusable
                raise failed.dated(problems[0])
            self._update(batches, problems)
        finally:  # what the backwards delivered is used once, or dropped with the error
            for module in self._modules:
                module.discard()
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim.Optimizer``'s, for the one group the constructor adds.

        Raises:
            NotImplementedError: a second group; nothing changed.
        """
        if self.param_groups:
            raise NotImplementedError(
                f"{self.name}: another param group is not built: the optimizer trains one, "
                "every trainable param of the FSDP2 modules of the model it was built on (their "
                "layout is fixed then); fully_shard the new params into the model and build the "
                "optimizer again"
            )
        super().add_param_group(param_group)

    def _changed_settings(self) -> ValueError | None:
        """The error for the settings in ``param_groups[0]`` that differ from those the
        optimizer was built with (fixed then: the rule is built once), if any."""
        group = self.param_groups[0]
        changed = [k for k in self._setting_names if group.get(k) != self._settings[k]]
        if not changed:
            return None
        shown = ", ".join(
            f"{k}={group.get(k)!r} (built with {self._settings[k]!r})" for k in changed
        )
        return ValueError(
            f"{self.name}: param_groups[0] sets {shown}: the settings but lr are fixed when the "
            "optimizer is built (lr is read at every step; a scheduler that cycles betas, as "
            "OneCycleLR does by default, needs cycle_momentum=False); build it with the "
            "settings, and set them back to go on; nothing was updated"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``, which also drops the gradient accumulated
        outside ``.grad`` since the last ``step()`` (a 1-D mesh's compressed phase).

        Args:
            set_to_none: as ``torch.optim.Optimizer.zero_grad``'s.
        """
        super().zero_grad(set_to_none)
        for module in self._modules:
            module.discard()

    def _update(self, batches: int, problems: list[Exception]) -> None:
        """The update from the gradients the backwards since the last ``step()`` delivered
        (``batches``: how many backwards ran; ``problems``: what their reduce-scatters found),
        after the ranks' first exchange (``fn/fsdp/onebit_gradients.py``)."""
        t = self.count + 1
        warmup = not self._rule.is_compressed(t, self._state)
        exchanged = self._mesh.communicates and not warmup  # the 1-bit exchange
        if exchanged and problems:  # a failed reduce-scatter delivered no local gradient
            gradients, stats = {}, gradient_stats({})
        elif exchanged:
            gradients, stats = self._compressed_gradients()
        else:
            stats = self._mesh.warmup_stats(self._warmup_stats)
        lr = self.param_groups[0]["lr"]
        totals = first_exchange(
            self._checks, self.name, batches, self._max_grad_norm, lr, problems, stats
        )
        if not batches:  # no backward since the last step() on any rank: a no-op
            return
        freezes = not warmup and any(m.record is not None for m in self._modules)
        if freezes:  # exp_avg_mask="auto": the records go once the update is made
            self._set_masks([(m.frozen_mask(), m.record) for m in self._modules])
        extra: dict[str, Any] = {}
        records = None
        if exchanged:
            inputs = self._exchanged_momentum(self._clipped(gradients, totals))
        else:
            inputs, extra = self._dense_inputs(totals)
            if warmup and self._auto_mask:
                records = [m.observe_zeros(inputs) for m in self._modules]
        state = set_hyperparams(self._state, lr=lr)
        params = self._shards()
        if exchanged and (self._freeze_due or self._rule.first_compressed_update(t, state) == t):
            extra["momentum_mask"] = self._momentum_masks()  # the frozen variance's report
        if not warmup and self._freeze_due:  # the plan of a freeze: its report and its log
            extra["plan"] = self._rule.plan(t, state)._replace(freezes=True)
        else:
            extra["step"] = t
        updates, state = self._rule.update(inputs, state, params, **extra)
        apply_updates(params, updates, donate=True)
        if exchanged and not self.keeps_momentum_shards:  # it lives in the packed signs
            exp_avg = {k: None if inputs[k] is not None else m for k, m in state.exp_avg.items()}
            state = state._replace(exp_avg=exp_avg)
        self._state, self._freeze_due = state, False
        if records is not None or freezes:
            records = records or [None] * len(self._modules)
            self._set_masks([(m.mask, r) for m, r in zip(self._modules, records, strict=True)])

    def _dense_inputs(self, totals: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
        """The gradients of an update without the 1-bit exchange (the warmup; every update of
        one rank alone): this rank's shards of the averaged gradient, clipped, and the rule's
        further arguments (the gradient energy of ``freeze_step="auto"``), once every rank's
        are known finite."""
        totals = self._mesh.warmup_totals(totals, self._modules, self._warmup_stats)
        totals = checked_totals(self.name, totals, compressed=False)
        factor = clip_factor(totals[2], self._max_grad_norm)
        inputs = self._grad_inputs()
        if factor != 1.0:  # .grad stays as the backward left it
            inputs = {k: None if g is None else g * factor for k, g in inputs.items()}
        measured = self._state.auto is not None and self._mesh.communicates
        return inputs, {"gradient_energy": totals[1]} if measured else {}

    def _warmup_stats(self) -> list[float]:
        """This rank's statistics of the averaged gradient's shards (``.grad``)."""
        energy = self._state.auto is not None and self._mesh.communicates
        norm = self._max_grad_norm is not None
        return gradient_stats(self._grad_inputs(), energy=energy, norm=norm)

    def _compresses(self) -> bool:
        """Whether the coming update is compressed (the reduce-scatters ask)."""
        return self._mesh.communicates and self._rule.is_compressed(self.count + 1, self._state)

    def _slots(self) -> list[Any]:
        return [slot for module in self._modules for slot in module.layout.slots]

    def _shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every param, by FQN."""
        return {slot.name: local_shard(slot.param) for slot in self._slots()}

    def _grad_inputs(self) -> dict[str, torch.Tensor | None]:
        """This rank's ``.grad`` shard of every param, by FQN."""
        return {k: v for module in self._modules for k, v in module.grad_shards().items()}

    def _compressed_gradients(self) -> tuple[dict[str, torch.Tensor], list[float]]:
        """By module (those reduce-scattered), the gradient that enters its momentum
        (``mesh.compressed_gradient``), and this rank's statistics of them for the first
        exchange."""
        gradients, changed = {}, False
        for module in self._modules:
            if module.received:
                check = not self._grad_change_warned and not changed
                gradient, moved = self._mesh.compressed_gradient(
                    module, module.grad_shards(), check
                )
                gradients[module.layout.name], changed = gradient, changed or moved
        return gradients, gradient_stats(gradients, changed=changed)

    def _clipped(
        self, gradients: dict[str, torch.Tensor], totals: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The compressed phase's ``gradients`` times the clipping factor of ``max_grad_norm``,
        from the first exchange's ``totals``: the root mean square of the ranks' (on HSDP the
        nodes') norms. Every rank warns once of a changed ``.grad``.

        Raises:
            fn.NonFiniteError: on every rank, some rank's gradient is not finite.
        """
        totals = checked_totals(self.name, totals, compressed=True)
        if totals[3] > 0 and not self._grad_change_warned:
            self._grad_change_warned = True
            warnings.warn(GRAD_CHANGED.format(name=self.name), stacklevel=user_stacklevel())
        factor = clip_factor(totals[2] / self._mesh.exchange.world_size, self._max_grad_norm)
        if factor != 1.0:
            gradients = {name: g * factor for name, g in gradients.items()}
        return gradients

    def _exchanged_momentum(
        self, gradients: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor | None]:
        """The compressed phase's exchange: every module's momentum's 1-bit allreduce with its
        checked and clipped gradient (``gradients``, by module: those reduce-scattered);
        returns every param's shard of the new momentum, read exactly from the packed signs
        (``None`` for the params of a module that no backward reduce-scattered)."""
        shards: dict[str, torch.Tensor | None] = {}
        for module in self._modules:
            layout, row = module.layout, None
            if layout.name in gradients:
                momentum = module.previous_momentum(self._state.exp_avg)
                x, grad, beta = self._momentum_input(module, momentum, gradients[layout.name])
                try:
                    row = module.exchange(x, grad, beta, self.error_dtype)
                except NonFiniteError:  # raised on every rank, before anything was written
                    raise NonFiniteError(
                        f"{self.name}: non-finite values in the momentum of some rank in "
                        f"module {layout.name}; no param changed (the modules exchanged "
                        "before it have advanced their momentum and errors)"
                    ) from None
            for slot in layout.slots:
                local = local_shard(slot.param)
                piece = None if row is None else row[slot.offset : slot.offset + local.numel()]
                shards[slot.name] = None if piece is None else piece.view(local.shape)
        return shards

    def _momentum_input(self, module: OnebitModule, momentum: Tensor, grad: Tensor) -> Input:
        """What a module compresses, from its momentum before this update and the gradient
        that enters it, both flat in the layout of ``X``: ``(x, grad, beta)`` for
        ``OnebitModule.exchange``. 1-bit Adam's: the momentum ``b1 m + (1 - b1) g``,
        formed inside the exchange."""
        del module
        return momentum, grad, self._b1

    def _momentum_masks(self) -> dict[str, torch.Tensor | None] | None:
        """Every param's shard of its mask (0. or 1., shaped like the shard; ``None`` for a
        module without a mask), by FQN; ``None`` when no module has a mask."""
        if all(module.mask is None for module in self._modules):
            return None
        shards = self._shards()
        return {k: v for module in self._modules for k, v in module.shard_masks(shards).items()}

    def _set_masks(self, masks: list[tuple[Any, Any]]) -> None:
        """Sets every module's mask and ``exp_avg_mask="auto"``'s record. With one rank and no
        replicas, where no collective runs, the rule itself multiplies the momentum by the
        masks, so it is built anew with them."""
        changed = False
        for module, (mask, record) in zip(self._modules, masks, strict=True):
            changed = changed or mask is not module.mask
            module.set_mask(mask, record)
        if changed and not self._mesh.communicates:
            self._rule = self._rule_for(self._momentum_masks())

    def _rule_for(self, masks: dict[str, torch.Tensor | None] | None) -> CompressedOptimizer:
        """The rule on the shards, its norms (if any) over the shard group; with one rank and no
        replicas (FSDP2 calls no reduce-scatter: nothing to compress) the rule with one rank,
        ``masks`` (by FQN, shaped like the params) its ``exp_avg_mask``."""
        if self._mesh.communicates:
            return self._make_rule(self._settings, self.comm)
        return self.replicated_rule(
            **self._settings, comm=Local(), error_dtype=self.error_dtype, exp_avg_mask=masks
        )

    def _make_rule(self, settings: dict[str, Any], comm: Any) -> CompressedOptimizer:
        """The rule on the shards, its norms (if any) over ``comm``."""
        over = {"comm": comm} if self.norms_over_shards else {}
        return self.sharded_rule(**settings, **over)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as a ``torch.distributed.checkpoint`` (DCP) state dict, in one
        layout at every update (DCP loads in place into a layout fixed before it reads).

        ``{"header", "lr", "signed", "exp_avg", "exp_avg_sq", "momentum", "per_rank"}``:
        ``header`` (int64: format, world size, updates made, checksums of the model's layout
        and of the settings); ``lr`` (``param_groups[0]["lr"]``); ``signed`` (int8 per module:
        whether its momentum is kept as packed signs); ``exp_avg`` and ``exp_avg_sq`` by param
        FQN, DTensors of the shards (``exp_avg``: zeros where the momentum is packed);
        ``momentum`` by module, the packed signs and scales of its full momentum (zeros before
        the freeze; the same on every rank, so DCP saves them once); and under
        ``per_rank["rank<r>"]``, a name of this rank's own (fn/collectives/dcp.py), by module
        its worker and server errors (zeros before the first compressed update; DCP would keep
        one rank's copy of a name every rank saves).
        With ``freeze_step="auto"``, ``auto`` holds the decision and its statistics (0-dim,
        the same on every rank). With ``exp_avg_mask="auto"``, by module and as bits in the
        layout of ``X``, ``always_zero`` holds the warmup's records of zero gradients (a
        DTensor of the ranks' rows, each rank's its own; zeros after the freeze) and
        ``exp_avg_mask`` the mask (the same on every rank; zeros before the freeze). A
        subclass's further per-param fields come by field name: its ``scalar_fields`` (0-dim,
        the same on every rank) and its ``optional_fields`` (DTensors of the shards, zeros
        where ``None``, with ``"<field>_held"``: int8 per param, whether it holds a tensor).
        :class:`~fn.fsdp.TrainingCheckpoint` saves it, and loads it on any mesh shape, checked
        before anything changes; ``dcp.load`` straight into it works on the same mesh shape.
        ``r`` is the rank in ``world`` (the default group unless the optimizer was given
        another). On HSDP (``replicate=``) the world size is the shard group's, ``header`` ends
        with ``N``, and ``momentum`` holds this rank's row (a DTensor over the shard mesh, the
        same on the ``N`` peers).

        Returns:
            A dict of tensors, the state's own where it holds them, zeros where it does not.

        Raises:
            RuntimeError: called between a backward and its ``step()`` (the gradient
                accumulated since the last ``step()`` is not part of a checkpoint); nothing was
                changed.
        """
        if any(module.received for module in self._modules):
            raise RuntimeError(
                f"{self.name}: state_dict() between a backward and its step(): the gradient "
                "accumulated since the last step() is not part of a checkpoint, and a resumed "
                "run would lose it; save after step() (or after zero_grad())"
            )
        return onebit_state_dict(self._format(), self._state, self.param_groups[0]["lr"])

    def checkpoint_template(
        self, header: torch.Tensor, saved: dict[str, torch.Size]
    ) -> dict[str, Any]:
        """The state dict that DCP loads a checkpoint of :meth:`state_dict` into: new tensors
        laid out as saved (this rank's errors only if the mesh shape is the same).

        Args:
            header: the checkpoint's ``header`` (loaded first).
            saved: the checkpoint's optimizer keys, flat (``"exp_avg.block.weight"``), and
                their sizes (from the checkpoint's metadata).

        Returns:
            A dict of the form of :meth:`state_dict`, to pass to ``dcp.load``.

        Raises:
            ValueError: the header does not match this model or these settings, or a key is
                missing (nothing was loaded).
        """
        return checkpoint_template(self._format(), self._state, header, saved)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict` (as :meth:`state_dict` or :meth:`checkpoint_template`
        lays it out).

        Saved on this mesh shape (the world size of a 1-D mesh; on HSDP ``N`` x ``L``), the
        state continues bit for bit. Saved on another one (another world size, HSDP to a 1-D
        mesh or back, another ``N`` x ``L``), ``v`` and the shards' momentum are read back
        exactly into this mesh's layout, and the error feedback (which compensated the old
        layout's compression) restarts from zero with a warning.

        Raises:
            ValueError: the checkpoint is of another model or other settings; nothing was
                changed.
            NotImplementedError: ``state_dict`` is in ``torch.optim``'s per-param form (as
                ``torch.distributed.checkpoint.state_dict.set_state_dict`` passes it); nothing
                was changed.
        """
        loaded = restored(self._format(), state_dict, self._state, self._rule)
        if loaded.warning is not None:
            warnings.warn(loaded.warning, stacklevel=2)
        self.param_groups[0]["lr"] = float(state_dict["lr"])
        self._state, self._freeze_due = loaded.state, False
        for module, (signs, errors) in zip(self._modules, loaded.momenta, strict=True):
            module.restore(signs, errors)
        self._set_masks(loaded.masks)

    def load_adam_state(
        self,
        count: int,
        exp_avg: Mapping[torch.Tensor, torch.Tensor],
        exp_avg_sq: Mapping[torch.Tensor, torch.Tensor],
    ) -> None:
        """Starts from the state of Adam or AdamW (``torch.optim``'s ``exp_avg`` and
        ``exp_avg_sq`` of every param, and its step count), so that a job trained with AdamW
        switches to 1-bit Adam: ``m`` and ``v`` carry over and the update count becomes
        ``count``. The next update is a warmup one for ``count + 1 < freeze_step``, otherwise
        the freeze (its momentum all-gathered from the carried ``m``), also past
        ``freeze_step``: it reports the frozen variance (the warning where training is at risk)
        and logs that the compressed updates start. The error feedback of the
        1-bit allreduce starts at zero, with a warning. ``param_groups[0]["lr"]`` is left as it
        is (an LR scheduler sets it).

        Args:
            count: the updates Adam made (``state["step"]``).
            exp_avg: Adam's ``exp_avg``, by param (the model's DTensor params), each a DTensor
                sharded as its param or this rank's shard of it.
            exp_avg_sq: Adam's ``exp_avg_sq``, likewise.

        Raises:
            ValueError: a param missing from ``exp_avg`` or ``exp_avg_sq``, a shard of another
                shape, a value not finite, a negative ``exp_avg_sq`` or ``count``; nothing was
                changed.
            NotImplementedError: ``exp_avg_mask="auto"`` (its mask is the record of the
                warmup's zero gradients, which Adam did not keep), or 1-bit LAMB (its frozen
                trust ratios average its own warmup updates); nothing was changed.

        Example:
            >>> import torch, torch.distributed as dist
            >>> from torch.distributed.device_mesh import init_device_mesh
            >>> from torch.distributed.fsdp import fully_shard
            >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            >>> model = fully_shard(torch.nn.Linear(2, 1), mesh=init_device_mesh("cpu", (1,)))
            >>> adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> adamw.step()
            >>> opt = fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=2)
            >>> params = list(model.parameters())
            >>> import warnings
            >>> with warnings.catch_warnings(record=True) as caught:
            ...     warnings.simplefilter("always")
            ...     opt.load_adam_state(
            ...         1,
            ...         {p: adamw.state[p]["exp_avg"] for p in params},
            ...         {p: adamw.state[p]["exp_avg_sq"] for p in params},
            ...     )
            >>> opt.count, len(caught)
            (1, 1)
            >>> dist.destroy_process_group()
        """
        if self.adam_start is not None:
            raise NotImplementedError(
                f"{self.name}: a start from Adam's state is not built: {self.adam_start}; "
                "nothing was changed"
            )
        self._state = adam_started(self._format(), self._state, count, exp_avg, exp_avg_sq)
        self._freeze_due = count > 0 and self._rule.is_compressed(count, self._state)
        for module in self._modules:
            module.restore(None, None)
        warnings.warn(
            f"{self.name}: started from Adam's state at update {count} (m and v carried "
            "over); the error feedback of the 1-bit allreduce starts at zero",
            stacklevel=2,
        )

    def _format(self) -> StateFormat:
        """What the state format (``fn/fsdp/onebit_state.py``) reads of this optimizer."""
        group = self.param_groups[0]  # the rule's settings (not lr, nor a scheduler's keys)
        layouts = [module.layout for module in self._modules]
        settings = {k: group[k] for k in self._setting_names}
        return StateFormat(
            self.name, self._modules, self._mesh, self.error_dtype, self._auto_mask,
            fingerprints(layouts, settings, self.error_dtype, self._mask_setting),
            dist.get_rank(self._world), self.scalar_fields, self.optional_fields,
            self.keeps_momentum_shards,
        )  # fmt: skip


class OnebitAdam(ShardedOnebitOptimizer):
    """1-bit Adam (``fn.onebit_adam``) over a model sharded by FSDP2 (``fully_shard``).

    A ``torch.optim.Optimizer`` over the model's trainable params (DTensor shards, one param
    group): it installs its own reduce-scatter on every FSDP2 module of ``model``
    (``set_custom_reduce_scatter``). Warmup updates (``t < freeze_step``) reduce-scatter the
    gradients densely and run Adam's warmup rule on the shards (``m`` and ``v`` sharded). At the
    freeze each module all-gathers its momentum shards once; from then on each micro-batch's
    reduce-scatter adds this rank's local gradient ``g_r`` to the module's accumulator, and
    ``step()`` compresses the momentum ``b1 m + (1 - b1) g_r`` with the error-compensated 1-bit
    allreduce (chunk ``j`` is rank ``j``'s shard), keeps the new momentum full size as packed
    signs (``n / 8`` bytes) and its errors (worker: full size, server: shard size), and
    applies the frozen-variance rule on the shards:

    .. math::
        u = \\mathrm{clip}(m / (\\sqrt{v} + \\epsilon), -B, B) + \\lambda p,\\quad
        p \\leftarrow p - \\eta u

    (``fn.transforms.onebit_adam_sharded``, the rule of ``fn.onebit_adam``). Where each buffer
    lives and the bytes sent: docs/algorithms.md, "1-bit Adam and 1-bit LAMB on FSDP2". The
    ranks' params stay identical (each rank steps its own shard).

    Gradient accumulation needs nothing beyond a backward per micro-batch (each reduce-scatters,
    as trainers do; ``set_requires_gradient_sync(False)`` works too): the exchange across the
    ranks (on HSDP: the nodes) runs once per update, in ``step()``, whatever the number of
    micro-batches. ``max_grad_norm`` clips the gradient before it enters the momentum, in both
    phases, by one factor every rank shares (docs/algorithms.md, "Accumulation and clipping on
    FSDP2 and HSDP").

    Construct it on every rank, after ``fully_shard``: it checks on every rank together that
    the model and the settings agree (a collective call). Checkpoints: its ``state_dict()``
    through :class:`~fn.fsdp.TrainingCheckpoint` (DCP), resumed bit for bit after any update.

    Args:
        model: the model, with ``fully_shard`` applied to it or its submodules, on one 1-D mesh
            (with ``replicate``: the shard dimension of the 2-D mesh, ``mesh["shard"]``);
            every trainable param must be in an FSDP2 module.
        lr: as ``fn.onebit_adam``'s, read from ``param_groups[0]["lr"]`` at every step (LR
            schedulers work).
        freeze_step: as ``fn.onebit_adam``'s (``"auto"`` too: each rank sends its shards'
            gradient energy with the finite check of every warmup update, and the ranks switch
            together).
        betas, eps, weight_decay, safeguard: as ``fn.onebit_adam``'s, fixed here.
        non_freeze: must be ``False`` (``NotImplementedError`` otherwise).
        exp_avg_mask: ``{param: mask}`` for some of the model's params (the DTensors), each a
            plain tensor of 0s and 1s broadcastable to the param's full shape, multiplied into
            the momentum after every compressed allreduce (as ``fn.onebit_adam``'s); kept as
            bits in each module's layout (``n / 8`` bytes per rank). Or ``"auto"``, as
            ``fn.onebit_adam``'s: the mask is 0 where the mean gradient was exactly 0 at every
            warmup update, 1 elsewhere, the same bits as that mask passed by hand. Each rank
            records its shard's zeros (``n / (8 W)`` bytes), and at the freeze every module
            all-gathers the records once (``(W - 1) n / (8 W)`` bytes sent per rank) into the
            mask. Other values and DTensor masks: ``NotImplementedError`` / ``TypeError``.
        nonfinite: ``"raise"`` (``"skip"``: ``NotImplementedError``).
        local_world_size: must be ``None`` (``NotImplementedError`` otherwise; across nodes
            use ``replicate``).
        error_dtype: the storage of the errors, ``torch.float32``, ``torch.bfloat16`` or
            ``torch.float16`` (as ``fn.onebit_adam``'s; fp16 errors take the allocating 1-bit
            allreduce, the others the in-place exchange).
        replicate: HSDP (docs/algorithms.md, "1-bit Adam and 1-bit LAMB on HSDP"): the
            replicate dimension of ``mesh = init_device_mesh(device, (N, L),
            mesh_dim_names=("replicate", "shard"))``, ``mesh["replicate"]``, with every module
            sharded by ``fully_shard(module, mesh=mesh["shard"])``. Each module's
            reduce-scatter stays dense inside the node; across the ``N`` nodes the warmup
            averages the node's gradient shard densely (sum, then ``/ N``) and the compressed
            phase runs the 1-bit allreduce of this rank's row of the momentum over the
            replicate group, keeping the row as packed signs (worker error: the row, server
            error: ``1 / N`` of it; no buffer is full size). ``None`` (default): the shard mesh
            must hold every rank of ``world``. With ``N = 1`` it is the 1-D path; with
            ``L = 1`` (one rank per node) FSDP2 runs no reduce-scatter and the same step runs in
            FSDP2's all-reduce hook. Checkpoints resume bit for bit on the same mesh shape, and
            load on any other (another ``N`` x ``L``, or a 1-D mesh, and back): ``v`` and the
            momentum resharded exactly, the error feedback restarted from zero with a warning.
        world: the process group of the ranks the optimizer spans (``None``: the default
            group), over which it agrees on the settings at construction and checks every
            update (non-finite values, the clipping norm; on HSDP the reduce-scatters'
            failures). The shard mesh must hold every rank of ``world``, or with ``replicate``
            the shard and replicate meshes must each partition it. Another group lets several
            independent runs share one ``torch.distributed`` world, each on its own ranks: a
            DiLoCo worker of ``L`` ranks passes its shard mesh's group,
            ``mesh["shard"].get_group()`` (docs/guides/diloco.md), and an HSDP worker a group of
            its ``N L`` ranks (``dist.new_group``, which every rank of the default group calls
            for every worker). Every rank of ``world`` passes the same group.
        max_grad_norm: clip the gradient that enters the momentum to this norm (``None``: no
            clipping), by ``min(1, max_grad_norm / (norm + 1e-6))`` as
            ``torch.nn.utils.clip_grad_norm_``: in the warmup the norm of the averaged
            gradient; in the compressed phase the root mean square over the ranks (on HSDP: the
            nodes) of the norms of their accumulated local (node) gradients. One fp64 value per
            rank rides the finite check's all-gather; ``.grad`` is left as it is.
        accumulate_dtype: the dtype in which a 1-D mesh's compressed phase accumulates each
            rank's full local gradient between the backward and ``step()``,
            ``torch.float32`` (``4 n`` bytes per rank while it is held) or ``torch.bfloat16``
            (``2 n``, its sum rounded at every micro-batch). HSDP accumulates in FSDP2's
            ``.grad`` shards and needs no such buffer.

    Raises:
        ValueError: on every rank: no FSDP2 module with trainable params, a trainable param
            outside every FSDP2 module, a module already driven by another ``fn.fsdp`` optimizer,
            settings that differ between ranks (with ``replicate``: between any ranks of
            ``world``), a bad hyperparameter, a 1-D shard mesh that leaves ranks of ``world`` out
            without ``replicate``, a mesh rank outside ``world``, or a ``replicate`` mesh that
            does not complement the shard mesh; on this rank alone: this rank is not in
            ``world``.
        TypeError: on every rank: ``replicate`` is not a 1-D ``DeviceMesh``; on this rank
            alone: ``world`` is not a ``torch.distributed.ProcessGroup``.
        NotImplementedError: on every rank: a model sharded on a 2-D mesh (shard it on
            ``mesh["shard"]`` and pass ``replicate=mesh["replicate"]``), or an option not
            built yet.

    Policies (docs/guides/policies.md): nothing is raised inside FSDP2's backward; what a
    reduce-scatter finds is raised by the next ``step()``, on every rank, with no param
    changed, and the next backward and ``step()`` train normally. A non-finite gradient makes
    ``step()`` raise ``fn.NonFiniteError`` on every rank with nothing changed (no param, ``v``,
    momentum or error), and the accumulated gradient is dropped. A param without a gradient,
    on one rank or all, counts as a zero gradient, as in ``fn.optim`` (FSDP2 reduce-scatters
    zeros for it: ``set_reduce_scatter_unused_params``), in both phases, provided its FSDP2
    module runs on every rank: a module run on some ranks only cannot be its own FSDP2 unit
    (FSDP2's own all-gather and reduce-scatter of it would run on those ranks only, and the
    ranks' collectives mismatch: gloo aborts, other backends time out, as with native FSDP2 and
    HSDP), so params that may lack a gradient must be in a module that every rank runs. Every
    rank must run the same number of micro-batches before each ``step()``: ``step()`` compares
    the counts first and raises ``RuntimeError`` on every rank with nothing changed where they
    differ; where the extra micro-batch's FSDP2 all-gather already waits for the others (a 1-D
    mesh, ranks of one node), the ranks in ``step()`` raise
    ``fn.collectives.CollectiveTimeoutError`` at ``FN_TIMEOUT`` instead (docs/guides/fsdp.md,
    "Accumulation and clipping"). A ``step()`` without a backward since the last one (on every
    rank) is a no-op. A ``state_dict()`` between a
    backward and its ``step()`` is refused (``RuntimeError``: the accumulated gradient is not
    saved). On a 1-D mesh in the compressed phase ``.grad`` holds this rank's row of its own
    local gradient, which the update does not read: a change to it (``clip_grad_norm_``) warns
    once, naming ``max_grad_norm``. torch's ``get_state_dict`` / ``set_state_dict`` (and
    ``get_``/``set_optimizer_state_dict``), given any state dict, are refused on every rank
    (``NotImplementedError``) with nothing changed: checkpoints go through
    :class:`~fn.fsdp.TrainingCheckpoint`, or :func:`~fn.fsdp.read_onebit_state` for a DCP
    state dict of your own.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.fsdp import fully_shard
        >>> import fn.fsdp
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = fully_shard(torch.nn.Linear(2, 1), mesh=init_device_mesh("cpu", (1,)))
        >>> opt = fn.fsdp.OnebitAdam(model, lr=1e-2, freeze_step=2)
        >>> for _ in range(3):
        ...     opt.zero_grad()
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     opt.step()
        >>> opt.count
        3
        >>> dist.destroy_process_group()
    """

    sharded_rule = staticmethod(onebit_adam_sharded)
    replicated_rule = staticmethod(onebit_adam)

    __signature__ = signature_with(
        onebit_adam,
        "model",
        *OPTIONS,
        option("non_freeze", False, "bool", keyword=False),
        leave_out=("comm",),
    )


class ZeroOneAdam:
    """0/1 Adam on FSDP2: not offered (docs/algorithms.md, "1-bit Adam and 1-bit LAMB on
    FSDP2"); use ``fn.optim.ZeroOneAdam`` with DDP, or :class:`OnebitAdam`.

    Args:
        model: the model.
        *args: ignored.
        **kwargs: ignored, but for ``replicate`` (HSDP), which changes the message.

    Raises:
        NotImplementedError: always, with the reason.

    Example:
        >>> fn.fsdp.ZeroOneAdam(torch.nn.Linear(2, 1), lr=1e-3)
        Traceback (most recent call last):
        ...
        NotImplementedError: fn.fsdp.ZeroOneAdam: 0/1 Adam's local steps update every rank's ...
    """

    def __init__(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        del model, args
        if kwargs.get("replicate") is not None:
            raise NotImplementedError(
                "fn.fsdp.ZeroOneAdam: 0/1 Adam on HSDP (replicate=) is not built yet: it would "
                "be sound there (a node is one replica, its local steps would run per node, "
                "its 1-bit allreduces across the replicate group), but it is not offered; use "
                "fn.fsdp.OnebitAdam(model, ..., replicate=...), or fn.optim.ZeroOneAdam with DDP"
            )
        raise NotImplementedError(
            "fn.fsdp.ZeroOneAdam: 0/1 Adam's local steps update every rank's full params from "
            "its own momentum between synchronizations, so the ranks' params differ by "
            "design, while FSDP2 keeps one copy of each element (a shard) and all-gathers it: "
            "there is no replica to step locally; use fn.optim.ZeroOneAdam with DDP, or "
            "fn.fsdp.OnebitAdam"
        )


def _as_pair(betas: Any) -> Any:
    """``betas`` as a tuple when it is a sequence (a list and a tuple are the same setting);
    anything else as it is, for the rule's check to name."""
    is_sequence = isinstance(betas, Sequence) and not isinstance(betas, str)
    return tuple(betas) if is_sequence else betas
