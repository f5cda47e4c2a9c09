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
from inspect import Parameter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fn.base import CompressedOptimizer, apply_updates, set_hyperparams
from fn.collectives import (
    CollectiveTimeoutError,
    Local,
    check_error_dtype,
)
from fn.collectives.comm import HOPS
from fn.errors import NonFiniteError
from fn.fsdp._fsdp2 import reduce_scatters_stopped
from fn.fsdp.agreement import agree
from fn.fsdp.onebit_checks import (
    check_partitions,
    model_problem,
    replicate_problem,
    spanned_ranks,
)
from fn.fsdp.onebit_layout import (
    ModuleLayout,
    fsdp_groups,
    fsdp_modules,
    module_layout,
    one_dim,
    row_multiple,
    shard_of,
    to_local,
)
from fn.fsdp.onebit_masks import MomentumMasks, mask_checksum, module_mask
from fn.fsdp.onebit_module import OnebitModule
from fn.fsdp.onebit_reduce_scatter import FailedCollectives, OnebitReduceScatter
from fn.fsdp.onebit_state import OnebitStateFormat
from fn.fsdp.reduce_scatter import CommCache
from fn.transforms import gradient_energy, onebit_adam, onebit_adam_sharded
from fn.transforms.hyperparameters import bind_arguments, signature_with

__all__ = ["OPTIONS", "OnebitAdam", "ShardedOnebitOptimizer", "ZeroOneAdam"]

# The optimizers' own options, beside their rule's hyperparameters (exp_avg_mask takes the
# rule's place; the comm is the FSDP2 modules' mesh's)
OPTIONS = (
    Parameter(
        "exp_avg_mask",
        Parameter.KEYWORD_ONLY,
        default=None,
        annotation="Mapping[torch.Tensor, torch.Tensor] | str | None",
    ),
    Parameter("nonfinite", Parameter.KEYWORD_ONLY, default="raise", annotation="str"),
    Parameter("replicate", Parameter.KEYWORD_ONLY, default=None, annotation="DeviceMesh | None"),
    Parameter("max_grad_norm", Parameter.KEYWORD_ONLY, default=None, annotation="float | None"),
    Parameter(
        "accumulate_dtype",
        Parameter.KEYWORD_ONLY,
        default=torch.float32,
        annotation="torch.dtype",
    ),
    Parameter(
        "world",
        Parameter.KEYWORD_ONLY,
        default=None,
        annotation="torch.distributed.ProcessGroup | None",
    ),
)
_OPTION_NAMES = (
    "exp_avg_mask", "nonfinite", "local_world_size", "error_dtype", "replicate", "non_freeze",
    "max_grad_norm", "accumulate_dtype", "world",
)  # fmt: skip
_CLIP_EPS = 1e-6  # in the clipping factor's denominator, as torch.nn.utils.clip_grad_norm_'s


class ShardedOnebitOptimizer(OnebitStateFormat, MomentumMasks, torch.optim.Optimizer):
    """What the 1-bit optimizers on FSDP2 share (:class:`OnebitAdam`,
    :class:`~fn.fsdp.OnebitLamb`). That is the model's FSDP2 modules, each with its state and
    accumulated gradient (``OnebitModule``, ``fn/fsdp/onebit_module.py``) and the reduce-scatter
    installed on it, ``step()`` (the update's exchange across the ranks, then the rule on the
    shards), the checks across ranks and the DCP state dict.

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.name = f"fn.fsdp.{type(self).__name__}"
        arguments = bind_arguments(self.name, type(self).__signature__, args, kwargs)
        options = {k: arguments.pop(k) for k in _OPTION_NAMES if k in arguments}
        model = arguments.pop("model")
        self._setup(model, {**arguments, "betas": _as_pair(arguments["betas"])}, **options)

    def _setup(
        self,
        model: nn.Module,
        settings: dict[str, Any],
        *,
        exp_avg_mask: Any,
        nonfinite: str,
        local_world_size: int | None,
        error_dtype: torch.dtype,
        replicate: DeviceMesh | None = None,
        non_freeze: bool = False,
        max_grad_norm: float | None = None,
        accumulate_dtype: torch.dtype = torch.float32,
        world: dist.ProcessGroup | None = None,
    ) -> None:
        world_ranks = spanned_ranks(self.name, world)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{self.name}: model must be the nn.Module that fully_shard sharded (the "
                "optimizer installs its reduce-scatter on the model's FSDP2 modules), got "
                f"{type(model).__name__}: pass the model itself, not model.parameters()"
            )
        found = fsdp_modules(model)
        flat = bool(found) and one_dim(found)
        group = found[0][1][0][1].device_mesh.get_group(0) if flat else None
        problem = model_problem(
            self.name, model, found, non_freeze, exp_avg_mask, nonfinite, local_world_size
        )
        if problem is None:
            problem = replicate_problem(self.name, replicate, found, world_ranks, world is None)
        if problem is None:
            problem = self._bad_settings(settings, error_dtype)
        if problem is None:
            problem = _gradient_problem(max_grad_norm, accumulate_dtype)
        masks = None if problem else exp_avg_mask
        self._auto_mask = isinstance(masks, str)  # exp_avg_mask="auto"
        order = [p for _, ps in found for _, p in ps]
        # in the ranks' agreement and the checkpoints' settings: "auto", or the masks' checksum
        self._mask_setting = "auto" if self._auto_mask else mask_checksum(masks, order)
        hsdp = () if replicate is None else ("replicate", getattr(replicate, "shape", None))
        fingerprint = repr(
            (settings, non_freeze, self._mask_setting, nonfinite, local_world_size,
             str(error_dtype), max_grad_norm, str(accumulate_dtype),
             [(m, [(n, tuple(p.shape)) for n, p in ps]) for m, ps in found], *hsdp)
        )  # fmt: skip
        device = found[0][1][0][1].device if found else "cpu"
        # over world (None: the default group), whatever the meshes: ranks that passed
        # different meshes or replicate= on some ranks only still meet in one collective
        agree(self.name, world, problem, fingerprint, device=device)
        self._world = world  # the group of the checks over every rank (None: the default)
        self._comms = CommCache(None)
        self.comm = self._comms(group)
        self._replicas = None  # fn's comm over the replicate group (HSDP, N > 1), or None
        self._hops: dict[tuple[int, ...], str] = {}  # HSDP: the level of a group, by its ranks
        multiple = None
        if replicate is not None:
            shard_mesh = found[0][1][0][1].device_mesh
            check_partitions(self.name, shard_mesh, replicate, device, world, world_ranks)
            if replicate.size() > 1:
                self._replicas = self._comms(replicate.get_group(0))
                multiple = row_multiple(replicate.size())
                for hop, mesh in (("intra", found[0][1][0][1].device_mesh), ("inter", replicate)):
                    self._hops[tuple(dist.get_process_group_ranks(mesh.get_group(0)))] = hop
        self.error_dtype = error_dtype
        self.max_grad_norm = max_grad_norm
        self.rank = dist.get_rank(group)
        world_size = self.comm.world_size
        # whether fn's collectives deliver the mean gradient (else one rank: the rule alone)
        self._communicates = world_size > 1 or self._replicas is not None
        self._layouts = [module_layout(n, ps, world_size, multiple) for n, ps in found]
        hsdp_rows = self._replicas is not None
        self._modules = {
            x.name: OnebitModule(
                x, rank=self.rank, hsdp=hsdp_rows, accumulate_dtype=accumulate_dtype
            )
            for x in self._layouts
        }
        self._install(model, settings, masks, error_dtype)

    def _install(
        self,
        model: nn.Module,
        settings: dict[str, Any],
        masks: Mapping[torch.Tensor, torch.Tensor] | str | None,
        error_dtype: torch.dtype,
    ) -> None:
        """The state and the reduce-scatters, once every rank agreed on the model and the
        settings (``self._layouts`` set)."""
        world_size = self.comm.world_size
        self._masks = {  # by module: its exp_avg_mask as bits in the layout of X, or None
            x.name: None if masks is None or self._auto_mask else module_mask(x, masks, world_size)
            for x in self._layouts
        }
        # exp_avg_mask="auto" until the freeze: by module, this rank's row of X as bits, 1 where
        # the mean gradient was exactly 0 at every warmup update so far (padding positions 1);
        # None otherwise
        self._zero_records = None
        # the next update freezes the variance though past freeze_step: a start from Adam's
        # state (load_adam_state) at a count past it
        self._freeze_due = False
        if self._auto_mask:
            self._zero_records = {
                x.name: torch.full(
                    (x.padded_row // 8,), 255, dtype=torch.uint8, device=x.slots[0].param.device
                )
                for x in self._layouts
            }
        self._b1 = float(settings["betas"][0])
        self._settings = settings
        self._setting_names = sorted(k for k in settings if k != "lr")
        params = [slot.param for layout in self._layouts for slot in layout.slots]
        super().__init__(params, dict(settings))
        if self._communicates:
            self._rule = self._make_rule(settings, self.comm)
        else:
            self._rule = self._single_rank_rule(settings, error_dtype, self._momentum_masks())
        self._state = self._rule.init(self._shards())
        self._automatic = self._state.auto is not None  # freeze_step="auto": decided in the state
        self._problems: list[Exception] = []  # what the reduce-scatters found, for step()
        self._failed = FailedCollectives()  # the collectives of this backward that failed
        self._delivered = False  # whether a backward delivered gradients since the last step()
        self._grad_change_warned = False
        self._fsdp_modules: list[nn.Module] = []
        members = {name: member for name, member, _ in fsdp_groups(model)}
        for layout in self._layouts:
            module = members[layout.name]  # its group's settings and reduce-scatter
            self._fsdp_modules.append(module)
            reduce_scatter = OnebitReduceScatter(
                self._modules[layout.name],
                self._comms,
                self._compresses,
                self._problems,
                self._failed,
            )
            module.set_custom_reduce_scatter(reduce_scatter)
            if world_size == 1 and self._communicates:  # FSDP2 runs no reduce-scatter
                module.set_all_reduce_hook(reduce_scatter.all_reduce_hook)
            # every trainable param in every reduce-scatter: a missing gradient is a zero
            module.set_reduce_scatter_unused_params(True, recurse=False)
        for param in params:  # FSDP2 runs these once it has written a gradient shard
            param.register_post_accumulate_grad_hook(self._gradient_delivered)

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
            counts[self._hops.get(ranks, "world")] += comm.bytes_sent
        return counts

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

        Without such gradients (``step()`` before any backward, a second ``step()`` after one,
        gradients set by hand) it is a no-op: nothing changes, ``count`` included. A problem
        that a reduce-scatter of that backward found is raised here, on every rank, with no
        param changed; the next backward and ``step()`` train normally.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or ``None``.

        Raises:
            fn.NonFiniteError: on every rank, if a gradient on some rank is not finite;
                no param and no ``v`` changed.
            RuntimeError: FSDP2 stopped reduce-scattering after an exception inside an earlier
                backward (not fn's: fn raises none there); nothing changed.
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
        received = {name: module.received for name, module in self._modules.items()}
        problems, delivered, failed = list(self._problems), self._delivered, self._failed.take()
        self._problems.clear()
        self._delivered = False
        try:
            # each node's reduce-scatters found their own: share them over world, unless a
            # group failed (this rank then has its own failure to raise at once)
            if self._replicas is not None and not failed.groups:
                problems = self._shared_problems(problems)
            if problems:
                raise failed.dated(problems[0])
            if delivered:
                self._update(received)
        finally:  # what the backwards delivered is used once, or dropped with the error
            for module in self._modules.values():
                module.discard()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``, which also drops the gradient accumulated
        outside ``.grad`` since the last ``step()`` (a 1-D mesh's compressed phase).

        Args:
            set_to_none: as ``torch.optim.Optimizer.zero_grad``'s.
        """
        super().zero_grad(set_to_none)
        for module in self._modules.values():
            module.discard()

    def _update(self, received: Mapping[str, bool]) -> None:
        """The update from the gradients the backwards since the last ``step()`` delivered
        (``received``: by module, whether its reduce-scatter ran)."""
        t = self.count + 1
        warmup = not self._rule.is_compressed(t, self._state)
        freezes_mask = not warmup and self._zero_records is not None  # exp_avg_mask="auto"
        if freezes_mask:  # the records go once the update is made (a failed one is retried)
            self._set_masks(self._frozen_masks(), self._zero_records)
        compressed = self._communicates and not warmup
        if warmup and self._replicas is not None:
            self._average_over_nodes(received)
        params = self._shards()
        records, energy = None, None
        if compressed:
            inputs = self._exchanged_momentum(received)
        else:
            inputs = {
                slot.name: None if slot.param.grad is None else to_local(slot.param.grad)
                for layout in self._layouts
                for slot in layout.slots
            }
            energy, square_norm = self._checked_energy(inputs)
            factor = self._clip_factor(square_norm)
            if factor != 1.0:  # .grad stays as the backward left it
                inputs = {k: None if g is None else g * factor for k, g in inputs.items()}
            if warmup and self._zero_records is not None:
                records = self._observed_zeros(inputs)
        state = set_hyperparams(self._state, lr=self.param_groups[0]["lr"])
        extra = {} if compressed or energy is None else {"gradient_energy": energy}
        if compressed and (self._freeze_due or self._rule.first_compressed_update(t, state) == t):
            extra["momentum_mask"] = self._momentum_masks()  # for the frozen variance's report
        if not warmup and self._freeze_due:  # the plan of a freeze: its report and its log
            extra["plan"] = self._rule.plan(t, state)._replace(freezes=True)
        else:
            extra["step"] = t
        updates, state = self._rule.update(inputs, state, params, **extra)
        apply_updates(params, updates, donate=True)
        if compressed and not self.keeps_momentum_shards:  # it lives in the packed signs
            exp_avg = {k: None if inputs[k] is not None else m for k, m in state.exp_avg.items()}
            state = state._replace(exp_avg=exp_avg)
        self._state, self._freeze_due = state, False
        if records is not None or freezes_mask:
            self._zero_records = records

    def _compresses(self) -> bool:
        """Whether the coming update is compressed (the reduce-scatters ask)."""
        return self._communicates and self._rule.is_compressed(self.count + 1, self._state)

    def _shards(self) -> dict[str, torch.Tensor]:
        """This rank's shard of every param, by FQN."""
        return {slot.name: to_local(slot.param) for x in self._layouts for slot in x.slots}

    def _grad_shards(self, layout: ModuleLayout) -> dict[str, torch.Tensor | None]:
        """This rank's ``.grad`` shard of every param of a module, by FQN."""
        return {
            slot.name: None if slot.param.grad is None else to_local(slot.param.grad)
            for slot in layout.slots
        }

    def _gradient_delivered(self, param: torch.Tensor) -> None:
        del param
        self._delivered = True

    def _average_over_nodes(self, received: Mapping[str, bool]) -> None:
        """HSDP's warmup: every module's accumulated node gradient (this rank's row, in
        ``.grad``) replaced by its mean over the nodes, one dense all-reduce per module."""
        for layout in self._layouts:
            if not received[layout.name]:
                continue
            row = self._modules[layout.name].node_row(self._grad_shards(layout))
            mean = self._replicas.all_reduce(row, "mean")
            for slot in layout.slots:
                local = to_local(slot.param)
                values = mean[slot.offset : slot.offset + local.numel()].view(local.shape)
                if slot.param.grad is None:
                    slot.param.grad = shard_of(values.clone(), slot.param)
                else:
                    to_local(slot.param.grad).copy_(values)

    def _exchanged_momentum(self, received: Mapping[str, bool]) -> dict[str, torch.Tensor | None]:
        """The compressed phase's exchange: every module's accumulated gradient (the local
        one on a 1-D mesh, this rank's row of the node's on HSDP) checked and clipped
        (:meth:`_compressed_gradients`), then its momentum's 1-bit allreduce; returns every
        param's shard of the new momentum, read exactly from the packed signs (``None`` for
        the params of a module that no backward reduce-scattered)."""
        gradients = self._compressed_gradients(received)
        over = self.comm if self._replicas is None else self._replicas
        shards: dict[str, torch.Tensor | None] = {}
        for layout in self._layouts:
            module = self._modules[layout.name]
            row = None
            if layout.name in gradients:
                momentum = module.previous_momentum(
                    self._state.exp_avg, self._masks[layout.name], self.comm
                )
                x, grad, beta = self._momentum_input(
                    layout, module, over, momentum, gradients[layout.name]
                )
                try:
                    module.exchange(over, x, grad, beta, self.error_dtype)
                except NonFiniteError:  # raised on every rank, before anything was written
                    raise NonFiniteError(
                        f"{self.name}: non-finite values in the momentum of some rank in "
                        f"module {layout.name}; no param changed (the modules exchanged "
                        "before it have advanced their momentum and errors)"
                    ) from None
                row = self._masked_row(layout, module.own_row().values(layout.padded_row))
            for slot in layout.slots:
                local = to_local(slot.param)
                piece = None if row is None else row[slot.offset : slot.offset + local.numel()]
                shards[slot.name] = None if piece is None else piece.view(local.shape)
        return shards

    def _compressed_gradients(self, received: Mapping[str, bool]) -> dict[str, torch.Tensor]:
        """By module (those reduce-scattered), the gradient that enters its momentum, flat
        fp32 in the layout of ``X``: on a 1-D mesh this rank's accumulated local gradient, on
        HSDP its row of the node's (from ``.grad``), times the clipping factor of
        ``max_grad_norm``. One all-gather over the ranks holding different gradients
        (``world``) of three fp64 values checks that all are finite, sums their squared norms and
        tells every rank whether some rank's ``.grad`` was changed where the update does not
        read it (:meth:`_grad_changed`: then every rank warns, once).

        Raises:
            fn.NonFiniteError: on every rank, some rank's gradient is not finite; nothing
                changed.
        """
        gradients, changed = {}, False
        for layout in self._layouts:
            if received[layout.name]:
                module = self._modules[layout.name]
                if module.hsdp:
                    gradients[layout.name] = module.node_row(self._grad_shards(layout))
                else:
                    gradients[layout.name] = module.local_gradient.view(-1).float()
                    changed = changed or self._grad_changed(layout, module)
        bad = sum(int(not bool(g.isfinite().all())) for g in gradients.values())
        square = sum((float(g.double().square().sum()) for g in gradients.values()), 0.0)
        mine = torch.tensor([float(bad), 0.0 if bad else square, changed], dtype=torch.float64)
        everyone = self._comms(self._world)
        totals = everyone.all_gather(mine).view(-1, 3).sum(0)
        if totals[0] > 0:  # (a NaN differs from itself: no word of a changed .grad then)
            raise NonFiniteError(
                f"{self.name}: non-finite values in the accumulated gradient of some rank; "
                "nothing was updated"
            )
        if totals[2] > 0 and not self._grad_change_warned:
            self._grad_change_warned = True
            warnings.warn(
                f"{self.name}: .grad was changed between the backward and step() (by "
                "torch.nn.utils.clip_grad_norm_, say) in the compressed phase on a 1-D mesh, "
                "where the update reads the local gradient that fn accumulated, not .grad: the "
                "change has no effect. Clip with max_grad_norm= (every phase), or use HSDP "
                "(replicate=), where .grad is what the update reads",
                stacklevel=4,
            )
        replicas = self.comm.world_size if self._replicas is None else self._replicas.world_size
        factor = self._clip_factor(totals[1] / replicas)
        if factor != 1.0:
            gradients = {name: g * factor for name, g in gradients.items()}
        return gradients

    def _grad_changed(self, layout: ModuleLayout, module: OnebitModule) -> bool:
        """On a 1-D mesh in the compressed phase ``.grad`` holds this rank's row of its own
        gradient, and the update reads the local gradient fn accumulated: whether ``.grad``
        was changed since the backward (``clip_grad_norm_``, say), which then changes
        nothing."""
        if self._grad_change_warned:
            return False
        for slot in layout.slots:
            grad = slot.param.grad
            written = module.written_row()[slot.offset : slot.offset + to_local(slot.param).numel()]
            if grad is None or not torch.equal(to_local(grad).reshape(-1), written):
                return True
        return False

    def _clip_factor(self, square_norm: torch.Tensor) -> float:
        """``max_grad_norm``'s factor for a squared gradient norm (the same on every rank):
        ``min(1, max_grad_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``'s;
        ``1.0`` without ``max_grad_norm``."""
        if self.max_grad_norm is None:
            return 1.0
        norm = float(square_norm) ** 0.5
        return min(1.0, self.max_grad_norm / (norm + _CLIP_EPS))

    def _shared_problems(self, problems: list[Exception]) -> list[Exception]:
        """HSDP: what the reduce-scatters found, on every rank (one all-gather of three values
        over ``world``). A reduce-scatter raises on the ranks of one node's shard group; the
        other ranks then raise too, of the same kind when it is ``fn.NonFiniteError`` or
        ``CollectiveTimeoutError`` (naming the first rank that the failed collective
        missed)."""
        first = problems[0] if problems else None
        lost = -1.0
        if isinstance(first, CollectiveTimeoutError) and first.missing_ranks:
            lost = float(min(first.missing_ranks))
        mine = torch.tensor([float(first is not None), float(_nonfinite(first)), lost])
        rows = self._comms(self._world).all_gather(mine.double()).view(-1, 3)
        failed = rows[:, 0].nonzero().view(-1).tolist()
        if problems or not failed:
            return problems
        nonfinite, lost = bool(rows[failed[0], 1]), int(rows[failed[0], 2])
        cause = f": rank {lost} never reached one of its collectives" if lost >= 0 else ""
        message = (
            f"{self.name}: the reduce-scatter of rank {failed[0]} failed{cause} (see its "
            "error); nothing was updated"
        )
        if nonfinite:
            return [NonFiniteError(message)]
        if lost >= 0:
            return [CollectiveTimeoutError(message, [lost])]
        return [RuntimeError(message)]

    def _checked_energy(
        self, grads: dict[str, torch.Tensor | None]
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Raises ``NonFiniteError`` on every rank if some rank's gradient shard is not
        finite; returns, with ``freeze_step="auto"`` (and several ranks), the gradient energy
        of the mean gradient, the sum of the shards' (``fn.transforms.gradient_energy``), else
        ``None``, and the mean gradient's squared norm. One all-gather of three fp64 values,
        summed in rank order (the same bits on every rank)."""
        present = [g for g in grads.values() if g is not None]
        bad = sum(int(not bool(g.isfinite().all())) for g in present)
        measure = self._automatic and self._communicates
        energy = (
            gradient_energy(grads) if measure and not bad else torch.zeros((), dtype=torch.float64)
        )
        square = 0.0
        if self.max_grad_norm is not None and not bad:
            square = sum((float(g.double().square().sum()) for g in present), 0.0)
        mine = torch.tensor([float(bad), float(energy), square], dtype=torch.float64)
        if self.comm.world_size > 1:
            mine = self.comm.all_gather(mine).view(-1, 3).sum(0)
        if mine[0] > 0:
            raise NonFiniteError(
                f"{self.name}: non-finite values in the averaged gradient (on some rank); "
                "nothing was updated"
            )
        return (mine[1] if measure else None), mine[2]

    def _momentum_input(
        self,
        layout: ModuleLayout,
        module: OnebitModule,
        comm: Any,
        momentum: torch.Tensor,
        grad: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """What a module compresses, from its momentum before this update and the gradient
        that enters it, both flat in the layout of ``X``: ``(x, grad, beta)`` for
        ``OnebitModule.exchange``. 1-bit Adam's: the momentum ``b1 m + (1 - b1) g``,
        formed inside the exchange."""
        del layout, module, comm
        return momentum, grad, self._b1

    def _make_rule(self, settings: dict[str, Any], comm: Any) -> CompressedOptimizer:
        """The rule on the shards, its norms (if any) over ``comm``."""
        over = {"comm": comm} if self.norms_over_shards else {}
        return self.sharded_rule(**settings, **over)

    def _single_rank_rule(
        self,
        settings: dict[str, Any],
        error_dtype: torch.dtype,
        masks: dict[str, torch.Tensor | None] | None,
    ) -> CompressedOptimizer:
        """The rule with one rank (FSDP2 calls no reduce-scatter: nothing to compress), with
        ``masks`` (by FQN, shaped like the params) as its ``exp_avg_mask``."""
        return self.replicated_rule(
            **settings, comm=Local(), error_dtype=error_dtype, exp_avg_mask=masks
        )

    def _bad_settings(
        self, settings: dict[str, Any], error_dtype: torch.dtype
    ) -> tuple[type[Exception], str] | None:
        """The rule's own checks of the hyperparameters, as a problem (its message without the
        name of the check that raised it: :func:`~fn.fsdp.agreement.agree` starts it with
        this optimizer's)."""
        try:
            check_error_dtype(self.name, error_dtype)
            self._make_rule(settings, Local())
        except (ValueError, TypeError, NotImplementedError) as error:
            message = str(error)
            for who in (self.name, self.sharded_rule.__name__):
                message = message.removeprefix(f"{who}: ")
            return type(error), message
        return None


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
    HSDP), so params that may lack a gradient must be in a module that every rank runs. A
    ``step()`` without a backward since the last one is a no-op. A ``state_dict()`` between a
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
        Parameter("non_freeze", Parameter.POSITIONAL_OR_KEYWORD, default=False, annotation="bool"),
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


def _gradient_problem(
    max_grad_norm: Any, accumulate_dtype: Any
) -> tuple[type[Exception], str] | None:
    """The checks of ``max_grad_norm`` and ``accumulate_dtype``, as a problem."""
    if max_grad_norm is not None:
        number = isinstance(max_grad_norm, (int, float)) and not isinstance(max_grad_norm, bool)
        if not number or not 0 < max_grad_norm < float("inf"):
            return ValueError, (
                f"max_grad_norm must be a positive, finite number or None, got {max_grad_norm!r}"
            )
    if accumulate_dtype not in (torch.float32, torch.bfloat16):
        return ValueError, (
            f"accumulate_dtype must be torch.float32 or torch.bfloat16, got {accumulate_dtype!r}"
        )
    return None


def _nonfinite(error: Exception | None) -> bool:
    return isinstance(error, NonFiniteError)
