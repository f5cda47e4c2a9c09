"""fn with ``torch.nn.parallel.DistributedDataParallel``.

- ``register(ddp_model, optimizer)``: ``fn.optim``'s 1-bit family (``OnebitAdam``,
  ``ZeroOneAdam``, ``OnebitLamb``) on a DDP model: DDP averages the gradients of warmup updates
  and sends nothing for compressed ones, so the run equals the same run without DDP.
- Comm hooks for any optimizer, in PyTorch's convention
  (``ddp_model.register_comm_hook(state, hook)``, as ``powerSGD_hook``): ``onebit_hook`` with
  :class:`OnebitHookState` (error-compensated 1-bit allreduce of each bucket) and ``loco_hook``
  with :class:`LocoHookState` (4/8-bit with LoCo error feedback). Both average densely for
  ``start_iter`` iterations first, keep per-bucket error feedback that checkpoints with
  ``state.state_dict()`` / ``state.load_state_dict()``, and compress on the state's background
  thread while autograd computes the next buckets (``overlap=False``: inside the hook).
- Non-finite gradients: ``register`` follows the optimizer's ``nonfinite`` policy; the hooks'
  states take ``nonfinite="propagate"`` (default, for ``torch.amp.GradScaler``) or ``"raise"``
  (see ``OnebitHookState``).

Example:
    One rank here (under ``torchrun`` every rank runs the same lines): DDP averages the warmup
    update, the compressed ones communicate through the optimizer alone.

    >>> import torch.distributed as dist
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    >>> opt = fn.optim.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2)
    >>> fn.ddp.register(model, opt)
    >>> for _ in range(2):
    ...     opt.zero_grad()
    ...     model(torch.ones(2, 4)).sum().backward()
    ...     opt.step()
    >>> opt.next_update_compressed()
    [True]
    >>> dist.destroy_process_group()
"""

from fn.ddp.loco import LocoHookState, loco_hook
from fn.ddp.onebit import OnebitHookState, onebit_hook
from fn.ddp.registration import register

__all__ = ["register", "onebit_hook", "OnebitHookState", "loco_hook", "LocoHookState"]
