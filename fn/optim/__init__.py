"""A thin stateful ``torch.optim`` adapter over fn's pure transforms.

``FunctionalOptimizer(params, transform)`` runs any ``GradientTransformation`` or
``CompressedOptimizer`` as a ``torch.optim.Optimizer``; ``OnebitAdam``, ``ZeroOneAdam`` and
``OnebitLamb`` are drop-in optimizers with the arguments of ``fn.onebit_adam``,
``fn.zero_one_adam`` and ``fn.onebit_lamb`` (their shared base: ``OnebitFamily``)::

    opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=1000)  # under torchrun
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

Policies (the same on every rank, so the ranks always issue the same collectives):

- Gradient communication: the optimizer owns it. Do NOT wrap the model in DDP (unless the
  1-bit family is attached to it with ``fn.ddp.register``): each rank's ``.grad`` must hold its
  LOCAL gradient. A ``CompressedOptimizer`` averages the gradients itself
  (dense in warmup, 1-bit once compressed); a plain ``GradientTransformation`` gets the gradients
  averaged by the adapter first (one dense allreduce per group, ``sync_grads``). So anything
  applied to ``.grad`` before ``step()`` (e.g. ``clip_grad_norm_``) sees the local gradient.
- A DDP model fn was not told about: gradients that arrive averaged already are noticed once,
  at the first ``step()`` on several ranks (the ranks all_gather 3 int64 per group, sums of
  their gradients' bit patterns; bit-identical and non-zero on every rank means averaged, or
  the same batch everywhere), and one ``UserWarning`` names the fix (``fn.ddp.register`` or
  the stack's ``fn.integrations`` glue; ``sync_grads=False`` for a plain transform). Nothing
  else changes; later steps pay one attribute test.
- Flat buffers: per param group the params are copied into one contiguous buffer and each
  param's ``.data`` aliases its slice of it with a storage of its own (so safetensors and
  accelerate save and load the model as any other). A param whose storage is replaced later
  (``model.to(<same device>)``, as Trainer and accelerate do, or ``p.data = t``) is re-adopted
  before the next step; a move to another device or dtype is an error (build the optimizer
  after ``model.to(...)``). Params on the meta device are a ``ValueError`` when their group is
  built: build the optimizer after ``model.to_empty(device=...)`` and initialization. With
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
- Params with ``requires_grad=False`` when their group is built are left out: they take no space
  in the flat buffers and no part in the collectives (a frozen backbone costs nothing per step).
  Unlike ``torch.optim``, they are not trained once they require a gradient: ``step()`` then
  raises ``RuntimeError`` (nothing changed); unfreeze them before building the optimizer or add
  them with ``add_param_group``. A param whose ``.grad`` is ``None`` at a step
  counts as a zero gradient (as DDP's ``find_unused_parameters``) when some param has a
  gradient on some rank: every rank must run the same collectives. Momentum and weight decay
  therefore still move such params.
- A ``step()`` at which no param of any group has a gradient on any rank (before any backward
  pass, or again after ``zero_grad()``) is no update: nothing changes (params, state, error
  feedback, step counts), on every rank alike. The ranks learn it from the allreduce every step
  makes for its non-finite check (one more int64 in it: no collective of its own), so a rank
  without gradients never skips a collective that another rank runs. ``last_step_skipped`` is
  then ``True``; ``skipped_steps`` counts only non-finite steps.
- Non-finite and unusable gradients: the ranks agree on one decision (a 3-element allreduce of the
  count of non-finite gradient elements, of the ranks holding a gradient the optimizer cannot
  take, a sparse one, and of the ranks holding any gradient; for an unusable one every rank
  raises the same ``ValueError``, the rank that holds it naming the param, and nothing
  changes). Finite gradients whose average over the ranks overflows
  count as non-finite too (every rank holds the same average, so all decide alike). ``OnebitAdam``
  counts none of its own (no pass over its gradients; the allreduce stays, for a ``GradScaler``'s
  overflow flags): its updates reject a non-finite gradient of any rank on every rank before they
  write anything (the warmup checks the averaged gradient, the compressed update the scales its
  1-bit allreduce gathers), with the same outcome. ``nonfinite="raise"`` (default) raises
  ``fn.NonFiniteError`` (a ``ValueError``) on every rank, ``"skip"`` skips the step; either way
  nothing changes (params, state, error feedback, step counts). A step driven by
  ``torch.amp.GradScaler`` always skips on overflow (that is the scaler's protocol; it then lowers
  its scale).
- All or nothing: ``step()`` first checks everything (params, frozen params, every group's
  hyperparameters in ``param_groups``, the gradients), then computes every group's update and new
  state into the group's own buffers (its gradient buffer and spare state, see
  ``FunctionalOptimizer``'s "Buffers"; the live state and the params are not written), the last
  group's update added to its params in the same step (``fn.update_and_apply``: one pass over
  them where the transform has a fused step, e.g. ``fn.adam``) once every other group's update
  exists, and commits all groups last. Every check that can reject the step (the gradients, the
  averaged gradients, the transforms' own checks, every collective) runs before the first write
  to the params. A step that raises or is skipped in any group leaves every group's params,
  state, transform and step count as they were, so the groups' step counts never drift apart.
- ``GradScaler``: the optimizer declares ``_step_supports_amp_scaling``: ``scaler.step(opt)``
  always calls ``opt.step()``, which unscales the gradients itself (its ``.grad`` stay scaled)
  and makes the overflow decision global. (Without this, a rank that overflowed alone would skip
  ``step()`` and leave the others waiting in a collective.) Each rank's scaler still updates its
  scale from its local overflow flag (the scaler offers no way to give it the global one);
  scales are powers of two, so the unscaled gradients do not depend on it. The exception is
  ``fn.ddp.register`` with 0/1 Adam: after a compressed update where only some ranks
  overflowed, the ranks' scales differ, and a later variance refresh, where DDP averages the
  still-scaled gradients, mixes them.
- ``torch.compile``: ``step()`` is an eager boundary (``torch.compiler.disable``); a compiled
  training step that calls it breaks its graph there once and never recompiles for it.
- Learning rates: a Python number or, as in ``torch.optim``, a one-element floating-point
  tensor, whose value is read at every step (a scheduler may write it in place).
- Coming from DeepSpeed: ``from_deepspeed(params, config, state_dict=...)`` builds the optimizer
  of a DeepSpeed 1-bit config and imports its checkpointed state, ``scheduler_from_deepspeed``
  its LR schedule, and ``convert_checkpoint(folder)`` turns a DeepSpeed checkpoint folder into
  a file they resume from (docs/migrating-from-deepspeed.md).
- Checkpoints: ``state_dict()`` holds, per group, the host-side step count, the whole functional
  state (error feedback included) as a flat dict of tensors, and the fp32 master copy; loading it
  into a fresh optimizer continues bit for bit. Only plain containers, tensors and numbers are
  stored, so ``torch.load(weights_only=True)`` reads it. ``load_state_dict`` checks every group
  first (layout, structure of the right optimizer, shapes, hyperparameters, finite values, second
  moments >= 0) and loads nothing unless all of it fits; errors name the group and field.
  ``state_dict()["state"]`` is keyed by group index (the state is per group, not per param), and
  ``opt.state``, torch's per-param dict, stays empty. Each record names the rank it was saved on:
  error feedback is per rank, so a rank loading another rank's state (Trainer and accelerate load
  rank 0's everywhere) resets its error feedback with a warning, unless
  ``gather_error_feedback()`` (a collective, on every rank before rank 0 saves;
  ``fn.integrations`` calls it) put every rank's into it (``None`` for a buffer not allocated yet,
  in warmup). ``PerRankState(opt)`` saves each rank's with ``torch.distributed.checkpoint``, and
  the fields that differ between ranks by design (``fn.base.PerRankField``: 0/1 Adam's momentum
  and accumulator between synchronizations) with it. The 1-bit family's state changes form with
  its phase (error feedback allocated at the freeze, 1-bit Adam's and 1-bit LAMB's momentum kept
  as packed signs once compressed); a checkpoint holds it in the form it had, and loads exactly
  into an optimizer at any step count, in warmup or compressed (``check_state`` checks each form;
  ``PerRankState`` saves the one full layout, ``full_state``, that DCP loads in place).
- Environment: ``comm=None`` under ``torchrun`` (``WORLD_SIZE`` > 1) before
  ``torch.distributed`` is initialized is an error, not a silent single-process run.
"""

from fn.optim._adapter import FunctionalOptimizer
from fn.optim._checkpoint import PerRankState
from fn.optim._consensus import default_comm
from fn.optim._deepspeed import convert_checkpoint, from_deepspeed
from fn.optim._onebit import OnebitAdam, OnebitFamily, OnebitLamb, ZeroOneAdam
from fn.optim._schedulers import DeepSpeedLR, scheduler_from_deepspeed

__all__ = [
    "FunctionalOptimizer",
    "OnebitAdam",
    "ZeroOneAdam",
    "OnebitLamb",
    "OnebitFamily",
    "PerRankState",
    "default_comm",
    "from_deepspeed",
    "convert_checkpoint",
    "scheduler_from_deepspeed",
    "DeepSpeedLR",
]
