"""`bench`: where the time goes, section by section (the measurements are `leanagent.bench`).

Each section is one entry of `SECTIONS`: its options model (whose fields are its flags: a flag, its default and its
help written once), the function that measures and the one that prints its table, named in their module and
imported when the section runs (the parser imports no torch). Every section's figures have `flat()`, the JSON
`--json` writes.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from leanagent.bench.options import (
    AbuseOptions,
    BatchingOptions,
    BenchOptions,
    CurriculumOptions,
    DtypesOptions,
    EnginesOptions,
    GradCacheOptions,
    PrecisionOptions,
    ProjectionOptions,
    ServeOptions,
    SwapOptions,
    SweepOptions,
)
from leanagent.bench.results import Section
from leanagent.cli.common import (
    CommandError,
    add_model_options,
    check_device,
    check_out_file,
    check_out_folder,
    model_from_args,
)
from leanagent.ground.names import CORPUS_FILE, DEFAULT_SPLIT, TEST_PART, TRAIN_PART, part_file


@dataclass(frozen=True)
class BenchSection:
    name: str
    options: type[BaseModel]
    help: str
    measure: str  # "module:function" in leanagent.bench: options -> figures
    table: str  # "module:function": figures -> the printed table
    description: str | None = None
    positional: tuple[str, ...] = ()
    check: Callable[[BaseModel], None] | None = None  # refusals answered before anything heavy is imported


def _check_path(options: BenchOptions) -> None:
    if options.model is not None and options.preset is not None:
        raise CommandError("--model and --preset: give one (the preset is a random encoder of that shape)")
    if not (options.dataset / CORPUS_FILE).is_file():
        raise CommandError(f"{options.dataset}: no {CORPUS_FILE} (write one with `leanagent demo-data OUT "
                           f"--mathlib-scale`)")
    missing = [str(p) for p in options.states if not p.is_file()]
    if missing:
        raise CommandError(f"--states: no such file: {', '.join(missing)}")
    check_device(options.device)


def _check_empty_work(options: CurriculumOptions | SwapOptions | AbuseOptions | SweepOptions) -> None:
    check_out_folder("--work", options.work, new_or_empty=True)


def _check_serve(options: ServeOptions) -> None:
    check_out_folder("WORK", options.work)  # reused when present, so it may hold the last run's files
    check_device(options.device)


def _check_linux(options: SwapOptions) -> None:
    _check_empty_work(options)
    if not Path("/proc/self/status").is_file():
        raise CommandError("bench swap reads the server's memory from /proc (Linux)")


def _check_file(attribute: str) -> Callable[[BaseModel], None]:
    def check(options: BaseModel) -> None:
        value = getattr(options, attribute)
        if value is not None and not Path(value).is_file():
            raise CommandError(f"--{attribute}: {value}: no such file")
        device = getattr(options, "device", "cpu")
        check_device(device)
    return check


def _check_dataset(dataset: Path | None) -> None:
    train = Path(DEFAULT_SPLIT) / part_file(TRAIN_PART)
    if dataset is not None and not (dataset / train).is_file():
        raise CommandError(f"--dataset {dataset}: no {train} to take training examples from")


def _check_batching(options: BatchingOptions) -> None:
    if not (options.index / "index.json").is_file():
        raise CommandError(f"{options.index}: no index.json (build one with `leanagent index`)")
    states = options.dataset / DEFAULT_SPLIT / part_file(TEST_PART)
    if not states.is_file():
        raise CommandError(f"{options.dataset}: no {states.relative_to(options.dataset)} to take proof states from")


def _check_engines(options: EnginesOptions) -> None:
    if (options.index is None) == (not options.dataset):
        raise CommandError("give --index (an INDEX or RUN_DIR) or --dataset (indexed here), one of them")
    if options.index is not None and options.model is not None:
        raise CommandError("--model: the index names its own model; give it with --dataset instead")
    if options.dataset and len(options.dataset) > 1:
        raise CommandError("--dataset: one dataset (its corpus is indexed here)")
    for dataset in options.dataset:
        if not (dataset / CORPUS_FILE).is_file():
            raise CommandError(f"--dataset {dataset}: no {CORPUS_FILE}")
    missing = [str(p) for p in options.states if not p.is_file()]
    if missing:
        raise CommandError(f"--states: no such file: {', '.join(missing)}")


SECTIONS: tuple[BenchSection, ...] = (
    BenchSection("path", BenchOptions, "the data and model path: corpus load, negatives, embedding, retrieval, the "
                 "training step, the Fisher pass, a job's launch", "run:run_bench", "table:format_table",
                 check=_check_path),
    BenchSection("curriculum", CurriculumOptions, "a whole curriculum on repositories sharing a dependency, run "
                 "twice: re-embedding every corpus (LeanAgent) and embedding once; where each run's time went",
                 "curriculum:bench_curriculum", "curriculum:curriculum_table",
                 description="Writes repositories that share a dependency and a tiny encoder, then runs `leanagent "
                             "run` twice in one sitting (model.embed_premises: all, then needed) and reads every "
                             "job's time by part and the premises it embedded from the two manifests. Minutes on a "
                             "CPU.", check=_check_empty_work),
    BenchSection("sweep", SweepOptions, "four of LeanAgent's Table 4 setups as one sweep (their shared jobs run "
                 "once) and each alone: jobs launched, job seconds and wall time of each, the same results",
                 "sweep:bench_sweep", "sweep:sweep_table",
                 description="Writes repositories and a tiny encoder, then runs `leanagent sweep` on four setups "
                             "(single and merge all, EWC off and on) and the same four setups with `leanagent run`, "
                             "one after the other, each command in its own process with its own Prefect server. "
                             "Tens of minutes on a 2-core CPU.", check=_check_empty_work),
    BenchSection("projection", ProjectionOptions, "LeanAgent's curriculum at its scale (14 repositories, Mathlib, 4 "
                 "GPUs), from embedding and step rates: passes and hours, before and after embedding once "
                 "(arithmetic)", "curriculum:project_curriculum", "curriculum:projection_table"),
    BenchSection("swap", SwapOptions, "`leanagent serve RUN_DIR` taking a run's next stage at Mathlib size: the "
                 "swap's time, the server's memory before, at its peak and after, every request's status meanwhile "
                 "(Linux)", "swap:bench_swap", "swap:swap_table", check=_check_linux),
    BenchSection("dtypes", DtypesOptions, "the served encoder's pass per --dtype (fp32, bf16, int8) at byt5-small's "
                 "shape, and its corpus embedding rate", "dtypes:bench_dtypes", "dtypes:dtypes_table",
                 check=_check_file("states")),
    BenchSection("precision", PrecisionOptions, "the training step and the Fisher pass in each trainer precision "
                 "(32-true, bf16-mixed) on this CPU, with its flags and what trainer.precision: auto takes here",
                 "precision:bench_precision", "precision:precision_table",
                 check=lambda options: _check_dataset(options.dataset)),
    BenchSection("engines", EnginesOptions, "the query side per --engine and --dtype (torch fp32, bf16; ct2 fp32, "
                 "int8, int8_float32) on one index: latency per state, premises/s, and top-10 overlap and R@10 "
                 "against torch fp32", "engines:bench_engines", "engines:engines_table", check=_check_engines),
    BenchSection("grad-cache", GradCacheOptions, "what model.grad_cache saves and costs: one InfoNCE step's peak "
                 "memory and time, cached and not, each in a process of its own", "grad_cache:bench_grad_cache",
                 "grad_cache:grad_cache_table", check=_check_file("states")),
    BenchSection("batching", BatchingOptions, "a premise server in process (no HTTP): batched against one request "
                 "at a time, and the encoder and ranking parts of a batched pass", "batching:bench_batching",
                 "batching:batching_table", positional=("index", "dataset"), check=_check_batching),
    BenchSection("serve", ServeOptions, "real `leanagent serve` processes, batched and not: latency and requests/s "
                 "at 1, 8 and 32 clients, cold starts", "serving:bench_serve", "serving:serve_table",
                 positional=("work",), check=_check_serve),
    BenchSection("abuse", AbuseOptions, "known attacks on real `leanagent serve` processes (and commands that must "
                 "refuse at once): per attack the answers, the server's CPU seconds, its peak memory, /health's worst "
                 "latency and a verdict; exits 1 when one fails (Linux)",
                 "abuse:bench_abuse", "abuse:abuse_table", check=_check_empty_work),
)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure where the time goes: the data and model path, a curriculum, a "
                                     "projection at LeanAgent's scale, the server, the dtypes, the query engines",
                       description="Benchmarks, one section at a time; each prints a table and can write its "
                                   "figures as JSON. Compare figures as ratios within one run.")
    sections = p.add_subparsers(dest="section", required=True, metavar="SECTION")
    for section in SECTIONS:
        q = sections.add_parser(section.name, help=section.help, description=section.description)
        add_model_options(q, section.options, positional=section.positional)
        q.add_argument("--json", metavar="OUT", help="write the figures here")
        q.set_defaults(func=cmd_bench, bench_section=section)


def cmd_bench(args: argparse.Namespace) -> int:
    section: BenchSection = args.bench_section
    options = model_from_args(section.options, args)
    check_out_file("--json", args.json)  # before minutes of measuring, not after
    if section.check is not None:
        section.check(options)
    measure, table = _named(section.measure), _named(section.table)
    try:
        figures = measure(options)
    except (RuntimeError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    print(table(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures.flat(), indent=2, sort_keys=True, default=str))
    failed = figures.failures() if isinstance(figures, Section) else []
    if failed:  # a section with bars (abuse): a row that fails one fails the command
        raise CommandError(f"bench {section.name}: {len(failed)} failed: {', '.join(failed)}")
    return 0


def _named(where: str) -> Callable:
    """`module:function` of leanagent.bench, imported when its section runs."""
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(f"leanagent.bench.{module}"), name)
