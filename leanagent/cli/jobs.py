"""`train`, `fisher`, `evaluate`: one job of the rank programs, launched as the config's launcher says."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from leanagent.cli.common import VERBOSE_HELP, CommandError
from leanagent.ground.config import ConfigError, dump_config
from leanagent.ground.job import PROGRAMS
from leanagent.ground.supervision import Interrupted, interrupt_on_signals


def add_parsers(sub: argparse._SubParsersAction) -> None:
    for name, spec in PROGRAMS.items():
        p = sub.add_parser(name, help=spec.summary)
        p.add_argument("--config", required=True, help="the pipeline config YAML (model, data, trainer)")
        if spec.several_datasets:
            p.add_argument("--dataset", required=True, action="append",
                           help="repeat to score the model on several datasets in one job (loaded once)")
        else:
            p.add_argument("--dataset", required=True, help="a LeanDojo dataset folder")
        p.add_argument("--out", required=True, help="job folder; result.json is written here")
        p.add_argument("--checkpoint", required=spec.needs_checkpoint, help=spec.checkpoint_help)
        if spec.takes_fisher:
            p.add_argument("--fisher", help="Fisher .safetensors of the previous repository: enables EWC")
        if spec.takes_index:
            p.add_argument("--index", metavar="INDEX",
                           help="also write the model's premise index over the datasets' corpora (a file two carry: "
                                "the last one's version) into this new or empty folder, for `leanagent serve` and "
                                "`retrieve`; the premises the tests embedded are not embedded again")
        p.add_argument("--node-rank", type=int, help="override trainer.node_rank (multi-node)")
        p.add_argument("--rdzv-endpoint", help="override trainer.rdzv_endpoint (multi-node)")
        p.add_argument("--timeout", type=float, help="end the job after this many seconds")
        p.add_argument("--heartbeat-timeout", type=float, help="end the job when a rank is silent this long")
        p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
        p.set_defaults(func=cmd_job, program=name)


def cmd_job(args: argparse.Namespace) -> int:
    from leanagent.ground.atomic import refuse_non_empty
    from leanagent.ground.job import IndexRequest, JobFinishedError, JobInputError
    from leanagent.launch.base import LaunchError
    from leanagent.launch.registry import load_checked_config
    from leanagent.preflight.run_job import run_job

    try:
        with interrupt_on_signals():
            cfg = load_checked_config(args.config)
            if args.node_rank is not None:
                cfg.trainer.node_rank = args.node_rank
            if args.rdzv_endpoint is not None:
                cfg.trainer.rdzv_endpoint = args.rdzv_endpoint
            with tempfile.TemporaryDirectory(prefix="leanagent-") as tmp:
                # Each rank reads the YAML: hand it the config with the overrides, resolved paths included.
                # It lives only as long as the job, and never in --out, which may be a finished job.
                config_path = Path(tmp) / "config.yaml"
                dump_config(cfg, config_path)
                datasets = [Path(d) for d in (args.dataset if isinstance(args.dataset, list) else [args.dataset])]
                index = None
                if getattr(args, "index", None):
                    try:  # before any launch: nothing a user keeps is replaced
                        refuse_non_empty(Path(args.index))
                    except FileExistsError as exc:
                        raise CommandError(f"--index {exc}") from None
                    index = IndexRequest(Path(args.index), tuple(datasets))
                result = run_job(cfg, config_path, args.program, datasets, Path(args.out),
                                 checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                                 fisher=Path(args.fisher) if getattr(args, "fisher", None) else None,
                                 timeout_s=args.timeout, heartbeat_timeout_s=args.heartbeat_timeout, index=index)
    except (ConfigError, JobInputError, JobFinishedError, LaunchError) as exc:
        raise CommandError(str(exc)) from None
    except Interrupted as exc:
        print(f"interrupted by {exc}: the job was ended; rerun the same command to resume", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0
