"""Scripts that the tests launch under ``torchrun``; pytest does not import them (their stacks
are optional extras, and importing one starts nothing)."""

collect_ignore = [
    "_lightning_traffic.py",
    "_lightning_fsdp.py",
    "_lightning_hsdp.py",
    "_torchtitan_cpu.py",
    "_torchtitan_runs.py",
]
