"""``exit_distributed``: a gloo process whose groups outlive its work exits cleanly, with its
atexit handlers run and its buffered output written."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from fn.collectives import exit_distributed
from tests._distributed import rank_env, run_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A thread left in a collective on a group that is still referenced when main() returns: the
# interpreter's finalization then tears down gloo's threads, which aborts the process.
SCRIPT = textwrap.dedent(
    """
    import atexit, sys, threading
    import torch, torch.distributed as dist
    from fn.collectives import exit_distributed

    def main():
        dist.init_process_group("gloo")
        group = dist.new_group([0, 1])
        tensor = torch.ones(1 << 22)

        def all_reduce_repeatedly():
            for _ in range(50):
                dist.all_reduce(tensor, group=group)

        threading.Thread(target=all_reduce_repeatedly, daemon=True).start()
        atexit.register(print, f"rank {dist.get_rank()}: atexit handlers ran")
        print(f"rank {dist.get_rank()}: done")

    if __name__ == "__main__":
        main()
        if sys.argv[1:] == ["--exit-distributed"]:
            exit_distributed()
    """
)


def _torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    command = ["torchrun", "--standalone", "--nproc-per-node", "2", script, *args]
    return run_command(command, env=rank_env(ROOT), timeout=120)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_group_alive_at_exit_does_not_abort_the_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain = _torchrun(str(script))
    # the failure exit_distributed avoids (a control: the script does trigger it)
    assert plain.returncode != 0 and "SIGABRT" in plain.stderr, plain.stderr[-2000:]
    clean = _torchrun(str(script), "--exit-distributed")
    assert clean.returncode == 0, clean.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: done" in clean.stdout
        assert f"rank {rank}: atexit handlers ran" in clean.stdout


def test_exit_code_atexit_handlers_and_buffered_output_in_one_process():
    script = (
        "import atexit, torch.distributed as dist\n"
        "from fn.collectives import exit_distributed\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "atexit.register(print, 'atexit handlers ran')\n"
        "print('done', end=' ')\n"
        "exit_distributed(3)\n"
        "print('not reached')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert (run.returncode, run.stdout) == (3, "done atexit handlers ran\n"), run.stderr


@pytest.mark.parametrize("exit_code", [-1, 256, 1.0, True, "0"])
def test_a_bad_exit_code_is_refused_before_anything_ends(exit_code):
    with pytest.raises(ValueError, match="exit_code must be an int in"):
        exit_distributed(exit_code)
