"""Pure optimizer transforms: Adam, LAMB, SGD, their building blocks, masking, and the
communication-compressed 1-bit family.

Policies shared by every transform here:

- A ``None`` update (a param without a gradient) comes out ``None`` and its state leaves are
  left unchanged; ``fn.apply_updates`` then leaves the param as it is. Step counters are shared
  by all leaves (not per leaf as in ``torch.optim``).
- An update whose shape differs from its state or param raises ``ValueError`` (no broadcasting).
- Non-finite gradients propagate into the returned state, as in ``torch.optim``; the input state
  is never modified, so a loop can drop such a step by checking ``fn.tree.tree_all_finite``.
- Hyperparameters that schedulers change (``lr``) are 0-dim fp32 tensors in the state, set with
  ``fn.set_hyperparams``; the rest are Python floats fixed when the transform is built.
"""

import torch

from fn.transforms._onebit_auto import AutoState, gradient_energy
from fn.transforms._onebit_schedules import (
    AutoFreeze,
    OnebitAdamPlan,
    OnebitLambPlan,
    ZeroOneAdamPlan,
    ZeroOneAdamSchedule,
)
from fn.transforms._onebit_state import momentum_of
from fn.transforms.adam_transform import ScaleByAdamState, adam, adamw, scale_by_adam
from fn.transforms.lamb_transform import lamb
from fn.transforms.learning_rate import (
    ScaleByLearningRateState,
    Schedule,
    scale_by_learning_rate,
)
from fn.transforms.masking import MaskedState, masked, set_to_zero
from fn.transforms.onebit_adam_transform import (
    OnebitAdamState,
    onebit_adam,
    onebit_adam_sharded,
)
from fn.transforms.onebit_lamb_transform import (
    OnebitLambState,
    onebit_lamb,
    onebit_lamb_sharded,
)
from fn.transforms.sgd_transform import TraceState, sgd, trace
from fn.transforms.trust_ratio import scale_by_trust_ratio
from fn.transforms.weight_decay import add_decayed_weights
from fn.transforms.zero_one_adam_transform import ZeroOneAdamState, zero_one_adam

# The state classes, for torch.load's default weights_only=True (see fn/__init__.py).
torch.serialization.add_safe_globals(
    [
        AutoFreeze,
        AutoState,
        MaskedState,
        OnebitAdamState,
        OnebitLambState,
        ScaleByAdamState,
        ScaleByLearningRateState,
        TraceState,
        ZeroOneAdamState,
    ]
)

__all__ = [
    "AutoFreeze",
    "AutoState",
    "MaskedState",
    "OnebitAdamPlan",
    "OnebitAdamState",
    "OnebitLambPlan",
    "OnebitLambState",
    "Schedule",
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "TraceState",
    "ZeroOneAdamPlan",
    "ZeroOneAdamSchedule",
    "ZeroOneAdamState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "gradient_energy",
    "lamb",
    "masked",
    "momentum_of",
    "onebit_adam",
    "onebit_adam_sharded",
    "onebit_lamb",
    "onebit_lamb_sharded",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_trust_ratio",
    "set_to_zero",
    "sgd",
    "trace",
    "zero_one_adam",
]
