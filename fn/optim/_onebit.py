"""The 1-bit family as drop-in ``torch.optim`` optimizers: ``OnebitAdam``, ``ZeroOneAdam``,
``OnebitLamb``.

Their signatures are those of ``fn.onebit_adam``, ``fn.zero_one_adam`` and ``fn.onebit_lamb``
(DeepSpeed's names, in the factories' order, with the factories' defaults), built from the
factories' own by :mod:`fn.transforms.hyperparameters`, plus the adapter's options.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fn.base import CompressedOptimizer
from fn.collectives.comm import Comm, ReduceOp, check_op
from fn.optim._adapter import FunctionalOptimizer, Transform
from fn.optim._checkpoint import checkpoint_parts
from fn.transforms import AutoFreeze, onebit_adam, onebit_lamb, zero_one_adam
from fn.transforms.clipping import check_max_norm, clip_factor, squared_norm
from fn.transforms.hyperparameters import bind_arguments, option, signature_with


class OnebitFamily(FunctionalOptimizer):
    """The 1-bit family adapters' shared part (``OnebitAdam``, ``ZeroOneAdam``, ``OnebitLamb``).
    It builds per-group transforms of the class's factory with the group's hyperparameters, the
    comm, and the group's part of ``exp_avg_mask``.

    A subclass names its factory (``_factory``) and its signature (``__signature__``: the
    factory's hyperparameters and the adapter's options), to which the constructor binds its
    arguments: every argument but ``params``, ``comm``, ``exp_avg_mask``, ``nonfinite``,
    ``max_grad_norm``, ``flatten``, ``local_world_size`` and ``error_dtype`` is a
    default hyperparameter of its param groups, in the signature's order.

    ``max_grad_norm`` (an option of the optimizer, not of a group) clips the gradient before
    it enters the momentum, by one factor ``min(1, max_grad_norm / (norm + 1e-6))`` that every
    rank shares, as ``torch.nn.utils.clip_grad_norm_`` over all the optimizer's params: in a
    warmup update ``norm`` is the norm of the averaged gradient, in a compressed update
    ``sqrt(mean over ranks of ||local gradient||^2)`` (a param group in its warmup counts its
    averaged gradient, one in its compressed phase its local ones). ``.grad`` is left as it
    is. It costs one all-gather of two fp64 values per compressed update; without
    ``fn.ddp.register`` the adapter averages the warmup gradients itself (the same one dense
    allreduce, made before the update instead of inside it).

    Args:
        *args: the subclass's arguments, bound to its ``__signature__``.
        **kwargs: the same, by name.

    Example:
        Two steps of each on a constant gradient, with one worker (no communication: the 1-bit
        allreduce is the identity): a warmup step, then a compressed step with the variance
        frozen (see each class):

        >>> import torch
        >>> import fn
        >>> from fn.collectives import Local
        >>> def two_steps(optimizer, weight, **hyper):
        ...     model = torch.nn.Linear(2, 1, bias=False)
        ...     _ = torch.nn.init.constant_(model.weight, weight)
        ...     opt = optimizer(model.parameters(), lr=1e-2, comm=Local(), **hyper)
        ...     for _ in range(2):
        ...         opt.zero_grad()
        ...         model(torch.ones(1, 2)).sum().backward()  # gradient 1 for every weight
        ...         opt.step()
        ...         print(model.weight.detach())
        >>> two_steps(fn.optim.OnebitAdam, 0.0, freeze_step=2)
        tensor([[-0.0316, -0.0316]])
        tensor([[-0.0917, -0.0917]])
        >>> two_steps(fn.optim.ZeroOneAdam, 0.0, var_freeze_step=2)
        tensor([[-0.0316, -0.0316]])
        tensor([[-0.0741, -0.0741]])
        >>> two_steps(fn.optim.OnebitLamb, 1.0, freeze_step=2)
        tensor([[0.9900, 0.9900]])
        tensor([[0.9883, 0.9883]])
    """

    _factory: Callable[..., CompressedOptimizer]
    # The ids of the params whose warmup gradients arrive averaged over the ranks (the DDP
    # model's, fn.ddp.register), or None: the optimizer averages them.
    _averaged: frozenset[int] | None = None
    _max_grad_norm: float | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = f"fn.optim.{type(self).__name__}"
        arguments = bind_arguments(name, type(self).__signature__, args, kwargs)
        self._setup(**arguments)

    def _setup(
        self,
        params: Any,
        *,
        comm: Any,
        exp_avg_mask: Mapping[torch.Tensor, torch.Tensor] | str | None,
        nonfinite: str,
        check_every: int,
        max_grad_norm: float | None = None,
        flatten: bool = False,
        local_world_size: int | None = None,
        error_dtype: torch.dtype = torch.float32,
        **defaults: Any,
    ) -> None:
        self._auto_mask = isinstance(exp_avg_mask, str)
        self._masks = _masks_by_param(None if self._auto_mask else exp_avg_mask)
        self.error_dtype = error_dtype
        # in the groups' settings, which the ranks agree on before it is checked here
        self._max_grad_norm = max_grad_norm
        super().__init__(
            params,
            type(self)._factory,
            comm,
            defaults=defaults,
            flatten=flatten,
            sync_grads=False,
            nonfinite=nonfinite,
            check_every=check_every,
            local_world_size=local_world_size,
        )
        self._check_max_grad_norm(max_grad_norm)
        params = [p for group in self.param_groups for p in group["params"]]
        unused = [tuple(m.shape) for p, m in self._masks.items() if not any(p is q for q in params)]
        if unused:
            raise ValueError(
                f"exp_avg_mask has masks (shapes {unused}) for tensors that are not trainable "
                "params of this optimizer"
            )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """As :meth:`FunctionalOptimizer.load_state_dict`; a checkpoint saved with a fixed
        ``freeze_step`` into a group with ``"auto"`` (or the reverse) raises ``ValueError``,
        nothing loaded: their states differ, and the checkpoint's would switch the group's
        schedule; so does one saved by an fn whose automatic switch kept another statistic
        (``auto.drift``), which this one cannot continue from."""
        super().load_state_dict(state_dict)

    def _refuse_unloadable(self, state_dict: Mapping[str, Any]) -> None:
        saved_groups, records = checkpoint_parts(state_dict, len(self.param_groups))
        for index, record in records.items():
            functional = record.get("functional") if isinstance(record, Mapping) else None
            if isinstance(functional, Mapping) and ".auto.drift" in functional:
                raise ValueError(
                    f"param group {index}: the checkpoint's freeze_step='auto' state holds "
                    "auto.drift, the statistic of an earlier fn's criterion; this fn decides "
                    "from auto.recent_energy, which the checkpoint lacks, so the optimizer "
                    "state cannot continue (the model's weights can: start a fresh optimizer "
                    "from them). Nothing was loaded"
                )
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            for key in ("freeze_step", "var_freeze_step"):
                mine, theirs = group.get(key), saved.get(key, group.get(key))
                if _automatic(mine) != _automatic(theirs):
                    raise ValueError(
                        f"param group {index}: the checkpoint was saved with {key}={theirs!r}, "
                        f"this optimizer has {key}={mine!r}: an automatic switch and a fixed one "
                        "keep different states; build the optimizer with the checkpoint's "
                        f"{key}. Nothing was loaded"
                    )

    def _make_transform(self, index: int, hyper: dict[str, Any]) -> Transform:
        mask = self._group_mask(self.param_groups[index]["params"])
        level = dict(comm=self.transform_comm, local_world_size=self.local_world_size)
        return type(self)._factory(
            **hyper, **level, error_dtype=self.error_dtype, exp_avg_mask=mask
        )

    def _settings(self, group: dict[str, Any]) -> dict[str, str]:
        return {
            **super()._settings(group),
            "error_dtype": str(self.error_dtype),
            "max_grad_norm": repr(self._max_grad_norm),
        }

    @property
    def transform_comm(self) -> Any:
        """The comm the groups' transforms are built with. It is ``comm``, or one whose dense
        mean is the identity (``PreaveragedComm``) when the warmup gradients reach the
        transforms averaged (after :meth:`take_averaged_grads`, or with ``max_grad_norm``,
        where the adapter averages them before it clips)."""
        if self._averaged is not None or self._max_grad_norm is not None:
            return PreaveragedComm(self.comm)
        return self.comm

    @property
    def takes_averaged_grads(self) -> bool:
        """Whether the gradients of warmup updates arrive averaged, as after
        :meth:`take_averaged_grads` (``fn.ddp.register`` calls it)."""
        return self._averaged is not None

    def take_averaged_grads(self, params: Iterable[torch.Tensor]) -> None:
        """From now on the gradients of warmup updates arrive averaged over the ranks
        (``fn.ddp.register``: DDP averaged them): every group's transform is rebuilt with a
        comm whose dense mean is the identity (the state is kept).

        Args:
            params: the params whose gradients arrive averaged (the DDP model's trainable
                params); a group added later with a trainable param outside them raises
                ``ValueError``.
        """
        self._averaged = frozenset(id(p) for p in params)
        self._rebuild_transforms()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group, as :meth:`FunctionalOptimizer.add_param_group`.

        Raises:
            ValueError: the gradients arrive averaged (``fn.ddp.register``) and the group has a
                trainable param whose gradients do not (a param frozen when DDP was built,
                which DDP never averages), with nothing added.
        """
        given = param_group["params"]
        if self._averaged is not None and not isinstance(given, (torch.Tensor, set)):
            param_group["params"] = given = list(given)  # as torch.optim does: read once
        params = [given] if isinstance(given, torch.Tensor) else given
        outside = self._averaged is not None and [
            tuple(p.shape) for p in params if p.requires_grad and id(p) not in self._averaged
        ]
        if outside:
            raise ValueError(
                f"fn.optim.{type(self).__name__}: the new group's params of shapes {outside} "
                "are not among the params the DDP model averages (its trainable params when "
                "fn.ddp.register ran): DDP leaves out the params frozen when it was built, so "
                "their gradients would stay local while this optimizer takes them as averaged. "
                "Unfreeze them before wrapping the model in DDP (or wrap it again, and build "
                "and register a new optimizer); nothing was added"
            )
        super().add_param_group(param_group)

    @property
    def max_grad_norm(self) -> float | None:
        """The norm the gradient is clipped to before it enters the momentum, or ``None`` for
        no clipping (see :class:`OnebitFamily`). Set it on every rank alike; the ranks compare
        it at the next ``step()``, with the other settings.

        Raises:
            ValueError: (on setting) not a positive, finite number or ``None``; nothing
                changed.
        """
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self._check_max_grad_norm(value)
        self._max_grad_norm = value
        self._rebuild_transforms()
        self._sync_checks.start_due = True

    def _check_max_grad_norm(self, value: Any) -> None:
        """Raises ``ValueError`` unless ``value`` is a positive, finite number or ``None``."""
        check_max_norm(f"fn.optim.{type(self).__name__}", value)

    def _rebuild_transforms(self) -> None:
        for index, runtime in enumerate(self._groups):
            runtime.transform = self._make_transform(index, runtime.hyper)

    def _step_gradients(
        self, plans: list[tuple[Transform, dict[str, Any], float | None]], grads: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The gradients the groups' updates take: with ``max_grad_norm``, a warmup group's
        averaged over the ranks (unless they arrived averaged), then all of them times the
        clipping factor (:class:`OnebitFamily`)."""
        if self._max_grad_norm is None:
            return grads
        comm, out = self.comm, []
        local = averaged = 0.0  # squared norms: of the compressed groups' local gradients, of
        compressing = False  # the warmup groups' averaged ones (the same on every rank)
        for runtime, (transform, _, _), g in zip(self._groups, plans, grads, strict=True):
            compressed = transform.compressed_at(runtime.step + 1, runtime.state)
            if not compressed and self._averaged is None and comm.world_size > 1 and g.numel():
                g = comm.all_reduce(g, op="mean")
            square = squared_norm([g])
            if compressed:
                local, compressing = local + square, True
            else:
                averaged += square
            out.append(g)
        square_norm = local + averaged
        if compressing and comm.world_size > 1:
            mine = torch.tensor([local, averaged], dtype=torch.float64, device=out[0].device)
            rows = comm.all_gather(mine).view(-1, 2).cpu()
            square_norm = float(rows[:, 0].sum()) / comm.world_size + float(rows[0, 1])
        # (a norm that is not finite leaves them as they are: the updates reject them)
        factor = clip_factor(square_norm, self._max_grad_norm)
        if factor != 1.0:
            for g in out:
                g.mul_(factor)
        return out

    def _group_mask(self, params: list[torch.Tensor]) -> Any:
        """The group's masks as the transform's pytree: one flat mask, or per-param masks;
        ``"auto"`` for ``exp_avg_mask="auto"``."""
        if self._auto_mask:
            return "auto"
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


class PreaveragedComm:
    """``comm`` with ``all_reduce(x, "mean")`` returning ``x`` (no traffic): the tensors it is
    called on already hold the mean over the ranks (DDP, or the adapter, averaged them). Every
    other collective, the world size and the byte count are ``comm``'s."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __repr__(self) -> str:
        return f"PreaveragedComm({self.comm!r})"

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def bytes_sent(self) -> int:
        return self.comm.bytes_sent

    @property
    def bytes_sent_by_hop(self) -> dict[str, int]:
        return self.comm.bytes_sent_by_hop

    def reset_bytes_sent(self) -> int:
        return self.comm.reset_bytes_sent()

    def all_reduce(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        check_op(op)
        return x if op == "mean" else self.comm.all_reduce(x, op)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(x)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_to_all(x)

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        return self.comm.reduce_scatter(x, op)

    def split(self, local_world_size: int) -> tuple[Comm, Comm]:
        return self.comm.split(local_world_size)


# The adapters' own options, beside their factories' hyperparameters (the adapter's comm and
# exp_avg_mask take the factory's places).
_OPTIONS = (
    option("comm", None, "Comm | None"),
    option("exp_avg_mask", None, "Mapping[torch.Tensor, torch.Tensor] | str | None"),
    option("nonfinite", "raise", "str"),
    option("check_every", 0, "int"),
    option("max_grad_norm", None, "float | None"),
)
_FLATTEN = option("flatten", True, "bool")  # the elementwise rules' per-param mode


def _automatic(freeze_step: Any) -> bool:
    return isinstance(freeze_step, (str, AutoFreeze))


def _masks_by_param(
    exp_avg_mask: Mapping[torch.Tensor, torch.Tensor] | None,
) -> dict[torch.Tensor, torch.Tensor]:
    """``exp_avg_mask`` as a dict, after checking its form: ``{param: mask tensor}``.

    Raises:
        TypeError: ``exp_avg_mask`` is not a mapping, or has a key or a value that is not a
            tensor (e.g. a param's name).
    """
    form = "{param: mask}, the params themselves mapped to tensors broadcastable to their shapes"
    if exp_avg_mask is None:
        return {}
    if not isinstance(exp_avg_mask, Mapping):
        raise TypeError(f"exp_avg_mask must be a mapping {form}; got {type(exp_avg_mask).__name__}")
    for param, mask in exp_avg_mask.items():
        for role, value in (("key", param), ("value", mask)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"exp_avg_mask must be a mapping {form}; got a {role} of type "
                    f"{type(value).__name__}"
                )
    return dict(exp_avg_mask)


class OnebitAdam(OnebitFamily):
    """1-bit Adam (``fn.onebit_adam``) as a ``torch.optim.Optimizer``; one flat leaf per group,
    or one leaf per param with ``flatten=False``.

    Args:
        params: tensors or param-group dicts; every argument below except ``comm``,
            ``exp_avg_mask`` and ``nonfinite`` can be set per group.
        lr, freeze_step, betas, eps, weight_decay: as ``fn.onebit_adam``.
        non_freeze: the group is never compressed (DeepSpeed's ``non_freeze`` groups).
        comm: ``None`` gives :func:`default_comm`.
        exp_avg_mask: ``{param: mask}``, masks broadcastable to their param's shape, multiplied
            into the momentum after every compressed allreduce (keyed by the params
            themselves; another form is a ``TypeError``), or ``"auto"``: 0 where the averaged
            gradient was exactly zero at every warmup update (``fn.onebit_adam``).
        nonfinite: ``"raise"`` or ``"skip"`` (see :class:`FunctionalOptimizer`).
        check_every: run ``check_consistency()`` after every ``check_every``-th update (0:
            never; see :class:`FunctionalOptimizer`).
        max_grad_norm: clip the gradient that enters the momentum to this norm, by one
            factor ``min(1, max_grad_norm / (norm + 1e-6))`` on every rank, as
            ``torch.nn.utils.clip_grad_norm_``: in the warmup ``norm`` is the norm of the
            averaged gradient, once compressed ``sqrt(mean over ranks of ||local
            gradient||^2)`` (see :class:`OnebitFamily`); ``None`` (default): no clipping.
            The same on every rank; not per group.
        safeguard: bound the compressed updates (``fn.onebit_adam``); ``False`` gives
            DeepSpeed's exact rule. Can be set per group.
        flatten: ``True``: the group's params are compressed as one flat leaf (one collective
            per group and step). ``False``: each param tensor is compressed on its own, with its
            own scale and error feedback (more, smaller collectives): DeepSpeed's numerics, as
            ``fn.optim.from_deepspeed`` uses.
        local_world_size: ranks per node for the hierarchical 1-bit allreduce (dense inside a
            node, 1 bit across nodes; see ``fn.onebit_adam``), e.g. torchrun's
            ``LOCAL_WORLD_SIZE``; ``None``: flat. The same on every rank and for every group;
            checkpoints record it (loading under another value resets the error feedback, with
            a warning).
        error_dtype: the storage of the error feedback, ``torch.float32`` (DeepSpeed's),
            ``torch.bfloat16`` or ``torch.float16`` (see ``fn.onebit_adam``); the same on
            every rank and for every group. A checkpoint's error feedback loads into it
            converted (rounded where narrower).

    Example:
        One worker (``comm=Local()``; under ``torchrun`` leave ``comm`` out): a warmup update,
        then compressed ones with the variance frozen (the weights: :class:`OnebitFamily`):

        >>> model = torch.nn.Linear(2, 1)
        >>> opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2,
        ...                           comm=fn.collectives.Local())
        >>> for _ in range(3):
        ...     print(opt.next_update_compressed(), end=" ")
        ...     opt.zero_grad()
        ...     model(torch.ones(1, 2)).sum().backward()
        ...     opt.step()
        [False] [True] [True]
    """

    @staticmethod
    def _factory(*, non_freeze: bool, **kwargs: Any) -> CompressedOptimizer:
        return onebit_adam(**kwargs, non_freeze=bool(non_freeze) or None)

    @property
    def _checks_gradients(self) -> bool:
        """Every update of fn.onebit_adam rejects a non-finite gradient of any rank on every
        rank before it writes (the warmup checks the averaged gradient, the compressed update
        the scales its 1-bit allreduce gathers, or the momentum with one worker), except a
        warmup's after DDP averaged it (:meth:`take_averaged_grads`): the check then sees this
        rank's ``.grad`` alone, which a rank may have changed since, so the step's vote counts
        them (a pass over the gradients that the compressed updates do without)."""
        return not self.takes_averaged_grads or all(self.next_update_compressed())

    __signature__ = signature_with(
        onebit_adam,
        "params",
        *_OPTIONS,
        _FLATTEN,
        option("non_freeze", False, "bool", keyword=False),
    )


class ZeroOneAdam(OnebitFamily):
    """0/1 Adam (``fn.zero_one_adam``) as a ``torch.optim.Optimizer``; one flat leaf per group,
    or one leaf per param with ``flatten=False``.

    Args:
        params: tensors or param-group dicts; every argument below except ``comm``,
            ``exp_avg_mask`` and ``nonfinite`` can be set per group.
        lr, betas, eps, weight_decay: as ``fn.zero_one_adam``.
        var_freeze_step, var_update_scaler: as ``fn.zero_one_adam``.
        local_step_scaler, local_step_clipper: as ``fn.zero_one_adam``.
        comm: ``None`` gives :func:`default_comm`.
        exp_avg_mask: ``{param: mask}`` (see :class:`OnebitAdam`).
        nonfinite: ``"raise"`` or ``"skip"``.
        check_every: run ``check_consistency()`` after every ``check_every``-th update (0:
            never; see :class:`FunctionalOptimizer`).
        max_grad_norm: ``None`` only: another value raises ``NotImplementedError`` (0/1
            Adam's local steps apply each rank's own gradient without any exchange, and a
            synchronization folds several local steps into one momentum, so a factor shared
            by the ranks would take a collective at every local step, the traffic that they
            exist to save). ``torch.nn.utils.clip_grad_norm_`` on ``.grad`` acts: on the
            averaged gradient in the warmup with ``fn.ddp.register``, else on each rank's
            local gradient with its own factor.
        safeguard: as the factory's; ``False`` gives DeepSpeed's exact rule. Can be set per
            group.
        flatten: one flat leaf per group (``True``) or one per param (``False``, DeepSpeed's
            numerics; see :class:`OnebitAdam`).
        local_world_size: ranks per node for the hierarchical 1-bit allreduce (see
            :class:`OnebitAdam`).
        error_dtype: the storage of the error feedback (see :class:`OnebitAdam`).

    Between synchronizations the ranks' params differ by design (local steps).

    Example:
        One worker (``comm=Local()``; under ``torchrun`` leave ``comm`` out): variance updates
        (dense) until ``var_freeze_step``, then local steps (the weights:
        :class:`OnebitFamily`); no ``max_grad_norm``:

        >>> params = torch.nn.Linear(2, 1).parameters()
        >>> opt = fn.optim.ZeroOneAdam(params, var_freeze_step=2, comm=fn.collectives.Local())
        >>> opt.next_update_compressed(), opt.max_grad_norm
        ([False], None)
        >>> opt.max_grad_norm = 1.0
        Traceback (most recent call last):
        ...
        NotImplementedError: fn.optim.ZeroOneAdam: max_grad_norm is not supported: ...
    """

    _factory = staticmethod(zero_one_adam)
    __signature__ = signature_with(zero_one_adam, "params", *_OPTIONS, _FLATTEN)

    def _check_max_grad_norm(self, value: Any) -> None:
        """Raises ``NotImplementedError`` for a ``max_grad_norm`` (see the class's Args)."""
        super()._check_max_grad_norm(value)
        if value is not None:
            raise NotImplementedError(
                "fn.optim.ZeroOneAdam: max_grad_norm is not supported: 0/1 Adam's local steps "
                "apply each rank's own gradient without any exchange, so a clipping factor "
                "shared by the ranks would add a collective to every local step (the traffic "
                "they exist to save). Clip .grad with torch.nn.utils.clip_grad_norm_ (each "
                "rank by its own gradient's norm where the gradients are local), or use "
                "fn.optim.OnebitAdam(max_grad_norm=...)"
            )


class OnebitLamb(OnebitFamily):
    """1-bit LAMB (``fn.onebit_lamb``) as a ``torch.optim.Optimizer``.

    The transform sees per-param views of the group's flat buffer (trust ratios are per tensor);
    it fuses all momenta into one compressed allreduce itself. Warmup steps make one dense
    allreduce per param.

    Args:
        params: tensors or param-group dicts; every argument below except ``comm``,
            ``exp_avg_mask`` and ``nonfinite`` can be set per group.
        lr, freeze_step, betas, eps, weight_decay: as ``fn.onebit_lamb``.
        max_coeff, min_coeff, coeff_beta: as ``fn.onebit_lamb``.
        factor_max, factor_min, factor_threshold: as ``fn.onebit_lamb``.
        comm: ``None`` gives :func:`default_comm`.
        exp_avg_mask: ``{param: mask}`` (see :class:`OnebitAdam`).
        nonfinite: ``"raise"`` or ``"skip"``.
        check_every: run ``check_consistency()`` after every ``check_every``-th update (0:
            never; see :class:`FunctionalOptimizer`).
        max_grad_norm: clip the gradient that enters the momentum (see :class:`OnebitAdam`);
            1-bit LAMB's compressed updates read their fresh variance from the momentum, so
            the clipped gradient is all they see.
        safeguard: as the factory's; ``False`` gives DeepSpeed's exact rule. Can be set per
            group.
        local_world_size: ranks per node for the hierarchical 1-bit allreduce (see
            :class:`OnebitAdam`).
        error_dtype: the storage of the error feedback (see :class:`OnebitAdam`).

    Example:
        One worker (``comm=Local()``; under ``torchrun`` leave ``comm`` out): a LAMB warmup
        update, then compressed ones (the weights: :class:`OnebitFamily`):

        >>> model = torch.nn.Linear(2, 1)
        >>> opt = fn.optim.OnebitLamb(model.parameters(), lr=1e-2, freeze_step=2,
        ...                           comm=fn.collectives.Local())
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()  # the warmup's one update
        >>> opt.next_update_compressed()  # from freeze_step on, with the frozen trust ratio
        [True]
    """

    _factory = staticmethod(onebit_lamb)
    __signature__ = signature_with(onebit_lamb, "params", *_OPTIONS)
