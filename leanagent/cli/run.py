"""`run`: the lifelong curriculum as a Prefect flow; `status` and `cancel`: what a run has in the SLURM queue."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from leanagent.cli.common import VERBOSE_HELP, CommandError
from leanagent.supervision import Interrupted, interrupt_on_signals


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the lifelong curriculum as a Prefect flow, in this process")
    p.add_argument("--config", required=True)
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="what a run has in the SLURM queue (launcher: slurm)")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("cancel", help="scancel every SLURM job of a run still in the queue")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_cancel)


def cmd_run(args: argparse.Namespace) -> int:
    """The flow prints its own refusals and summary (flows/command.py); this returns its exit code."""
    with interrupt_on_signals():
        try:
            from flows.command import run_from_cli  # the one way into the app layer (flows/command.py)

            return run_from_cli(args.config)
        except Interrupted as exc:  # one that landed outside the flow (while importing, or after it)
            print(f"interrupted by {exc}: every job was ended; rerun the same command to resume", file=sys.stderr)
            return exc.exit_code


def cmd_status(args: argparse.Namespace) -> int:
    """What a run has in the SLURM queue (and what its stages' last jobs became)."""
    from leanagent.launch.slurm import SlurmError, run_jobs

    try:
        jobs = run_jobs(Path(args.run_dir))
    except SlurmError as exc:
        raise CommandError(str(exc)) from None
    if not jobs:
        print(f"{args.run_dir}: no SLURM job recorded (launcher: local, or nothing submitted yet)")
        return 0
    for job_dir, job_id, state in jobs:
        stage = job_dir.relative_to(Path(args.run_dir) / "jobs")
        what = "forgotten by SLURM" if state is None else state.state + (
            f" ({state.reason})" if state.reason and state.reason != "None" else "")
        print(f"{job_id:>10}  {what:<28} {stage}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """scancel every job of a run still in the queue (a SIGKILLed flow could not)."""
    from leanagent.launch.slurm import SlurmError, cancel

    try:
        ids = cancel(Path(args.run_dir))
    except SlurmError as exc:
        raise CommandError(str(exc)) from None
    print(f"cancelled {len(ids)} job(s){': ' + ', '.join(map(str, ids)) if ids else ''}")
    return 0
