"""Host-side schedules of the 1-bit family: pure functions of the 1-based update count ``t``.

Which collective runs at update ``t`` is decided here, on the host, from ``t`` alone; the state
counters of the optimizers only record these values (for checkpoints and inspection) and never
decide anything.

DeepSpeed 0.18.9 counted a gradient-dropping "init step" before the first real update, so its
counter read ``c = t + 1`` at real update ``t``. The rules below are written so that real update
``t`` does what DeepSpeed did at its counter ``c = t + 1`` (see ``docs/algorithms.md``).

Each schedule also gives the *plan* of update ``t``: a NamedTuple of Python bools holding every
host-side decision the update makes. The updates read only the plan, so under ``torch.compile``
(which guards Python values) a training step compiles once per distinct plan, a handful in all,
however many steps are run. Every plan has a ``compressed`` attribute: which update runs.
"""

from __future__ import annotations

from typing import NamedTuple


class OnebitAdamPlan(NamedTuple):
    """The host-side decisions of a 1-bit Adam update."""

    compressed: bool  # the compressed rule (1-bit allreduce of m, v frozen), else warmup
    # the first compressed update: the variance freezes, the error feedback is allocated and the
    # fp32 momentum of the warmup becomes the packed signs the allreduce returns
    freezes: bool


class OnebitLambPlan(NamedTuple):
    """The host-side decisions of a 1-bit LAMB update."""

    compressed: bool  # the compressed rule, else warmup (LAMB on the averaged gradient)
    copies_variance: bool  # the last warmup update: the fresh variance starts as a copy of v
    sets_scaling: bool  # the first compressed update: the momentum scaling is computed


class ZeroOneAdamPlan(NamedTuple):
    """The host-side decisions of a 0/1 Adam update."""

    variance: bool  # a variance refresh on the dense-allreduced gradient (``warmup_update``)
    frozen: bool  # a local step (the variance is frozen)
    sync: bool  # a frozen step that ends with the 1-bit synchronization of the accumulator
    reset_errors: bool  # the last unfrozen update: the error buffers are zeroed after it

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
    """

    freeze_step: int

    def is_compressed(self, t: int) -> bool:
        """True if update ``t`` uses the compressed rule."""
        return t >= self.freeze_step

    def first_compressed_step(self) -> int:
        """The first compressed update (1-bit LAMB computes its scaling coefficients there)."""
        return max(self.freeze_step, 1)

    def is_last_warmup_step(self, t: int) -> bool:
        """True at the last warmup update, ``c == freeze_step``, where 1-bit LAMB copies its
        variance into the fresh variance."""
        return t + 1 == self.freeze_step

    def onebit_adam_plan(self, t: int) -> OnebitAdamPlan:
        """The plan of 1-bit Adam's update ``t``."""
        return OnebitAdamPlan(self.is_compressed(t), t == self.first_compressed_step())

    def onebit_lamb_plan(self, t: int) -> OnebitLambPlan:
        """The plan of 1-bit LAMB's update ``t``."""
        return OnebitLambPlan(
            self.is_compressed(t), self.is_last_warmup_step(t), t == self.first_compressed_step()
        )


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
        """The counters at the start of update ``t`` (``t = 1`` gives the initial values)."""
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

    def is_compressed(self, t: int) -> bool:
        """Every update but the variance refreshes uses ``compressed_update``."""
        return not self.is_variance_step(t)

    def resets_errors(self, t: int) -> bool:
        """True at the update after which the variance freezes (the error buffers are zeroed)."""
        return t == self.last_unfrozen_step

    def param_agreement(self, t: int) -> float | None:
        """How closely the ranks' params agree after update ``t``: bit for bit until the variance
        freezes (every rank applies the same update); after a synchronization up to fp32
        rounding (:data:`SYNCED_RTOL` of their sums: each rank replaces its own local updates by
        the synchronized one); not at all after a local step."""
        if not self.frozen(t):
            return 0.0
        return SYNCED_RTOL if self.is_sync_step(t) else None

    def plan(self, t: int) -> ZeroOneAdamPlan:
        """The plan of update ``t`` (one :meth:`counters` evaluation)."""
        counters = self.counters(t)
        c = t + 1
        return ZeroOneAdamPlan(
            variance=not counters.frozen and c % counters.var_interval == 0,
            frozen=counters.frozen,
            sync=counters.frozen and c % counters.local_interval == 0,
            reset_errors=self.resets_errors(t),
        )
