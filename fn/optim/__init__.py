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

The adapter's policies (gradient communication, flat buffers, mixed precision, frozen params,
steps without gradients, non-finite gradients, all-or-nothing steps, ``GradScaler``,
``torch.compile``, learning rates, DeepSpeed imports, checkpoints) are in docs/torch-optim.md.

Example:
    Any transform, here on one worker (``comm=Local()``; under ``torchrun`` leave it out):

    >>> model = torch.nn.Linear(2, 1)
    >>> opt = fn.optim.FunctionalOptimizer(model.parameters(), fn.adamw(lr=1e-3),
    ...                                    comm=fn.collectives.Local())
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> opt.step()
    >>> opt.state_dict()["state"][0]["step"]
    1
"""

from fn.optim._adapter import FunctionalOptimizer
from fn.optim._checkpoint import PerRankState
from fn.optim._consensus import default_comm
from fn.optim._deepspeed import checkpoint_files, convert_checkpoint, from_deepspeed
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
    "checkpoint_files",
    "scheduler_from_deepspeed",
    "DeepSpeedLR",
]
