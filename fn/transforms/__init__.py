"""Pure optimizer transforms: Adam, LAMB, SGD, their building blocks, masking, and the
communication-compressed 1-bit family."""

__all__: list[str] = []
