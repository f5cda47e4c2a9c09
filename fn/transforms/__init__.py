"""Pure optimizer transforms: Adam, LAMB, SGD, their building blocks, masking, and the
communication-compressed 1-bit family."""

from fn.transforms.adam import ScaleByAdamState, adam, adamw, scale_by_adam
from fn.transforms.lamb import lamb
from fn.transforms.learning_rate import (
    ScaleByLearningRateState,
    Schedule,
    scale_by_learning_rate,
)
from fn.transforms.masking import MaskedState, masked, set_to_zero
from fn.transforms.sgd import TraceState, sgd, trace
from fn.transforms.trust_ratio import scale_by_trust_ratio
from fn.transforms.weight_decay import add_decayed_weights

__all__ = [
    "MaskedState",
    "Schedule",
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "lamb",
    "masked",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_trust_ratio",
    "set_to_zero",
    "sgd",
    "trace",
]
