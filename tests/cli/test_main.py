"""`k3`'s exit codes (../shared/CLI.md): 2 only for validated bad input (``InputError``, named in one line on stderr);
any other exception is a bug in k3jax and leaves with its traceback and exit 1, never dressed up as bad input."""

import subprocess
import sys

import pytest

from k3jax.cli import inspect as inspect_cli
from k3jax.cli.main import main
from k3jax.errors import InputError


def test_input_error_exits_2_with_one_line(monkeypatch, capsys):
    def bad(args):
        raise InputError("--frobs 3: must be even")

    monkeypatch.setattr(inspect_cli, "run", bad)
    assert main(["inspect", "somewhere"]) == 2
    assert capsys.readouterr().err == "k3 inspect: error: --frobs 3: must be even\n"


def test_an_internal_value_error_is_not_bad_input(monkeypatch):
    def broken(args):
        raise ValueError("operands could not be broadcast together")  # e.g. from inside jax or numpy

    monkeypatch.setattr(inspect_cli, "run", broken)
    with pytest.raises(ValueError, match="broadcast"):
        main(["inspect", "somewhere"])


def test_an_internal_error_exits_1_with_its_traceback():
    code = ("import sys; from k3jax.cli import inspect as i; from k3jax.cli.main import main\n"
            "def broken(args): raise ValueError('operands could not be broadcast together')\n"
            "i.run = broken\nsys.exit(main(['inspect', 'somewhere']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "Traceback" in r.stderr and "ValueError: operands could not be broadcast" in r.stderr
