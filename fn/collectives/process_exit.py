"""``exit_distributed``: the end of a ``torch.distributed`` process that cannot abort at exit.

A process that used gloo can abort while the interpreter shuts down (SIGABRT, "terminate called
without an active exception"), after its work is done: a process group still referenced at that
point (FSDP2's DTensor caches hold their mesh's group, a model or a thread may hold one) is torn
down during finalization, and its C++ threads can then no longer take the GIL (see
pytorch/pytorch#179291). ``destroy_process_group`` does not stop those threads while anything
still holds the group. Under ``torchrun`` the abort fails the whole run and sends SIGTERM to the
ranks that are still finishing (writing a checkpoint, say).

The one reliable way around it is not to finalize: ``exit_distributed`` destroys the process
groups, runs what the program registered with :mod:`atexit`, flushes the standard streams and
ends the process with :func:`os._exit`.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

import torch.distributed as dist

__all__ = ["exit_distributed"]


def exit_distributed(exit_code: int = 0) -> NoReturn:
    """Ends this process: destroys its process groups (if any), runs the :mod:`atexit` handlers,
    flushes ``sys.stdout`` / ``sys.stderr`` and exits with ``exit_code``. It skips interpreter
    finalization (objects still alive are not destroyed one by one; the OS reclaims them).

    Call it as the last line of a training script after ``main()`` returned normally; let an
    exception propagate as usual (its traceback and exit code 1 matter more than a clean exit).

    Args:
        exit_code: the process's exit status (0 to 255).

    Returns:
        Never.

    Example:
        >>> from fn.collectives import exit_distributed
        >>> if __name__ == "__main__":  # doctest: +SKIP
        ...     main()  # init_process_group, training, checkpoints
        ...     exit_distributed()
    """
    if not isinstance(exit_code, int) or isinstance(exit_code, bool) or not 0 <= exit_code <= 255:
        raise ValueError(
            f"exit_distributed: exit_code must be an int in [0, 255], got {exit_code!r}"
        )
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(exit_code)
