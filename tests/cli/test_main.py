"""The ``moe-fold`` command itself (moe_fold/cli/__init__.py): every subcommand is reachable
with its module's docstring as its help, and no subcommand prints the help and exits 2."""

from __future__ import annotations

import importlib

import pytest

from moe_fold.cli import COMMANDS, main


def test_no_command_prints_the_help_and_exits_2(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: moe-fold") and all(name in out for name in COMMANDS)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_has_its_module_docstring_as_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    first = importlib.import_module(COMMANDS[name][0]).__doc__.strip().splitlines()[0]
    assert first in capsys.readouterr().out


def test_an_unknown_command_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve"])
    assert e.value.code == 2 and "invalid choice: 'serve'" in capsys.readouterr().err
