"""The CLI explains itself: `leanagent --version`, a summary for every command, help for every argument."""

from __future__ import annotations

import argparse
import subprocess
import sys

from leanagent.cli.main import build_parser


def _commands(parser: argparse.ArgumentParser, prefix: str = "leanagent"):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, f"{prefix} {name}")


def test_every_command_has_a_summary_and_every_argument_help() -> None:
    missing = []
    for name, parser in _commands(build_parser()):
        if not parser.description:
            missing.append(f"{name}: no summary")
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.dest in ("help", "version"):
                continue
            if not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}: no help")
    assert not missing, "\n".join(missing)


def test_version_prints_the_installed_version() -> None:
    proc = subprocess.run([sys.executable, "-m", "leanagent.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("leanagent "), proc.stderr
    assert proc.stdout.split()[1][0].isdigit()
