"""pytest settings for collecting this package (``pytest --doctest-modules fn``)."""

# Imports Triton at the top (fn.kernels._triton loads it only where Triton is installed).
collect_ignore = ["_triton_kernels.py"]
