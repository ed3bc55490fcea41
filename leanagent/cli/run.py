"""`run`: the lifelong curriculum as a Prefect flow; `status` and `cancel`: what a run has in a launcher's queue.

`status` and `cancel` ask every launcher (leanagent/launch/registry.py) about the run's job folders, so they
work whichever launcher submitted its jobs; a launcher with no queue (jobs on this machine live as long as
whoever launched them) has nothing queued.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from leanagent.cli.common import VERBOSE_HELP, CommandError
from leanagent.ground.supervision import Interrupted, interrupt_on_signals


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the lifelong curriculum as a Prefect flow, in this process")
    p.add_argument("--config", required=True, help="the run's config YAML: its repositories, run_dir, model, "
                   "trainer and launcher (configs/demo.yaml is a small one)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting of the config, checked as the file's are (repeatable): "
                        "--set model.lr=2e-4 --set lifelong.ewc_lambda=0.1")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("sweep", help="run several setups of one lifelong experiment as one Prefect flow (LeanAgent's "
                                     "Table 4): each an ordinary run, the jobs they share run once, one table")
    p.add_argument("--config", required=True, help="the sweep file: base (a config), sweep_dir, max_parallel and "
                   "setups, each a name and its overrides (configs/leanagent-table4.yaml: LeanAgent's eight setups "
                   "and two of replay)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting of every setup, before the setup's own (repeatable): "
                        "--set trainer.devices=2")
    p.add_argument("--base", help="use this config file as the sweep's base instead of the file's own (e.g. "
                                  "configs/demo.yaml: its repositories and its CPU trainer)")
    p.add_argument("--sweep-dir", help="run the sweep in this folder instead of the file's sweep_dir")
    p.add_argument("--max-parallel", type=int, help="setups running at once, instead of the file's max_parallel")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("status", help="each stage's queued job and its state, under any launcher with a queue")
    p.add_argument("run_dir", help="the run's folder (run_dir of its config)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("cancel", help="end every job of a run still queued or running in a launcher's queue")
    p.add_argument("run_dir", help="the run's folder (run_dir of its config)")
    p.set_defaults(func=cmd_cancel)


def cmd_run(args: argparse.Namespace) -> int:
    """The flow prints its own refusals and summary (flows/command.py); this returns its exit code."""
    with interrupt_on_signals():
        try:
            from leanagent.flows.command import run_from_cli  # the one way into the app layer (flows/command.py)

            return run_from_cli(args.config, args.overrides)
        except Interrupted as exc:  # one that landed outside the flow (while importing, or after it)
            print(f"interrupted by {exc}: every job was ended; rerun the same command to resume", file=sys.stderr)
            return exc.exit_code


def cmd_sweep(args: argparse.Namespace) -> int:
    """The sweep flow prints its refusals and its table itself (flows/command.py); this returns its exit code."""
    with interrupt_on_signals():
        try:
            from leanagent.flows.command import sweep_from_cli  # the one way into the app layer (flows/command.py)

            return sweep_from_cli(args.config, args.overrides, args.base, args.sweep_dir, args.max_parallel)
        except Interrupted as exc:
            print(f"interrupted by {exc}: every job was ended; rerun the same command to resume", file=sys.stderr)
            return exc.exit_code


def cmd_status(args: argparse.Namespace) -> int:
    """What a run has in a queue (and what its stages' last jobs became)."""
    from leanagent.ground.config import ConfigError
    from leanagent.launch.base import LaunchError
    from leanagent.launch.registry import run_status

    run_dir = Path(args.run_dir)
    try:
        jobs = run_status(run_dir)
    except (ConfigError, LaunchError) as exc:
        raise CommandError(str(exc)) from None
    if not jobs:
        print(f"{run_dir}: nothing queued (no job of this run was submitted to a queue)")
        return 0
    for launcher, job in jobs:
        print(f"{job.job_id:>10}  {job.state:<28} {_stage(run_dir, job.job_dir)}  ({launcher})")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """End every job of a run still in a queue (a SIGKILLed flow could not)."""
    from leanagent.ground.config import ConfigError
    from leanagent.launch.base import LaunchError
    from leanagent.launch.registry import cancel_run

    run_dir = Path(args.run_dir)
    try:
        ended = cancel_run(run_dir)
    except (ConfigError, LaunchError) as exc:
        raise CommandError(str(exc)) from None
    if not ended:
        print(f"{run_dir}: nothing queued, nothing cancelled")
        return 0
    for launcher, job in ended:
        print(f"cancelled {job.job_id} ({launcher}, was {job.state}): {_stage(run_dir, job.job_dir)}")
    return 0


def _stage(run_dir: Path, job_dir: Path) -> Path:
    try:
        return job_dir.relative_to(run_dir / "jobs")
    except ValueError:
        return job_dir
