"""Host-side schedules of the 1-bit family: functions of the 1-based update count ``t``.

Which collective runs at update ``t`` is decided here, on the host, from ``t`` alone, except
with ``freeze_step="auto"`` (:class:`AutoFreeze`): there the warmup decides the first
compressed update and keeps it in the state (``freeze_at``), which :class:`AutoFreezeSchedule`
reads on the host. The state counters of the optimizers otherwise only record these values (for
checkpoints and inspection) and never decide anything.

DeepSpeed 0.18.9 counted a gradient-dropping "init step" before the first real update, so its
counter read ``c = t + 1`` at real update ``t``. The rules below are written so that real update
``t`` does what DeepSpeed did at its counter ``c = t + 1`` (see ``docs/algorithms.md``).

Each schedule also gives the *plan* of update ``t``: a NamedTuple of Python bools holding every
host-side decision the update makes. The updates read only the plan, so under ``torch.compile``
(which guards Python values) a training step compiles once per distinct plan, a handful in all,
however many steps are run. Every plan has a ``compressed`` attribute: which update runs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fn.errors import check_int
from fn.transforms._leafwise import host_tensor


class OnebitAdamPlan(NamedTuple):
    """The host-side decisions of a 1-bit Adam update (``fn.onebit_adam``'s ``plan(t)``).

    Attributes:
        compressed: the compressed rule (1-bit allreduce of the momentum, variance frozen),
            else the warmup.
        freezes: the first compressed update: the variance freezes, the error feedback is
            allocated and the fp32 momentum of the warmup becomes the packed signs the
            allreduce returns.

    Example:
        >>> opt = fn.onebit_adam(lr=1e-3, freeze_step=3, comm=fn.collectives.Local())
        >>> opt.plan(3)
        OnebitAdamPlan(compressed=True, freezes=True)
    """

    compressed: bool
    freezes: bool


class OnebitLambPlan(NamedTuple):
    """The host-side decisions of a 1-bit LAMB update (``fn.onebit_lamb``'s ``plan(t)``).

    Attributes:
        compressed: the compressed rule, else the warmup (LAMB on the averaged gradient).
        copies_variance: the last warmup update: the fresh variance starts as a copy of the
            variance.
        sets_scaling: the first compressed update: the momentum scaling is computed.

    Example:
        >>> opt = fn.onebit_lamb(lr=1e-3, freeze_step=3, comm=fn.collectives.Local())
        >>> opt.plan(2)
        OnebitLambPlan(compressed=False, copies_variance=True, sets_scaling=False)
    """

    compressed: bool
    copies_variance: bool
    sets_scaling: bool


class ZeroOneAdamPlan(NamedTuple):
    """The host-side decisions of a 0/1 Adam update (``fn.zero_one_adam``'s ``plan(t)``).

    Attributes:
        variance: a variance refresh on the dense-allreduced gradient (``warmup_update``).
        frozen: a local step (the variance is frozen).
        sync: a frozen step that ends with the 1-bit synchronization of the accumulator.
        reset_errors: the last unfrozen update: the error buffers are zeroed after it.

    Example:
        >>> opt = fn.zero_one_adam(lr=1e-3, var_freeze_step=3, comm=fn.collectives.Local())
        >>> opt.plan(4), opt.plan(4).compressed
        (ZeroOneAdamPlan(variance=False, frozen=True, sync=True, reset_errors=False), True)
    """

    variance: bool
    frozen: bool
    sync: bool
    reset_errors: bool

    @property
    def compressed(self) -> bool:
        """Every update but a variance refresh is a ``compressed_update``."""
        return not self.variance


class FreezeSchedule(NamedTuple):
    """The two phases of 1-bit Adam and 1-bit LAMB.

    Update ``t`` warms up (dense allreduce, full-precision Adam/LAMB) while ``t < freeze_step``
    and is compressed from ``t == freeze_step`` on (from ``t == 1`` when ``freeze_step <= 1``).
    The schedule itself takes any ``freeze_step``; ``onebit_adam`` and ``onebit_lamb`` require
    ``freeze_step >= 2``, since their compressed updates need a variance estimated in warmup.
    The ``state`` arguments are not used (see :class:`AutoFreezeSchedule`).
    """

    freeze_step: int

    def is_compressed(self, t: int, state: Any = None) -> bool:
        """True if update ``t`` uses the compressed rule."""
        return t >= self.freeze_step

    def first_compressed_step(self, state: Any = None) -> int:
        """The first compressed update (1-bit LAMB computes its scaling coefficients there)."""
        return max(self.freeze_step, 1)

    def is_last_warmup_step(self, t: int) -> bool:
        """True at the last warmup update, ``c == freeze_step``, where 1-bit LAMB copies its
        variance into the fresh variance."""
        return t + 1 == self.freeze_step

    def onebit_adam_plan(self, t: int, state: Any = None) -> OnebitAdamPlan:
        """The plan of 1-bit Adam's update ``t``."""
        return OnebitAdamPlan(self.is_compressed(t), t == self.first_compressed_step())

    def onebit_lamb_plan(self, t: int, state: Any = None) -> OnebitLambPlan:
        """The plan of 1-bit LAMB's update ``t``."""
        return OnebitLambPlan(
            self.is_compressed(t), self.is_last_warmup_step(t), t == self.first_compressed_step()
        )


class AutoFreeze(NamedTuple):
    r"""``freeze_step="auto"``'s settings: the warmup ends once the variance has caught up with
    the gradients.

    At the end of warmup update ``t`` the next update becomes the first compressed one when
    ``t >= min_updates`` and either the sum of the variance :math:`T_t` (as it would freeze:
    1-bit Adam has no bias correction) holds at least ``1 - tolerance`` of the gradients' recent
    energy :math:`\hat E_t` (their squared norm averaged with the momentum's beta), or
    ``t >= max_updates`` (the rule and its evidence: ``docs/algorithms.md``, "Automatic freeze
    and momentum mask"). ``"auto"`` is ``AutoFreeze()``.

    Attributes:
        min_updates: the fewest warmup updates (at least 1).
        max_updates: the most warmup updates (at least ``min_updates``).
        tolerance: the fraction of the recent gradient energy that the variance may still lack
            at the switch, in ``(0, 1)``: the compressed updates then start at most
            :math:`1 / \sqrt{1 - \text{tolerance}}` times (1.41 for 0.5) the steps of a
            variance that matched the gradients.

    Example:
        >>> opt = fn.onebit_adam(freeze_step=fn.AutoFreeze(min_updates=20, max_updates=200),
        ...                      comm=fn.collectives.Local())
        >>> opt.first_compressed_update(1000)  # undecided: the latest the switch can be
        201
    """

    min_updates: int = 10
    max_updates: int = 1000
    tolerance: float = 0.5

    def checked(self) -> AutoFreeze:
        """The settings, checked.

        Raises:
            ValueError: ``min_updates < 1``, ``max_updates < min_updates`` or a tolerance
                outside ``(0, 1)``, naming the value.
        """
        check_int("AutoFreeze.min_updates", self.min_updates, 1, "the variance needs a warmup")
        check_int("AutoFreeze.max_updates", self.max_updates, 1)
        if self.min_updates > self.max_updates:
            raise ValueError(
                f"AutoFreeze: min_updates ({self.min_updates}) is above max_updates "
                f"({self.max_updates})"
            )
        tolerance = self.tolerance
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
            raise ValueError(f"AutoFreeze.tolerance must be a number in (0, 1), got {tolerance!r}")
        if not 0 < tolerance < 1:
            raise ValueError(f"AutoFreeze.tolerance must be in (0, 1), got {tolerance!r}")
        return self


class AutoFreezeSchedule(NamedTuple):
    """The two phases of 1-bit Adam and 1-bit LAMB with ``freeze_step="auto"``: the first
    compressed update is the state's ``auto.freeze_at`` (0 while the warmup has not decided it),
    read on the host. The plans are :class:`FreezeSchedule`'s with that ``freeze_step``, except
    that 1-bit LAMB's last warmup update is not known in advance (every warmup update of an
    automatic switch sets the fresh variance to the variance instead: the same values).
    """

    settings: AutoFreeze

    def freeze_at(self, state: Any) -> int:
        """The first compressed update decided in ``state``, 0 while undecided.

        Raises:
            TypeError: no state is given, or its decision cannot be read on the host (under
                ``torch.compile``: pass ``plan=opt.plan(t, state)`` computed outside).
        """
        if state is None:
            raise TypeError(
                'freeze_step="auto" keeps its decision in the state: pass it, '
                "opt.is_compressed(t, state) or opt.plan(t, state)"
            )
        return read_freeze_at(state.auto.freeze_at)

    def is_compressed(self, t: int, state: Any = None) -> bool:
        """True if update ``t`` uses the compressed rule, by the decision in ``state``."""
        return 0 < self.freeze_at(state) <= t

    def first_compressed_step(self, state: Any = None) -> int:
        """The first compressed update: decided in ``state``, or, while undecided or without a
        state, the latest it can be (``max_updates + 1``)."""
        freeze_at = 0 if state is None else self.freeze_at(state)
        return freeze_at if freeze_at > 0 else self.settings.max_updates + 1

    def onebit_adam_plan(self, t: int, state: Any = None) -> OnebitAdamPlan:
        """The plan of 1-bit Adam's update ``t``."""
        freeze_at = self.freeze_at(state)
        return OnebitAdamPlan(0 < freeze_at <= t, t == freeze_at)

    def onebit_lamb_plan(self, t: int, state: Any = None) -> OnebitLambPlan:
        """The plan of 1-bit LAMB's update ``t``."""
        freeze_at = self.freeze_at(state)
        return OnebitLambPlan(0 < freeze_at <= t, False, t == freeze_at)


def read_freeze_at(freeze_at: torch.Tensor) -> int:
    """The value of a state's ``freeze_at`` on the host: under ``Simulated`` (vmap) the ranks'
    common value.

    Raises:
        TypeError: the value cannot be read here (``torch.compile`` or another functorch
            transform).
        RuntimeError: the ranks' values differ (they are computed alike on every rank).
    """
    x = host_tensor(freeze_at)
    if x is None:
        raise TypeError(
            'freeze_step="auto": the decided first compressed update cannot be read on the '
            "host here (torch.compile or a functorch transform); pass plan=opt.plan(t, state) "
            "computed outside"
        )
    low, high = int(x.min()), int(x.max())
    if low != high:
        raise RuntimeError(f"freeze_step='auto': the ranks decided differently ({low}, {high})")
    return high


def freeze_schedule(freeze_step: Any, why: str) -> FreezeSchedule | AutoFreezeSchedule:
    """The schedule of ``freeze_step``: an int (at least 2, ``why``), ``"auto"`` or an
    :class:`AutoFreeze`.

    Raises:
        ValueError: another value, or an invalid one (naming it).
    """
    if isinstance(freeze_step, str):
        if freeze_step != "auto":
            raise ValueError(f'freeze_step must be an int >= 2 or "auto", got {freeze_step!r}')
        return AutoFreezeSchedule(AutoFreeze())
    if isinstance(freeze_step, AutoFreeze):
        return AutoFreezeSchedule(freeze_step.checked())
    return FreezeSchedule(check_int("freeze_step", freeze_step, 2, why))


# How closely 0/1 Adam's ranks' params agree after a synchronization (relative, of their sums).
SYNCED_RTOL = 1e-4


class ZeroOneAdamCounters(NamedTuple):
    """0/1 Adam's schedule counters, as DeepSpeed kept them, at the start of an update."""

    var_interval: int
    var_counter: int
    local_interval: int
    local_counter: int
    frozen: bool


class ZeroOneAdamSchedule(NamedTuple):
    """The schedules of 0/1 Adam (Lu et al. 2022), as pure functions of the update count ``t``.

    With ``c = t + 1`` and ``t0 = max(var_freeze_step, 1)``:

    - ``frozen(t) = t > t0``: after update ``t0`` the variance is frozen for good.
    - Before that, the variance is refreshed (a dense allreduce, :meth:`is_variance_step`) when
      ``c % var_interval == 0``; after every ``var_update_scaler`` refreshes ``var_interval``
      doubles. Every other unfrozen update 1-bit-allreduces the local gradient.
    - Frozen updates are local; update ``t`` is a synchronization (:meth:`is_sync_step`) when
      ``c % local_interval == 0``; ``local_interval`` starts at 1 and becomes
      ``min(local_step_clipper, 2 * local_interval)`` after every ``local_step_scaler`` frozen
      updates.
    - The error buffers are zeroed at the end of update ``t0`` (:meth:`resets_errors`).

    Attributes:
        var_freeze_step: the last update before the variance freezes (``t0``, at least 1).
        var_update_scaler: variance refreshes per interval before ``var_interval`` doubles.
        local_step_scaler: frozen updates per local interval before it doubles.
        local_step_clipper: the largest local interval.

    Example:
        Variance refreshes (v), 1-bit updates (1), local steps (l) and syncs (s):

        >>> s = fn.ZeroOneAdamSchedule(var_freeze_step=4, var_update_scaler=1,
        ...                            local_step_scaler=2, local_step_clipper=4)
        >>> kinds = [("v" if s.is_variance_step(t) else "s" if s.is_sync_step(t)
        ...           else "l" if s.frozen(t) else "1") for t in range(1, 13)]
        >>> "".join(kinds)
        'v1v1ssslllsl'
    """

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int

    @property
    def last_unfrozen_step(self) -> int:
        return max(self.var_freeze_step, 1)

    def frozen(self, t: int) -> bool:
        """True if update ``t`` runs with the variance frozen (local steps and syncs)."""
        return t > self.last_unfrozen_step

    def counters(self, t: int) -> ZeroOneAdamCounters:
        """The counters at the start of update ``t`` (``t = 1`` gives the initial values).

        :meta private: (DeepSpeed's counters, which the state records)
        """
        interval, counter = 1, 0
        last_c = min(t - 1, self.last_unfrozen_step) + 1
        c = 1
        while True:  # jump from one variance update to the next: O(refreshes), not O(t)
            c = (c // interval + 1) * interval
            if c > last_c:
                break
            counter += 1
            if counter == self.var_update_scaler:
                counter, interval = 0, 2 * interval
        frozen = self.frozen(t)
        local_interval, local_counter = 1, 0
        if frozen:
            n = t - 1 - self.last_unfrozen_step  # frozen updates made before t
            doublings = min(n // self.local_step_scaler, self.local_step_clipper.bit_length())
            local_interval = min(self.local_step_clipper, 2**doublings)
            local_counter = n % self.local_step_scaler
        return ZeroOneAdamCounters(interval, counter, local_interval, local_counter, frozen)

    def is_variance_step(self, t: int) -> bool:
        """True if update ``t`` refreshes the variance on a dense-allreduced gradient."""
        return not self.frozen(t) and (t + 1) % self.counters(t).var_interval == 0

    def is_sync_step(self, t: int) -> bool:
        """True if update ``t`` is frozen and ends with a 1-bit synchronization."""
        return self.frozen(t) and (t + 1) % self.counters(t).local_interval == 0

    def is_compressed(self, t: int, state: Any = None) -> bool:
        """Every update but the variance refreshes uses ``compressed_update`` (``state`` is not
        used)."""
        return not self.is_variance_step(t)

    def resets_errors(self, t: int) -> bool:
        """True at the update after which the variance freezes (the error buffers are zeroed)."""
        return t == self.last_unfrozen_step

    def param_agreement(self, t: int) -> float | None:
        """How closely the ranks' params agree after update ``t``: bit for bit until the variance
        freezes (every rank applies the same update); after a synchronization up to fp32
        rounding (``SYNCED_RTOL = 1e-4`` of their sums: each rank replaces its own local updates by
        the synchronized one); not at all after a local step."""
        if not self.frozen(t):
            return 0.0
        return SYNCED_RTOL if self.is_sync_step(t) else None

    def plan(self, t: int, state: Any = None) -> ZeroOneAdamPlan:
        """The plan of update ``t`` (one ``counters`` evaluation; ``state`` is not used).

        Args:
            t: the 1-based update count.
            state: ignored (the schedules of the 1-bit family share this signature).

        Returns:
            The :class:`ZeroOneAdamPlan`.
        """
        counters = self.counters(t)
        c = t + 1
        return ZeroOneAdamPlan(
            variance=not counters.frozen and c % counters.var_interval == 0,
            frozen=counters.frozen,
            sync=counters.frozen and c % counters.local_interval == 0,
            reset_errors=self.resets_errors(t),
        )
