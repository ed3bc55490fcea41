"""The data commands: `validate`, `curriculum`, `examples`, `demo-data` (no model, no accelerator)."""

from __future__ import annotations

import argparse
from pathlib import Path

from leanagent.cli.common import CommandError, check_out_file
from leanagent.ground.config import ConfigError, PipelineConfig
from leanagent.ground.names import DEFAULT_SPLIT


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check LeanDojo datasets before any GPU time is spent")
    p.add_argument("datasets", nargs="+", help="LeanDojo dataset folders (corpus.jsonl, SPLIT/*.json)")
    p.add_argument("--split", default=DEFAULT_SPLIT, help=f"the split folder to read (default: {DEFAULT_SPLIT})")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("curriculum", help="LeanAgent's repository order: Easy/Medium/Hard counts and percentiles")
    p.add_argument("datasets", nargs="+", help="dataset folders; repositories are named by folder name")
    p.add_argument("--split", default=DEFAULT_SPLIT, help=f"the split folder to read (default: {DEFAULT_SPLIT})")
    p.add_argument("--json", help="also write {order, counts, percentiles} to this file")
    p.set_defaults(func=cmd_curriculum)

    p = sub.add_parser("examples", help="write exactly what the retriever is fed: DIR/{train,val,test}.jsonl")
    p.add_argument("dataset", help="a LeanDojo dataset folder")
    p.add_argument("--out", required=True, help="a new or empty folder")
    p.add_argument("--split", help="split folder (default: data.split of the config, random)")
    p.add_argument("--config", help="config YAML for data.num_negatives etc. (default: LeanAgent's settings)")
    p.add_argument("--seed", type=int, help="negative-sampling seed (default: trainer.seed, 3407)")
    p.set_defaults(func=cmd_examples)

    p = sub.add_parser("demo-data", help="write synthetic LeanDojo-format repositories (or one mathlib-size dataset)",
                       description="Without size flags: small, learnable repositories OUT/repo_0, OUT/repo_1, ... "
                                   "With --shared-dependency: the same, each corpus also carrying one shared "
                                   "dependency (the same files, byte for byte, under .lake/packages/mathlib/), of "
                                   "which each repository imports a part and uses premises, as LeanAgent's "
                                   "repositories carry Mathlib. With --mathlib-scale, --files or --premises alone: "
                                   "ONE dataset in OUT (corpus.jsonl, random/{train,val,test}.json) shaped like "
                                   "mathlib for measuring the data path: thousands of files, an import DAG hundreds "
                                   "of files deep, premise code with a long tail of lengths. Same arguments, same "
                                   "bytes.")
    p.add_argument("out", help="a new or empty folder")
    p.add_argument("--repos", type=int, help="small demo: number of repositories (default 3)")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    p.add_argument("--theorems", type=int,
                   help="small demo: theorems per repository (default 40); large dataset: theorems in all "
                        "(default premises // 16)")
    p.add_argument("--scale", type=int, help="small demo: multiplies the premises per repository (default 1)")
    p.add_argument("--shared-dependency", choices=["small", "mathlib"],
                   help="small demo: every repository carries one shared dependency: small (60 files, 1,500 "
                        "premises) or mathlib (2,000 files, 76,000 premises, as --mathlib-scale); --files and "
                        "--premises size it instead")
    p.add_argument("--mathlib-scale", action="store_true",
                   help="one dataset of 2,000 files and 76,000 premises (about 35 MB, seconds to write)")
    p.add_argument("--files", type=int, help="large dataset (or the shared dependency): corpus files (default 2000)")
    p.add_argument("--premises", type=int,
                   help="large dataset (or the shared dependency): premises in all (default 76000)")
    p.set_defaults(func=cmd_demo_data)


def cmd_validate(args: argparse.Namespace) -> int:
    from leanagent.data.validate import validate_dataset

    problems = [p for d in args.datasets for p in validate_dataset(Path(d), split=args.split)]
    for p in problems:
        print(p)
    if problems:
        raise CommandError(f"{len(problems)} problem(s) in {len(args.datasets)} dataset(s)")
    print(f"ok: {len(args.datasets)} dataset(s) valid")
    return 0


def cmd_curriculum(args: argparse.Namespace) -> int:
    from leanagent.data.curriculum import curriculum_of_datasets, describe
    from leanagent.data.errors import DatasetError
    from leanagent.ground.atomic import write_json_atomic
    from leanagent.preflight.checks import check_unique_names

    check_out_file("--json", args.json)
    paths = [Path(d).resolve() for d in args.datasets]
    for d, path in zip(args.datasets, paths, strict=True):
        if not (path / args.split).is_dir():
            raise CommandError(f"{d}: no split folder {args.split!r} ({path / args.split})")
    twins = check_unique_names([(p.name, p) for p in paths], "the curriculum names repositories by folder name")
    if twins:
        raise CommandError(twins[0])
    try:
        curriculum = curriculum_of_datasets({p.name: p for p in paths}, split=args.split)
    except DatasetError as exc:
        raise CommandError(str(exc)) from None
    for line in describe(curriculum):
        print(line)
    if args.json:
        write_json_atomic(Path(args.json), curriculum.to_json())
    return 0


def cmd_examples(args: argparse.Namespace) -> int:
    from leanagent.data.errors import DatasetError
    from leanagent.data.example_files import write_example_files
    from leanagent.ground.atomic import refuse_non_empty
    from leanagent.launch.registry import load_checked_config

    try:
        cfg = load_checked_config(args.config) if args.config else PipelineConfig()
        data = cfg.data.model_copy(update={"split": args.split}) if args.split else cfg.data
        refuse_non_empty(Path(args.out))
        counts = write_example_files(Path(args.dataset), Path(args.out), data,
                                     seed=cfg.trainer.seed if args.seed is None else args.seed)
    except (ConfigError, DatasetError, FileExistsError) as exc:
        raise CommandError(str(exc)) from None
    for split, n in counts.items():
        print(f"{Path(args.out) / (split + '.jsonl')}: {n} example(s)")
    return 0


def cmd_demo_data(args: argparse.Namespace) -> int:
    from leanagent.data.synthetic import DEPENDENCY_SIZES, write_demo_repos
    from leanagent.data.synthetic_scale import ScaleSpec, write_scale_dataset
    from leanagent.ground.atomic import refuse_non_empty

    out = Path(args.out)
    sized = args.files is not None or args.premises is not None
    if args.shared_dependency is not None and args.mathlib_scale:
        raise CommandError("--shared-dependency and --mathlib-scale do not go together (--shared-dependency "
                           "mathlib gives the dependency --mathlib-scale's size)")
    large = args.shared_dependency is None and (args.mathlib_scale or sized)
    if large and (args.repos is not None or args.scale is not None):
        raise CommandError("--repos and --scale are for the small demo; --mathlib-scale/--files/--premises write "
                           "one dataset (add --shared-dependency to size a dependency of the small demo instead)")
    try:
        base = DEPENDENCY_SIZES[args.shared_dependency or "mathlib"]
        spec = ScaleSpec(files=base.files if args.files is None else args.files,
                         premises=base.premises if args.premises is None else args.premises,
                         theorems=args.theorems if large else None, seed=args.seed)
        refuse_non_empty(out)
    except (ValueError, FileExistsError) as exc:
        raise CommandError(str(exc)) from None
    if large:
        print(write_scale_dataset(out, spec))
        return 0
    paths = write_demo_repos(out, 3 if args.repos is None else args.repos, seed=args.seed,
                             theorems_per_repo=40 if args.theorems is None else args.theorems,
                             scale=1 if args.scale is None else args.scale,
                             dependency=spec if args.shared_dependency else None)
    for p in paths:
        print(p)
    return 0
