"""Pure optimizer transforms: Adam, LAMB, SGD, their building blocks, masking, and the
communication-compressed 1-bit family."""

from fn.transforms.onebit_adam import OnebitAdamState, onebit_adam
from fn.transforms.onebit_lamb import OnebitLambState, onebit_lamb
from fn.transforms.zero_one_adam import ZeroOneAdamState, zero_one_adam

__all__: list[str] = []

__all__ += ["onebit_adam", "OnebitAdamState", "zero_one_adam", "ZeroOneAdamState"]
__all__ += ["onebit_lamb", "OnebitLambState"]
