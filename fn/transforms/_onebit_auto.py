"""What the warmup of 1-bit Adam and 1-bit LAMB decides for ``freeze_step="auto"`` and
``exp_avg_mask="auto"``: the state field ``auto`` (:class:`AutoState`) and the functions that
update, read and check it.

At every warmup update the averaged gradient (the same on every rank) gives two things, both
from one call of ``fn.kernels.sign_compress`` on ``-|g|`` per leaf: the RMS scale of the
gradient (a fixed-order sum, the same bits on every device and rank), from which the gradient
energy, the variance statistics and then the switch are computed (:func:`observed`), and the
packed bits of the elements where the gradient is exactly zero (``-0.0 >= 0``), ANDed into the
mask's record. A caller that holds only a shard of the params (``onebit_adam_sharded``) sums its
shard's :func:`gradient_energy` over the ranks itself and passes it in. The rules are in
``docs/algorithms.md``, "Automatic freeze and momentum mask"; the host side reads ``freeze_at``
(``_onebit_schedules.AutoFreezeSchedule``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fn import kernels
from fn.collectives import Local
from fn.errors import check_finite
from fn.transforms import _onebit_state as onebit_state
from fn.transforms._leafwise import gradient_leaves
from fn.transforms._onebit_schedules import AutoFreeze, AutoFreezeSchedule
from fn.tree import PyTree, live_leaves, tree_flatten, tree_map


class AutoState(NamedTuple):
    r"""The state field ``auto`` of 1-bit Adam and 1-bit LAMB (``None`` where neither
    ``freeze_step`` nor ``exp_avg_mask`` is ``"auto"``); every value is the same on every rank.

    Attributes:
        freeze_at: ``[]`` int64 on the CPU, the first compressed update once decided, 0 before;
            ``None`` with a fixed ``freeze_step``.
        variance_sum: ``[]`` fp64 on the CPU, :math:`T`, the sum of the variance (up to
            rounding); ``None`` with a fixed ``freeze_step``.
        recent_energy: ``[]`` fp64 on the CPU, :math:`\hat E`, the gradient energy averaged
            with the momentum's beta; ``None`` with a fixed ``freeze_step``.
        always_zero: per leaf, uint8 ``[ceil(n / 8)]``, MSB first: bit 1 where the averaged
            gradient was exactly 0 at every warmup update so far (``exp_avg_mask="auto"``);
            ``None`` otherwise.

    Example:
        >>> opt = fn.onebit_adam(freeze_step="auto", comm=fn.collectives.Local())
        >>> opt.init({"w": torch.zeros(3)}).auto
        AutoState(freeze_at=tensor(0), variance_sum=tensor(0., dtype=torch.float64),
                  recent_energy=tensor(0., dtype=torch.float64), always_zero=None)
    """

    freeze_at: torch.Tensor | None
    variance_sum: torch.Tensor | None
    recent_energy: torch.Tensor | None
    always_zero: PyTree


class AutoWarmup(NamedTuple):
    """What an optimizer decides in its warmup: the switch (``freeze``, ``None`` for a fixed
    ``freeze_step``) and the mask (``mask``); ``b1`` and ``b2`` are its momentum's and its
    variance's betas."""

    freeze: AutoFreeze | None
    mask: bool
    b1: float
    b2: float


def auto_warmup(
    name: str,
    schedule: Any,
    exp_avg_mask: Any,
    non_freeze: PyTree | None,
    settings: Any,
) -> AutoWarmup | None:
    """The optimizer's :class:`AutoWarmup` (with the betas of its ``OnebitSettings``), ``None``
    when nothing is automatic.

    Raises:
        ValueError: ``exp_avg_mask`` is a string other than ``"auto"``, or the switch is
            automatic while every leaf is ``non_freeze`` (nothing would freeze).
    """
    if isinstance(exp_avg_mask, str) and exp_avg_mask != "auto":
        raise ValueError(
            f'{name}: exp_avg_mask must be a pytree of masks, None or "auto", got {exp_avg_mask!r}'
        )
    freeze = schedule.settings if isinstance(schedule, AutoFreezeSchedule) else None
    skips = [bool(s) for s in tree_flatten(non_freeze)[0]] if non_freeze is not None else []
    if freeze is not None and skips and all(skips):
        raise ValueError(
            f'{name}: freeze_step="auto" with every leaf in non_freeze: no leaf ever freezes, '
            "so there is nothing to decide; pass a fixed freeze_step or leave some leaves out "
            "of non_freeze"
        )
    mask = isinstance(exp_avg_mask, str)
    if freeze is None and not mask:
        return None
    return AutoWarmup(freeze, mask, settings.b1, settings.b2)


def init_auto(auto: AutoWarmup | None, params: PyTree) -> AutoState | None:
    """The field ``auto`` of a fresh state: undecided, statistics zero, every element of the
    mask's record "always zero" so far."""
    if auto is None:
        return None
    scalars = (None, None, None)
    if auto.freeze is not None:
        zero = torch.zeros((), dtype=torch.float64)
        scalars = (torch.zeros((), dtype=torch.int64), zero, zero.clone())
    record = None
    if auto.mask:
        record = tree_map(
            lambda p: kernels.packbits(torch.zeros(p.numel(), device=p.device)), params
        )
    return AutoState(*scalars, record)


def observed_warmup(
    name: str, auto: AutoWarmup | None, grads: PyTree, state: Any, h: Any, non_freeze: Any = None
) -> tuple[PyTree, AutoState | None, Any]:
    """The gradients, the state's ``auto`` and the ``OnebitSettings`` ``h`` that a warmup
    update of a replicated rule runs with: where the warmup decides something, the gradients
    averaged over the ranks (dense allreduce, checked finite on every rank: what the warmup
    rule would compute), ``auto`` after them (:func:`observed`) and ``h`` with the allreduce
    left out (``Local``); else ``grads``, ``state.auto`` and ``h``.

    Raises:
        ValueError: a gradient's shape differs from its state's, or an averaged gradient is
            non-finite (on every rank).
    """
    if auto is None:
        return grads, state.auto, h
    walk = gradient_leaves(name, grads, state.exp_avg_sq, non_freeze, state.auto.always_zero)
    means, scales, records = [], [], []
    for g, _, skip, record in zip(*(walk.at_live(k) for k in range(4)), strict=True):
        mean = check_finite(h.comm.all_reduce(g.float(), op="mean"), "the averaged gradient")
        means.append(mean)
        if g.numel() == 0:
            records.append(record)
            continue
        zero_bits, scale, _ = kernels.sign_compress(mean.reshape(-1).abs().neg())
        records.append(None if record is None else record & zero_bits)
        if not bool(skip):
            scales.append((scale, g.numel()))
    new = state.auto
    if auto.mask:
        new = new._replace(always_zero=walk.rebuild(records, fill=3))
    if auto.freeze is not None:
        new = observed(auto, new, _energy(scales), state.count)
    return walk.rebuild(means), new, h._replace(comm=Local())


def gradient_energy(grads: PyTree) -> torch.Tensor:
    r"""The gradient energy of ``grads`` as ``freeze_step="auto"`` measures it. Over the leaves
    (``None`` leaves skipped), it is :math:`Q = \sum_l n_l\, \mathrm{rms}(g_l)^2`, with
    :math:`\mathrm{rms}` the scale of ``fn.kernels.sign_compress`` (a fixed-order fp64 sum
    rounded once to fp32: the same bits on every device), squared and summed in fp64, in the
    leaves' order.

    The automatic switch of :func:`onebit_adam` computes this from the averaged gradients
    itself. A caller of :func:`onebit_adam_sharded` holds a shard of them: it computes its
    shard's energy with this function, sums it over the ranks (every rank must get the same
    bits) and passes the sum to the warmup update as ``gradient_energy=``. Zero padding adds
    nothing. The sum over shards equals the energy of the whole gradients up to fp64 rounding
    and the per-leaf fp32 rounding of the RMS (the shards' RMS are rounded, not the leaf's), so
    a switch decided from it can differ from the unsharded one only where the criterion is
    within that rounding of its threshold.

    Args:
        grads: a pytree of gradients (averaged over the ranks), or the local shard of them.

    Returns:
        A 0-dim fp64 tensor on the CPU.

    Raises:
        ValueError: a gradient is non-finite.

    Example:
        >>> import torch
        >>> import fn
        >>> grads = {"w": torch.tensor([2.0, -2.0, 2.0, -2.0]), "b": torch.tensor([3.0]), "x": None}
        >>> fn.transforms.gradient_energy(grads)  # 4 * 2 ** 2 + 1 * 3 ** 2
        tensor(25., dtype=torch.float64)
    """
    scales = []
    for g in tree_flatten(grads)[0]:
        if g is None or g.numel() == 0:
            continue
        _, scale, _ = kernels.sign_compress(g.float().reshape(-1).abs().neg())
        scales.append((scale, g.numel()))
    return _energy(scales)


def _energy(scales: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    r""":math:`\sum_l n_l s_l^2` in fp64 on the CPU, in the order given, of the RMS scales
    ``s_l`` (fp32) of leaves of ``n_l`` elements."""
    f64 = dict(dtype=torch.float64, device="cpu")
    q = torch.zeros((), **f64)
    for scale, n in scales:
        q = q + scale.to(**f64).square() * n
    return q


def observed_given(name: str, auto: AutoWarmup | None, state: Any, energy: Any) -> AutoState | None:
    """The state's ``auto`` after a warmup update of a sharded rule, from the gradient energy
    its caller summed over the ranks (:func:`observed`); ``state.auto`` where the warmup
    decides nothing.

    Raises:
        TypeError: ``energy`` is missing or not a 0-dim fp64 tensor on the CPU.
    """
    if auto is None:
        return state.auto
    if (
        not isinstance(energy, torch.Tensor)
        or energy.dtype != torch.float64
        or energy.dim() != 0
        or energy.device.type != "cpu"
    ):
        got = "nothing" if energy is None else repr(energy)
        raise TypeError(
            f'{name}: with freeze_step="auto" every warmup update needs gradient_energy=, the '
            "gradient energy of the averaged gradients as a 0-dim fp64 tensor on the CPU, the "
            "same on every rank (fn.transforms.gradient_energy of each rank's shard, summed "
            f"over the ranks); got {got}"
        )
    return observed(auto, state.auto, energy, state.count)


def observed(auto: AutoWarmup, state: AutoState, energy: torch.Tensor, count: Any) -> AutoState:
    """``state`` after the warmup update ``t = count + 1`` whose averaged gradient has the
    gradient energy ``energy`` (:func:`gradient_energy` over the leaves that freeze): the
    statistics of ``docs/algorithms.md`` and, while undecided, the decision
    ``freeze_at = t + 1``."""
    settings, b1, b2 = auto.freeze, auto.b1, auto.b2
    t = count + 1
    total = b2 * state.variance_sum + (1 - b2) * energy
    recent = b1 * state.recent_energy + (1 - b1) * energy
    debias = 1 - torch.tensor(b1, dtype=torch.float64).pow(t)
    settled = total >= (1 - settings.tolerance) * (recent / debias)
    decide = (
        (state.freeze_at == 0)
        & (t >= settings.min_updates)
        & (settled | (t >= settings.max_updates))
    )
    freeze_at = torch.where(decide, t + 1, state.freeze_at)
    return state._replace(freeze_at=freeze_at, variance_sum=total, recent_energy=recent)


def checked_auto(name: str, auto: AutoWarmup | None, state: Any) -> AutoState | None:
    """The state's ``auto`` checked against the optimizer's (``check_state``).

    Raises:
        ValueError: it was made by an optimizer with a fixed ``freeze_step`` for an automatic
            one or the reverse, likewise for ``exp_avg_mask="auto"``, or holds values of
            the wrong form.
    """
    have = getattr(state, "auto", None)
    frozen_auto = have is not None and have.freeze_at is not None
    mask_auto = have is not None and have.always_zero is not None
    want_freeze = auto is not None and auto.freeze is not None
    want_mask = auto is not None and auto.mask
    if frozen_auto != want_freeze:
        made, here = ('"auto"', "a fixed one") if frozen_auto else ("a fixed one", '"auto"')
        raise ValueError(
            f"{name}: the state was made with freeze_step {made}, this optimizer has {here}: "
            "their states differ (the automatic switch is decided in the state); build the "
            "optimizer as the state's was"
        )
    if mask_auto != want_mask:
        made, here = ("", " not") if mask_auto else (" not", "")
        raise ValueError(
            f'{name}: the state was made with exp_avg_mask{made} "auto", this optimizer\'s is'
            f"{here}; build the optimizer as the state's was"
        )
    if have is None:
        return None
    if want_freeze:
        forms = (
            ("freeze_at", torch.int64),
            ("variance_sum", torch.float64),
            ("recent_energy", torch.float64),
        )
        for field, dtype in forms:
            x = getattr(have, field)
            if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.dim() != 0:
                raise ValueError(f"{name}: auto.{field} must be a 0-dim {dtype} tensor")
        if min(int(have.freeze_at), float(have.variance_sum), float(have.recent_energy)) < 0:
            raise ValueError(
                f"{name}: auto holds a negative freeze_at, variance_sum or recent_energy"
            )
        have = have._replace(**{f: getattr(have, f).cpu() for f, _ in forms})
    if want_mask:
        walk = live_leaves(state.exp_avg_sq, have.always_zero)
        for v, record in zip(walk.at_live(0), walk.at_live(1), strict=True):
            size = -(-v.numel() // 8)
            if (
                not isinstance(record, torch.Tensor)
                or record.dtype != torch.uint8
                or tuple(record.shape) != (size,)
            ):
                raise ValueError(
                    f"{name}: auto.always_zero holds a leaf that is not uint8 [{size}] for a "
                    f"param of {v.numel()} elements"
                )
    return have


def checks(
    name: str, settings: Any, auto: AutoWarmup | None, exp_avg_mask: Any, non_freeze: Any = None
) -> dict[str, Callable[[Any], Any]]:
    """The ``check_state`` and ``full_state`` of 1-bit Adam and 1-bit LAMB: those of
    ``fn.transforms._onebit_state`` (with the optimizer's masks; ``non_freeze`` leaves never
    compressed), the field ``auto`` checked too (:func:`checked_auto`)."""

    def check_state(state):
        state = onebit_state.checked_state(name, settings, state)
        return state._replace(auto=checked_auto(name, auto, state))

    def full_state(state):
        mask = onebit_state.masks_of(exp_avg_mask, state)
        return onebit_state.full_state(settings, mask, state, never_compressed=non_freeze)

    return dict(check_state=check_state, full_state=full_state)
