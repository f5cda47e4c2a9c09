"""tests/_imports.py, which decides what the doctests and the docs' programs leave out where an
extra is missing, and what such a machine meets: ``import fn`` works, and
``import fn.integrations.torchft`` names the extra to install."""

from __future__ import annotations

import subprocess
import sys

from tests._imports import ROOT, optional_imports

# a machine without torchft: the path finder no longer finds it
_HIDE_TORCHFT = """
import sys
from importlib.machinery import PathFinder

class Hiding(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] == "torchft":
            return None
        return super().find_spec(name, path, target)

sys.meta_path[:] = [Hiding if f is PathFinder else f for f in sys.meta_path]
"""


def test_optional_imports_follow_fn_s_own_modules():
    torchft_package = (ROOT / "fn/integrations/torchft/__init__.py").read_text()
    assert "torchft" in optional_imports(torchft_package)  # through its comm module
    assert optional_imports("import fn\nimport fn.diloco\nimport torch, numpy, os") == set()
    program = "from torchtitan.models import llama3\ndef f():\n    import lightning\n"
    assert optional_imports(program) == {"torchtitan"}  # not what runs inside a function
    assert optional_imports("try:\n    import triton\nexcept ImportError:\n    pass\n") == set()


def test_without_torchft_fn_imports_and_its_glue_names_the_extra():
    check = (
        "import fn, fn.diloco\n"
        "try:\n"
        "    import fn.integrations.torchft\n"
        "except ModuleNotFoundError as err:\n"
        "    print(err.name, err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", _HIDE_TORCHFT + check],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        'torchft fn.integrations.torchft needs torchft 0.2.0, the "torchft" extra: '
        'pip install "fn-optim[torchft]"'
    )
