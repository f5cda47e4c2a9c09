"""fn: functional, communication-compressed optimizers for PyTorch.

Optimizers are pure state transitions over pytrees of tensors, in the style of optax::

    tx = fn.adam(lr=1e-3)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = fn.apply_updates(params, updates)
"""

import torch

from fn import ddp, optim, tree
from fn.base import (
    CompressedOptimizer,
    EmptyState,
    GradientTransformation,
    StagedState,
    apply_updates,
    chain,
    get_hyperparam,
    identity,
    set_hyperparams,
    staged,
    stateless,
    stateless_with_tree_map,
    update_and_apply,
)
from fn.errors import NonFiniteError
from fn.transforms import *  # noqa: F403
from fn.transforms import __all__ as _transforms_all

# torch.load's default (weights_only=True) unpickles only the classes registered as safe; each
# package registers the classes of its states (fn.transforms and fn.collectives their own).
torch.serialization.add_safe_globals([EmptyState, StagedState])

__version__ = "0.1.0.dev0"

__all__ = [
    "ddp",
    "optim",
    "tree",
    "CompressedOptimizer",
    "EmptyState",
    "GradientTransformation",
    "NonFiniteError",
    "StagedState",
    "apply_updates",
    "chain",
    "get_hyperparam",
    "identity",
    "set_hyperparams",
    "staged",
    "stateless",
    "stateless_with_tree_map",
    "update_and_apply",
    *_transforms_all,
]
