"""`run`: the lifelong curriculum as a Prefect flow; `status` and `cancel`: what a run has in a launcher's queue.

`status` and `cancel` ask every launcher (leanagent/launch/registry.py) about the run's job folders, so they
work whichever launcher submitted its jobs; a launcher with no queue (jobs on this machine live as long as
whoever launched them) has nothing queued.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from leanagent.cli.common import VERBOSE_HELP, CommandError
from leanagent.ground.config import ConfigError
from leanagent.ground.supervision import Interrupted, interrupt_on_signals
from leanagent.launch.base import JobStatus, LaunchError
from leanagent.launch.registry import cancel_run, run_status
from leanagent.run.manifest import JOBS_DIR, not_a_run
from leanagent.run.sweep import SHARED_DIR, SWEEP_RECORD


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

    for name, command in QUEUE_COMMANDS.items():
        p = sub.add_parser(name, help=command.help)
        p.add_argument("run_dir", help="the run's folder (run_dir of its config)")
        p.set_defaults(func=cmd_queue, queue_command=command)


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


@dataclass(frozen=True)
class QueueCommand:
    """`status` or `cancel`: what it asks every launcher about a run (`leanagent.launch.registry`), what it says when
    no launcher has a job of the run in a queue, and its line per job."""

    help: str
    ask: Callable[[Path], list[tuple[str, JobStatus]]]  # run_dir -> (launcher, job) for each job of the run
    nothing: str
    line: Callable[[str, JobStatus, Path], str]  # (launcher, job, its stage) -> the line printed


QUEUE_COMMANDS = {
    "status": QueueCommand("each stage's queued job and its state, under any launcher with a queue", run_status,
                           "nothing queued (no job of this run was submitted to a queue)",
                           lambda launcher, job, stage: f"{job.job_id:>10}  {job.state:<28} {stage}  ({launcher})"),
    "cancel": QueueCommand("end every job of a run still queued or running in a launcher's queue", cancel_run,
                           "nothing queued, nothing cancelled",
                           lambda launcher, job, stage: f"cancelled {job.job_id} ({launcher}, was {job.state}): "
                                                        f"{stage}"),
}


def cmd_queue(args: argparse.Namespace) -> int:
    """What a run has in a queue (`status`), or every such job ended (`cancel`: what a SIGKILLed flow could not do).
    A path that is no run is refused: "nothing queued" would say a run is idle that is not there at all. A sweep's
    folder stands for its shared folder, where every job of its setups runs."""
    command: QueueCommand = args.queue_command
    run_dir = Path(args.run_dir)
    if (run_dir / SWEEP_RECORD).is_file():  # a sweep's jobs are its shared folder's (leanagent.run.shared)
        run_dir = run_dir / SHARED_DIR
    problem = not_a_run(run_dir)
    if problem is not None:
        raise CommandError(problem)
    try:
        jobs = command.ask(run_dir)
    except (ConfigError, LaunchError) as exc:
        raise CommandError(str(exc)) from None
    if not jobs:
        print(f"{run_dir}: {command.nothing}")
    for launcher, job in jobs:
        print(command.line(launcher, job, _stage(run_dir, job.job_dir)))
    return 0


def _stage(run_dir: Path, job_dir: Path) -> Path:
    try:
        return job_dir.relative_to(run_dir / JOBS_DIR)
    except ValueError:
        return job_dir
