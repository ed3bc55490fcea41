"""`bench`: where the time goes, section by section (the measurements are `leanagent.bench`).

Each section's flags come from its options model (`leanagent.bench`), so a flag, its default and its help are
written once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from leanagent.cli.common import CommandError, add_model_options, check_device, model_from_args


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from leanagent.bench.options import BenchOptions, CurriculumOptions, ProjectionOptions, SwapOptions

    p = sub.add_parser("bench", help="measure where the time goes: the data and model path, a curriculum, a "
                                     "projection at LeanAgent's scale",
                       description="Benchmarks, one section at a time; each prints a table and can write its "
                                   "figures as JSON. Compare figures as ratios within one run.")
    sections = p.add_subparsers(dest="section", required=True, metavar="SECTION")

    path = sections.add_parser("path", help="the data and model path: corpus load, negatives, embedding, retrieval, "
                                            "the training step, the Fisher pass, a job's launch")
    add_model_options(path, BenchOptions)
    path.add_argument("--json", metavar="OUT", help="write every figure here")
    path.set_defaults(func=cmd_bench_path)

    curriculum = sections.add_parser(
        "curriculum", help="a whole curriculum on repositories sharing a dependency, run twice: re-embedding every "
                           "corpus (LeanAgent) and embedding once; where each run's time went",
        description="Writes repositories that share a dependency and a tiny encoder, then runs `leanagent run` twice "
                    "in one sitting (model.embed_premises: all, then needed) and reads every job's time by part and "
                    "the premises it embedded from the two manifests. Minutes on a CPU.")
    add_model_options(curriculum, CurriculumOptions)
    curriculum.add_argument("--json", metavar="OUT", help="write the figures here")
    curriculum.set_defaults(func=cmd_bench_curriculum)

    projection = sections.add_parser(
        "projection", help="LeanAgent's curriculum at its scale (14 repositories, Mathlib, 4 GPUs), from embedding "
                           "and step rates: passes and hours, before and after embedding once (arithmetic)")
    add_model_options(projection, ProjectionOptions)
    projection.add_argument("--json", metavar="OUT", help="write the figures here")
    projection.set_defaults(func=cmd_bench_projection)

    swap = sections.add_parser(
        "swap", help="`leanagent serve RUN_DIR` taking a run's next stage at Mathlib size: the swap's time, the "
                     "server's memory before, at its peak and after, every request's status meanwhile (Linux)")
    add_model_options(swap, SwapOptions)
    swap.add_argument("--json", metavar="OUT", help="write the figures here")
    swap.set_defaults(func=cmd_bench_swap)


def _write(figures: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(figures, indent=2, sort_keys=True, default=str))


def cmd_bench_path(args: argparse.Namespace) -> int:
    from leanagent.bench.options import BenchOptions

    if args.model is not None and args.preset is not None:
        raise CommandError("--model and --preset: give one (the preset is a random encoder of that shape)")
    options = model_from_args(BenchOptions, args)
    if not (options.dataset / "corpus.jsonl").is_file():  # before torch is imported: answered at once
        raise CommandError(f"{options.dataset}: no corpus.jsonl (write one with `leanagent demo-data OUT "
                           f"--mathlib-scale`)")
    missing = [str(p) for p in options.states if not p.is_file()]
    if missing:
        raise CommandError(f"--states: no such file: {', '.join(missing)}")
    check_device(options.device)

    from leanagent.bench.results import write_json
    from leanagent.bench.run import run_bench
    from leanagent.bench.table import format_table

    result = run_bench(options)
    print(format_table(result))
    if args.json:
        write_json(result, Path(args.json))
    return 0


def cmd_bench_curriculum(args: argparse.Namespace) -> int:
    from leanagent.bench.curriculum import bench_curriculum, curriculum_table
    from leanagent.bench.options import CurriculumOptions

    options = model_from_args(CurriculumOptions, args)
    if options.work is not None and options.work.exists() and any(options.work.iterdir()):
        raise CommandError(f"--work {options.work}: not empty; give a new folder (nothing was overwritten)")
    try:
        figures = bench_curriculum(options)
    except RuntimeError as exc:
        raise CommandError(str(exc)) from None
    print(curriculum_table(figures))
    _write(figures.flat(), args.json)
    return 0


def cmd_bench_projection(args: argparse.Namespace) -> int:
    from leanagent.bench.curriculum import project_curriculum, projection_table
    from leanagent.bench.options import ProjectionOptions

    projection = project_curriculum(model_from_args(ProjectionOptions, args))
    print(projection_table(projection))
    _write(projection.flat(), args.json)
    return 0


def cmd_bench_swap(args: argparse.Namespace) -> int:
    from leanagent.bench.options import SwapOptions
    from leanagent.bench.swap import bench_swap, swap_table

    options = model_from_args(SwapOptions, args)
    if not Path("/proc/self/status").is_file():
        raise CommandError("bench swap reads the server's memory from /proc (Linux)")
    try:
        figures = bench_swap(options)
    except RuntimeError as exc:
        raise CommandError(str(exc)) from None
    print(swap_table(figures))
    _write(figures.flat(), args.json)
    return 0
