import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> list[str]:
    """The command line ``python -m fn ARGS`` with this interpreter."""
    return [sys.executable, "-m", "fn", *args]
