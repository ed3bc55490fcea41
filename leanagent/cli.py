"""`leanagent ...`: the command line.

Every command that would spend accelerator time first validates its config and datasets and
refuses to write into a finished job folder, so a typo costs seconds, not a GPU allocation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from leanagent.config import ConfigError, load_config

EXIT_BAD_INPUT = 1


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cmd_validate(args: argparse.Namespace) -> int:
    from leanagent.data.validate import validate_dataset

    problems = [p for d in args.datasets for p in validate_dataset(Path(d), split=args.split)]
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s) in {len(args.datasets)} dataset(s)", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"ok: {len(args.datasets)} dataset(s) valid")
    return 0


def cmd_job(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from leanagent.config import dump_config
    from leanagent.train.jobs import JobFinishedError, JobInputError, run_job
    from leanagent.train.launch import LaunchError

    try:
        cfg = load_config(args.config)
        if args.node_rank is not None:
            cfg.trainer.node_rank = args.node_rank
        if args.rdzv_endpoint is not None:
            cfg.trainer.rdzv_endpoint = args.rdzv_endpoint
        with tempfile.TemporaryDirectory(prefix="leanagent-") as tmp:
            # Each rank reads the YAML: hand it the config with the overrides, resolved paths included.
            # It lives only as long as the job, and never in --out, which may be a finished job.
            config_path = Path(tmp) / "config.yaml"
            dump_config(cfg, config_path)
            result = run_job(cfg, config_path, args.program, Path(args.dataset), Path(args.out),
                             checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                             fisher=Path(args.fisher) if getattr(args, "fisher", None) else None,
                             timeout_s=args.timeout, heartbeat_timeout_s=args.heartbeat_timeout)
    except (ConfigError, JobInputError, JobFinishedError, LaunchError) as exc:
        return _fail(str(exc))
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    from leanagent.model.presets import write_random_encoder

    try:
        write_random_encoder(Path(args.out), args.preset, seed=args.seed)
    except FileExistsError as exc:
        return _fail(str(exc))
    print(f"wrote a randomly initialised '{args.preset}' ByT5 encoder and tokenizer to {args.out}")
    return 0


def cmd_demo_data(args: argparse.Namespace) -> int:
    from leanagent.atomic import refuse_non_empty
    from leanagent.data.synthetic import write_demo_repos

    out = Path(args.out)
    try:
        refuse_non_empty(out)
    except FileExistsError as exc:
        return _fail(str(exc))
    paths = write_demo_repos(out, args.repos, seed=args.seed, theorems_per_repo=args.theorems, scale=args.scale)
    for p in paths:
        print(p)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from leanagent.atomic import read_json
    from leanagent.report import report_from_manifest
    from leanagent.run_state import MANIFEST_NAME

    manifest = Path(args.run_dir) / MANIFEST_NAME
    if not manifest.is_file():
        return _fail(f"{manifest}: no such manifest (is {args.run_dir} a run_dir of `leanagent run`?)")
    report = report_from_manifest(read_json(manifest))
    print(report.markdown(str(manifest)) if args.markdown else report.text())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from flows.lifelong import run_from_cli

    return run_from_cli(args.config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leanagent", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check LeanDojo datasets before any GPU time is spent")
    p.add_argument("datasets", nargs="+")
    p.add_argument("--split", default="random")
    p.set_defaults(func=cmd_validate)

    for name, helptext in (("train", "train the retriever on one repository (DDP under torchrun)"),
                           ("fisher", "compute the diagonal Fisher of a checkpoint on a repository"),
                           ("evaluate", "R@1, R@10, MRR of a checkpoint on a repository's test split")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--config", required=True)
        p.add_argument("--dataset", required=True)
        p.add_argument("--out", required=True, help="job folder; result.json is written here")
        p.add_argument("--checkpoint", required=name == "fisher",
                       help="start (train) or scored (fisher, evaluate) checkpoint; evaluate without one "
                            "scores the base model")
        if name == "train":
            p.add_argument("--fisher", help="Fisher .safetensors of the previous repository: enables EWC")
        p.add_argument("--node-rank", type=int, help="override trainer.node_rank (multi-node)")
        p.add_argument("--rdzv-endpoint", help="override trainer.rdzv_endpoint (multi-node)")
        p.add_argument("--timeout", type=float, help="end the job after this many seconds")
        p.add_argument("--heartbeat-timeout", type=float, help="end the job when a rank is silent this long")
        p.set_defaults(func=cmd_job, program=name)

    p = sub.add_parser("init-model", help="write a random ByT5-architecture encoder (offline)")
    p.add_argument("out")
    p.add_argument("--preset", default="tiny", choices=["tiny", "byt5-small"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser("demo-data", help="write synthetic LeanDojo-format repositories")
    p.add_argument("out")
    p.add_argument("--repos", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--theorems", type=int, default=40, help="theorems per repository")
    p.add_argument("--scale", type=int, default=1, help="multiplies the premises per repository")
    p.set_defaults(func=cmd_demo_data)

    p = sub.add_parser("report", help="recall per repository and the lifelong recall matrix of a run_dir")
    p.add_argument("run_dir")
    p.add_argument("--markdown", action="store_true")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("run", help="run the lifelong curriculum as a Prefect flow, in this process")
    p.add_argument("--config", required=True)
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
