"""`train`, `fisher`, `evaluate`: one job of the rank programs, launched as the config's launcher says.

A command per program of `leanagent.ground.job.PROGRAMS`, its flags the fields of `JobRequest` that program takes
(their help the fields' descriptions), so a new program, or a new field of a job, is a new command or flag here with
nothing written in this module.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path

from pydantic import ValidationError

from leanagent.cli.common import VERBOSE_HELP, CommandError, option_error
from leanagent.ground.config import ConfigError, PipelineConfig
from leanagent.ground.job import PROGRAMS, JobRequest, ProgramSpec
from leanagent.ground.supervision import Interrupted, interrupt_on_signals

# The request's fields a command line does not give: the program is the command, the label the flow's; the index's
# datasets and the index it extends are the flow's (a command's index is one of the datasets it evaluates).
# Whether the datasets were validated already is the flow's to say.
NOT_FLAGS = ("program", "label", "index_datasets", "index_after", "datasets_checked")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, spec in PROGRAMS.items():
        p = sub.add_parser(name, help=spec.summary)
        add_job_flags(p, spec)
        p.add_argument("--node-rank", type=int, help="override trainer.node_rank (multi-node)")
        p.add_argument("--rdzv-endpoint", help="override trainer.rdzv_endpoint (multi-node)")
        p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
        p.set_defaults(func=cmd_job, program=name)


def add_job_flags(p: argparse.ArgumentParser, spec: ProgramSpec) -> None:
    """A flag per field of `JobRequest` that `spec`'s program takes; its value is validated by the request."""
    for name, field in JobRequest.model_fields.items():
        taken_if = JobRequest.TAKEN_IF.get(name)
        if name in NOT_FLAGS or (taken_if is not None and not getattr(spec, taken_if)):
            continue
        flag = "--" + (field.alias or name).replace("_", "-")
        help_text = field.description
        if name == "checkpoint":
            help_text = spec.checkpoint_help
        several = typing.get_origin(field.annotation) is tuple
        if several and spec.several_datasets:
            help_text += "; repeat it to score the model on several datasets in one job (loaded once)"
        p.add_argument(flag, dest=name, action="append" if several else "store", help=help_text,
                       required=field.is_required() or (name == "checkpoint" and spec.needs_checkpoint),
                       metavar=(field.alias or name).upper())


def job_from_args(args: argparse.Namespace, config: PipelineConfig) -> JobRequest:
    """The request the flags give, with `config` (`--config`'s, with the command's overrides); a refused value names
    its flag."""
    values = {name: getattr(args, name) for name in JobRequest.model_fields if getattr(args, name, None) is not None}
    try:
        return JobRequest(**{**values, "program": args.program, "config": config})
    except ValidationError as exc:
        raise option_error(exc) from None


def cmd_job(args: argparse.Namespace) -> int:
    from leanagent.ground.atomic import refuse_non_empty
    from leanagent.ground.job import JobFinishedError, JobInputError
    from leanagent.launch.base import LaunchError
    from leanagent.launch.registry import load_checked_config
    from leanagent.preflight.run_job import run_job

    job_from_args(args, PipelineConfig())  # a bad flag value is refused before the config is even read
    try:
        with interrupt_on_signals():
            cfg = load_checked_config(args.config)
            if args.node_rank is not None:
                cfg.trainer.node_rank = args.node_rank
            if args.rdzv_endpoint is not None:
                cfg.trainer.rdzv_endpoint = args.rdzv_endpoint
            if getattr(args, "index", None):
                try:  # before any launch: nothing a user keeps is replaced
                    refuse_non_empty(Path(args.index))
                except FileExistsError as exc:
                    raise CommandError(f"--index {exc}") from None
            result = run_job(job_from_args(args, cfg))
    except (ConfigError, JobInputError, JobFinishedError, LaunchError) as exc:
        raise CommandError(str(exc)) from None
    except Interrupted as exc:
        print(f"interrupted by {exc}: the job was ended; rerun the same command to resume", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(result.as_json(), indent=2, sort_keys=True))
    return 0
