"""The `tvmpipe` command lists every layer's subcommands: a layer that fails to import is an install
defect, reported as the import error, never a command that silently vanishes from --help."""

from __future__ import annotations

import sys

import pytest

from tvmpipe import cli

EXPECTED = {"inspect", "compile", "profile", "extract", "partition", "run", "sweep"}


def subcommands() -> set[str]:
    parser = cli.build_parser()
    return set(next(a for a in parser._actions if a.dest == "command").choices)


def test_every_layer_registers_its_commands():
    assert EXPECTED <= subcommands()


def test_a_missing_layer_is_an_error_not_a_vanished_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "tvmpipe.partition.cli", None)  # import of it raises ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError):
        subcommands()
