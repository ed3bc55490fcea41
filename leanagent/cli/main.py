"""`leanagent ...`: the parser of every command, and `main`, where a refusal becomes one line and an exit code.

Every command that would spend accelerator time first validates its config and datasets and refuses to
write into a finished job folder, so a typo costs seconds, not a GPU allocation. The exit codes are
`leanagent.cli.common`'s, the same for every command.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata

from leanagent.cli import bench, data, jobs, model, report, retrieval, run, serve
from leanagent.cli.common import EXIT_REFUSED, CommandError
from leanagent.ground.exit_fast import freeze_for_exit

# In the order `leanagent --help` lists them: the data, a job, the lifelong run, then using a trained model.
COMMAND_GROUPS = (data, model, jobs, run, report, retrieval, serve, bench)
DESCRIPTION = ("Lifelong training of a ByT5 premise retriever for Lean (LeanAgent), and serving it. Every command "
               "checks its input before it spends accelerator time.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leanagent", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.add_parsers(sub)
    _summaries(parser)
    return parser


def package_version() -> str:
    """The installed distribution's version (a checkout run without installing says so)."""
    try:
        return metadata.version("leanagent")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _summaries(parser: argparse.ArgumentParser) -> None:
    """Every command's `--help` leads with its one-line summary (the line `leanagent --help` lists it with),
    unless the command has a longer description of its own."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                if not child.description and helps.get(name):
                    child.description = helps[name][0].upper() + helps[name][1:] + "."
                _summaries(child)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):  # the launcher and the ranks read it from the environment
        os.environ["LEANAGENT_VERBOSE"] = "1"
    try:
        code = args.func(args)
    except CommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_REFUSED
    finally:
        freeze_for_exit()
    sys.exit(code)
