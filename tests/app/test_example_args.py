"""The example scripts' arguments (fn.app.examples and the scripts' own): a count that is not a
positive integer is an argparse error (exit status 2), not a crash on some rank mid-run."""

from __future__ import annotations

import argparse
import importlib.util
from types import ModuleType

import pytest

from fn.app.examples import onebit_parser, parse_fsdp_args, parse_stack_args, positive_int
from tests.app import ROOT


def _script(name: str) -> ModuleType:
    """``examples/<name>`` imported as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(
        name.removesuffix(".py"), ROOT / "examples" / name
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refused(parse, flag: str, value: str, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse([flag, value])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_positive_int_takes_integers_from_one():
    assert positive_int("1") == 1 and positive_int("40") == 40
    for text, said in [("0", "got 0"), ("-3", "got -3"), ("ten", "expected an integer")]:
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            positive_int(text)


@pytest.mark.parametrize(
    "flag", ["--log-every", "--batch", "--vocab", "--d-model", "--heads", "--layers", "--context"]
)
@pytest.mark.parametrize("value", ["0", "-1"])
def test_the_fsdp_scripts_refuse_a_count_below_one(flag, value, capsys):
    err = _refused(lambda argv: parse_fsdp_args(onebit_parser("1-bit"), argv), flag, value, capsys)
    assert f"argument {flag}: must be a positive integer, got {value}" in err


@pytest.mark.parametrize("flag", ["--max-steps", "--save-steps", "--batch-size"])
def test_the_stack_scripts_refuse_a_count_below_one(flag, capsys):
    def parse(argv):
        return parse_stack_args("a Trainer script", "--resume", ["--output-dir", "o", *argv])

    assert f"argument {flag}: must be a positive integer, got 0" in _refused(
        parse, flag, "0", capsys
    )


@pytest.mark.parametrize(
    "script, flag",
    [
        ("fsdp_loco.py", "--log-every"),
        ("fsdp_loco.py", "--max-steps"),
        ("fsdp_loco.py", "--group-size"),
        ("fsdp_loco.py", "--local-world-size"),
        ("diloco.py", "--sync-every"),
        ("diloco.py", "--topk"),
        ("hsdp_onebit.py", "--ranks-per-node"),
        ("hsdp_onebit.py", "--max-steps"),
    ],
)
def test_the_scripts_own_counts_refuse_zero(script, flag, capsys):
    err = _refused(_script(script).parse_args, flag, "0", capsys)
    assert f"argument {flag}: must be a positive integer, got 0" in err
