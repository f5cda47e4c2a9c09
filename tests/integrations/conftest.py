"""Scripts that the tests launch under ``torchrun``; pytest does not import them (their stacks
are optional extras, and importing one starts nothing)."""

collect_ignore = ["_lightning_traffic.py", "_lightning_fsdp.py", "_lightning_hsdp.py"]
