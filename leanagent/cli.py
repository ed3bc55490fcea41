"""`leanagent ...`: the command line.

Every command that would spend accelerator time first validates its config and datasets and
refuses to write into a finished job folder, so a typo costs seconds, not a GPU allocation.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from leanagent.config import ConfigError, load_config
from leanagent.supervision import Interrupted, interrupt_on_signals

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


def cmd_curriculum(args: argparse.Namespace) -> int:
    from leanagent.atomic import write_json_atomic
    from leanagent.data.curriculum import curriculum_of_datasets, describe
    from leanagent.data.errors import DatasetError
    from leanagent.preflight import check_unique_names

    paths = [Path(d).resolve() for d in args.datasets]
    for d, path in zip(args.datasets, paths, strict=True):
        if not (path / args.split).is_dir():
            return _fail(f"{d}: no split folder {args.split!r} ({path / args.split})")
    twins = check_unique_names([(p.name, p) for p in paths], "the curriculum names repositories by folder name")
    if twins:
        return _fail(twins[0])
    datasets = {p.name: p for p in paths}
    try:
        curriculum = curriculum_of_datasets(datasets, split=args.split)
    except DatasetError as exc:
        return _fail(str(exc))
    for line in describe(curriculum):
        print(line)
    if args.json:
        write_json_atomic(Path(args.json), curriculum.to_json())
    return 0


def cmd_job(args: argparse.Namespace) -> int:
    import json
    import tempfile

    from leanagent.config import dump_config
    from leanagent.job import JobFinishedError, JobInputError
    from leanagent.jobs import run_job
    from leanagent.launch.base import LaunchError

    try:
        with interrupt_on_signals():
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
                datasets = args.dataset if isinstance(args.dataset, list) else [args.dataset]
                result = run_job(cfg, config_path, args.program, [Path(d) for d in datasets], Path(args.out),
                                 checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                                 fisher=Path(args.fisher) if getattr(args, "fisher", None) else None,
                                 timeout_s=args.timeout, heartbeat_timeout_s=args.heartbeat_timeout)
    except (ConfigError, JobInputError, JobFinishedError, LaunchError) as exc:
        return _fail(str(exc))
    except Interrupted as exc:
        print(f"interrupted by {exc}: the job was ended; rerun the same command to resume", file=sys.stderr)
        return exc.exit_code
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def cmd_examples(args: argparse.Namespace) -> int:
    from leanagent.atomic import refuse_non_empty
    from leanagent.config import PipelineConfig
    from leanagent.data.errors import DatasetError
    from leanagent.data.example_files import write_example_files

    try:
        cfg = load_config(args.config) if args.config else PipelineConfig()
        data = cfg.data.model_copy(update={"split": args.split}) if args.split else cfg.data
        refuse_non_empty(Path(args.out))
        counts = write_example_files(Path(args.dataset), Path(args.out), data,
                                     seed=cfg.trainer.seed if args.seed is None else args.seed)
    except (ConfigError, DatasetError, FileExistsError) as exc:
        return _fail(str(exc))
    for split, n in counts.items():
        print(f"{Path(args.out) / (split + '.jsonl')}: {n} example(s)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from leanagent.bench import format_table, run_bench, write_json

    dataset = Path(args.dataset)
    if not (dataset / "corpus.jsonl").is_file():
        return _fail(f"{dataset}: no corpus.jsonl (write one with `leanagent demo-data OUT --mathlib-scale`)")
    problem = _check_device(args.device)
    if problem:
        return _fail(problem)
    for flag, value in (("--train-max-len", args.train_max_len), ("--embed-sample", args.embed_sample),
                        ("--train-layers", args.train_layers), ("--train-batches", args.train_batches),
                        ("--fisher-examples", args.fisher_examples)):
        if value is not None and value < 1:
            return _usage_error(f"{flag} {value}: must be positive")
    states = [Path(p) for p in args.states or []]
    missing = [str(p) for p in states if not p.is_file()]
    if missing:
        return _fail(f"--states: no such file: {', '.join(missing)}")
    methods = tuple(args.fisher_methods.split(",")) if args.fisher_methods else None
    if methods and not set(methods) <= {"loop", "vectorised"}:
        return _usage_error(f"--fisher-methods {args.fisher_methods}: choose from loop, vectorised")
    results = run_bench(dataset, args.model, args.preset, args.device, split=args.split,
                        min_seconds=args.min_seconds, embed_sample=args.embed_sample, launch=not args.no_launch,
                        compile_model=not args.no_compile, train_max_len=args.train_max_len, states=states or None,
                        train_layers=args.train_layers, train_batches=args.train_batches,
                        fisher_examples=args.fisher_examples or 8, fisher_methods=methods)
    print(format_table(results))
    if args.json:
        write_json(results, Path(args.json))
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
    from leanagent.data.synthetic_scale import MATHLIB_SCALE, ScaleSpec, write_scale_dataset

    out = Path(args.out)
    large = args.mathlib_scale or args.files is not None or args.premises is not None
    if large and (args.repos is not None or args.scale is not None):
        return _fail("--repos and --scale are for the small demo; --mathlib-scale/--files/--premises write one dataset")
    try:
        spec = ScaleSpec(files=MATHLIB_SCALE.files if args.files is None else args.files,
                         premises=MATHLIB_SCALE.premises if args.premises is None else args.premises,
                         theorems=args.theorems, seed=args.seed) if large else None
    except ValueError as exc:
        return _fail(str(exc))
    try:
        refuse_non_empty(out)
    except FileExistsError as exc:
        return _fail(str(exc))
    if spec is not None:
        print(write_scale_dataset(out, spec))
        return 0
    paths = write_demo_repos(out, 3 if args.repos is None else args.repos, seed=args.seed,
                             theorems_per_repo=40 if args.theorems is None else args.theorems,
                             scale=1 if args.scale is None else args.scale)
    for p in paths:
        print(p)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from leanagent.atomic import write_json_atomic
    from leanagent.report import SourceError, comparison_json, comparison_text, load_run, write_png
    from leanagent.run_state import MANIFEST_NAME

    try:
        runs = [load_run(source) for source in args.sources]
    except SourceError as exc:
        return _fail(str(exc))
    only = runs[0].report if len(runs) == 1 else None
    if only is not None:  # one run_dir: its full report, as before
        manifest = Path(runs[0].source) / MANIFEST_NAME
        print(only.markdown(str(manifest)) if args.markdown else only.text())
    else:
        print(comparison_text(runs, markdown=args.markdown))
    if args.json:
        write_json_atomic(Path(args.json), comparison_json(runs))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.png:
        write_png(runs, Path(args.png))
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
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
        return _fail(str(exc))
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
        return _fail(str(exc))
    print(f"cancelled {len(ids)} job(s){': ' + ', '.join(map(str, ids)) if ids else ''}")
    return 0


EXIT_USAGE = 2  # export, index, retrieve: a bad argument or input, as argparse reports its own


def _usage_error(message: str) -> int:
    _fail(message)
    return EXIT_USAGE


def _check_device(device: str) -> str | None:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda: torch sees no CUDA device"
    return None


def cmd_export(args: argparse.Namespace) -> int:
    from leanagent.checkpoints import BadFileError
    from leanagent.export import export_model
    from leanagent.model.loading import ModelSourceError

    try:
        out = export_model(Path(args.checkpoint), Path(args.out), force=args.force, base_model=args.base_model)
    except (ModelSourceError, BadFileError, FileExistsError, FileNotFoundError) as exc:
        return _usage_error(str(exc))
    print(f"wrote {out}: model.safetensors, config.json, tokenizer files, retriever.json, README.md")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from leanagent.checkpoints import BadFileError
    from leanagent.data.errors import DatasetError
    from leanagent.index import PremiseIndexError, build_index
    from leanagent.model.loading import ModelSourceError

    problem = _check_device(args.device)
    if problem:
        return _usage_error(problem)
    if args.batch_tokens is not None and args.batch_tokens < 1:
        return _usage_error(f"--batch-tokens {args.batch_tokens}: must be positive")
    try:
        meta = build_index(Path(args.checkpoint or args.model), Path(args.dataset), Path(args.out),
                           device=args.device, batch_tokens=args.batch_tokens, force=args.force,
                           base_model=args.base_model)
    except (PremiseIndexError, ModelSourceError, BadFileError, DatasetError, FileNotFoundError) as exc:
        return _usage_error(str(exc))
    print(f"indexed {meta['num_premises']} premises of {meta['num_files']} files ({meta['embedding_dim']} wide) "
          f"in {meta['embed_seconds']:.1f}s: {args.out}")
    return 0


def cmd_retrieve(args: argparse.Namespace) -> int:
    import json
    import time

    from leanagent.index import FILE_WITHOUT_LINE, PremiseIndex, PremiseIndexError

    problem = _check_device(args.device)
    if problem:
        return _usage_error(problem)
    if (args.file is None) != (args.line is None):  # before the model is loaded
        return _usage_error(FILE_WITHOUT_LINE)
    if args.state_file is not None:
        try:
            state = Path(args.state_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return _usage_error(f"--state-file {args.state_file}: cannot be read ({exc.__class__.__name__})")
    else:
        state = args.state
    try:
        loading = time.perf_counter()
        index = PremiseIndex.load(Path(args.index), device=args.device, model=args.model, force=args.force)
        for warning in index.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        start = time.perf_counter()
        hits = index.retrieve(state, k=args.k, file=args.file, line=args.line, column=args.column)
        seconds = time.perf_counter() - start
    except PremiseIndexError as exc:
        return _usage_error(str(exc))
    if args.json:
        print(json.dumps({"index": str(args.index), "file": args.file, "line": args.line, "k": args.k,
                          "seconds": round(seconds, 6), "premises": [h.to_json() for h in hits]}, ensure_ascii=False))
        return 0
    for h in hits:
        print(f"{h.rank:>3}  {h.score:+.4f}  {h.full_name}  ({h.path}:{h.start[0]})")
    if not hits:
        print("no accessible premise", file=sys.stderr)
    # A prover keeps the index loaded (`leanagent.PremiseIndex`); this process paid for imports and loading once.
    print(f"answered in {1000 * seconds:.1f} ms (index and model loaded in {start - loading:.1f} s)", file=sys.stderr)
    return 0


def _add_model_check_arguments(p: argparse.ArgumentParser) -> None:
    """`retrieve` and `serve`: the index refuses a model other than the one its corpus was embedded with."""
    p.add_argument("--model", help="encode states with this checkpoint or HF folder instead of the one index.json "
                                   "names (e.g. both moved); it must hold the same weights")
    p.add_argument("--force", action="store_true",
                   help="use the index even when its model changed since it was built (stale embeddings), warning")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from leanagent.config import format_validation_error
    from leanagent.index import PremiseIndex, PremiseIndexError
    from leanagent.serve import ServeLimits, create_app, listen

    problem = _check_device(args.device)
    if problem:
        return _usage_error(problem)
    given = {"max_k": args.max_k, "max_new_premises": args.max_new_premises, "cache_size": args.cache_size}
    try:
        limits = ServeLimits(**{key: value for key, value in given.items() if value is not None})
    except ValidationError as exc:
        return _usage_error("--" + format_validation_error(exc).replace("_", "-"))
    try:
        index = PremiseIndex.load(Path(args.index), device=args.device, model=args.model, force=args.force)
    except PremiseIndexError as exc:
        return _usage_error(str(exc))
    for warning in index.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    app = create_app(index, limits)  # before listening: a client never meets a half-built server
    try:  # bound here, so that --port 0 works and the line below names the real port
        sock = listen(args.host, args.port)
    except OSError as exc:
        return _usage_error(f"--host {args.host} --port {args.port}: cannot listen there ({exc.strerror or exc})")
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    config = uvicorn.Config(app, log_level="info" if args.access_log else "warning", access_log=args.access_log,
                            timeout_graceful_shutdown=10)
    reason = "shutdown"
    try:
        # Ours until uvicorn takes the signals over, and again after: it shuts down gracefully, then re-raises
        # the signal it got, which ours turns into Interrupted. A signal during start-up stops as cleanly.
        with interrupt_on_signals():
            print(f"serving {len(index)} premises of {args.index} at {url}; in Lean: set_option "
                  f"premiseSelection.apiBaseUrl \"{url}\"  (Ctrl-C stops)", file=sys.stderr, flush=True)
            uvicorn.Server(config).run(sockets=[sock])
    except Interrupted as exc:
        reason = str(exc)
    finally:
        sock.close()
    print(f"stopped ({reason}) after {app.state.premise_server.requests} retrieval(s)", file=sys.stderr)
    return 0


VERBOSE_HELP = ("show every line of the ranks, known third-party warnings included (LEANAGENT_VERBOSE=1 does the "
                "same for the flow and deployments); the job's logs under JOB/logs/ always have them")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="leanagent", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="check LeanDojo datasets before any GPU time is spent")
    p.add_argument("datasets", nargs="+")
    p.add_argument("--split", default="random")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("curriculum", help="LeanAgent's repository order: Easy/Medium/Hard counts and percentiles")
    p.add_argument("datasets", nargs="+", help="dataset folders; repositories are named by folder name")
    p.add_argument("--split", default="random")
    p.add_argument("--json", help="also write {order, counts, percentiles} to this file")
    p.set_defaults(func=cmd_curriculum)

    for name, helptext in (("train", "train the retriever on one repository (DDP under torchrun)"),
                           ("fisher", "compute the diagonal Fisher of a checkpoint on a repository"),
                           ("evaluate", "R@1, R@10, MRR of a checkpoint on a repository's test split")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--config", required=True)
        if name == "evaluate":
            p.add_argument("--dataset", required=True, action="append",
                           help="repeat to score the model on several datasets in one job (loaded once)")
        else:
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
        p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
        p.set_defaults(func=cmd_job, program=name)

    p = sub.add_parser("examples", help="write exactly what the retriever is fed: DIR/{train,val,test}.jsonl")
    p.add_argument("dataset")
    p.add_argument("--out", required=True, help="a new or empty folder")
    p.add_argument("--split", help="split folder (default: data.split of the config, random)")
    p.add_argument("--config", help="config YAML for data.num_negatives etc. (default: LeanAgent's settings)")
    p.add_argument("--seed", type=int, help="negative-sampling seed (default: trainer.seed, 3407)")
    p.set_defaults(func=cmd_examples)

    p = sub.add_parser("bench", help="measure the data path, embedding, retrieval, training vs Fisher, launch")
    p.add_argument("--dataset", required=True, help="a LeanDojo dataset (e.g. from `leanagent demo-data`)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--model", help="HF model folder or id (default: a random --preset encoder)")
    group.add_argument("--preset", default="tiny", choices=["tiny", "byt5-small"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--split", default="random")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--min-seconds", type=float, default=3.0, help="time each rate for at least this long")
    p.add_argument("--embed-sample", type=int, help="premises embedded (default 512 on cpu, 4096 on cuda)")
    p.add_argument("--no-launch", action="store_true", help="skip the job-launch measurement")
    p.add_argument("--states", nargs="+", metavar="SPLIT_JSON",
                   help="LeanDojo split files whose proof states are the training rows' contexts (their real "
                        "lengths; premises stay the dataset's), e.g. a real benchmark's random/val.json")
    p.add_argument("--train-max-len", type=int,
                   help="bytes the training step and Fisher pass cut sequences at (default LeanAgent's 1024)")
    p.add_argument("--train-layers", type=int,
                   help="layers of the model the training rows keep (default 2 on cpu: byt5-small's width, each "
                        "layer's work as in the full model, a sixth of the time; all on cuda)")
    p.add_argument("--train-batches", type=int, help="batches of 4 the training step rows run (default 4 cpu, 16 cuda)")
    p.add_argument("--fisher-examples", type=int, help="examples the Fisher rows run (default 8)")
    p.add_argument("--fisher-methods", help="comma-separated: loop, vectorised (default loop on cpu, both on cuda)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled training row (and compile times)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("init-model", help="write a random ByT5-architecture encoder (offline)")
    p.add_argument("out")
    p.add_argument("--preset", default="tiny", choices=["tiny", "byt5-small"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser("demo-data", help="write synthetic LeanDojo-format repositories (or one mathlib-size dataset)",
                       description="Without size flags: small, learnable repositories OUT/repo_0, OUT/repo_1, ... "
                                   "With --mathlib-scale, --files or --premises: ONE dataset in OUT (corpus.jsonl, "
                                   "random/{train,val,test}.json) shaped like mathlib for measuring the data path: "
                                   "thousands of files, an import DAG hundreds of files deep, premise code with a "
                                   "long tail of lengths. Same arguments, same bytes.")
    p.add_argument("out")
    p.add_argument("--repos", type=int, help="small demo: number of repositories (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--theorems", type=int,
                   help="small demo: theorems per repository (default 40); large dataset: theorems in all "
                        "(default premises // 16)")
    p.add_argument("--scale", type=int, help="small demo: multiplies the premises per repository (default 1)")
    p.add_argument("--mathlib-scale", action="store_true",
                   help="one dataset of 2,000 files and 76,000 premises (about 35 MB, seconds to write)")
    p.add_argument("--files", type=int, help="large dataset: corpus files (default 2000)")
    p.add_argument("--premises", type=int, help="large dataset: premises in all (default 76000)")
    p.set_defaults(func=cmd_demo_data)

    p = sub.add_parser("report", help="recall matrices and LeanAgent's lifelong metrics of runs, side by side")
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="a run_dir (with manifest.json) or a JSON file {names, test_recall_at_10 (lower-triangular "
                        "rows, percent), val_recall_at_10}")
    p.add_argument("--markdown", action="store_true", help="print markdown instead of plain text")
    p.add_argument("--json", metavar="OUT", help="write {runs: [{source, WF5, FM, EBWT, WP5, IP, CFR, composite, "
                                                 "avg, ...}]} here, in the order given")
    p.add_argument("--png", metavar="OUT", help="draw each run's recall matrix and its average/validation curves")
    p.set_defaults(func=cmd_report)

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

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder with a model card")
    p.add_argument("checkpoint", help="a leanagent .ckpt, a LeanAgent/ReProver .ckpt (or consolidated DeepSpeed "
                                      "folder), or a Hugging Face model folder")
    p.add_argument("out", help="a new or empty folder")
    p.add_argument("--force", action="store_true", help="replace model files already in OUT (others are kept)")
    p.add_argument("--base-model", help="for a LeanAgent/ReProver checkpoint: the HF folder or cached id giving its "
                                        "architecture (default: its model_name, else byt5-small's shape)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("index", help="embed a dataset's corpus once, for `leanagent retrieve`")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--checkpoint", help="a leanagent or LeanAgent/ReProver .ckpt")
    group.add_argument("--model", help="a Hugging Face model folder (e.g. from `leanagent export`)")
    p.add_argument("--dataset", required=True, help="a LeanDojo dataset folder (its corpus.jsonl is embedded)")
    p.add_argument("--out", required=True, help="the INDEX folder: new or empty")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch-tokens", type=int, help="padded tokens per embedding batch (default: the model's "
                                                    "eval_batch_size x max_seq_len)")
    p.add_argument("--force", action="store_true", help="replace an index already in --out")
    p.add_argument("--base-model", help="for a LeanAgent/ReProver checkpoint: the HF folder or cached id giving its "
                                        "architecture (default: its model_name, else byt5-small's shape)")
    p.set_defaults(func=cmd_index)

    p = sub.add_parser("retrieve", help="the top-k premises of an index for a proof state")
    p.add_argument("index", help="an INDEX folder written by `leanagent index`")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--state", help="the proof state (a leading `N goals` is dropped, as in training)")
    group.add_argument("--state-file", help="read the proof state from this file")
    p.add_argument("--file", help="only premises accessible in this file (a corpus path or a unique suffix)...")
    p.add_argument("--line", type=int, help="...at this line: its imports' premises and its own ending before")
    p.add_argument("--column", type=int, default=0, help="with --line: the column (default 0, the line's start)")
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    _add_model_check_arguments(p)
    p.set_defaults(func=cmd_retrieve)

    p = sub.add_parser("serve", help="answer Lean's premise-selection API (premiseSelection.apiBaseUrl) from an index",
                       description="Serve an INDEX over HTTP with the protocol of Lean's premise-selection cloud "
                                   "client: GET /indexed-modules, /indexed-premises, /max-new-premises, /health and "
                                   "POST /retrieve. The model and embeddings are loaded once.")
    p.add_argument("index", help="an INDEX folder written by `leanagent index`")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=23337, help="port (default 23337; 0: any free port, printed)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-k", type=int, help="a larger k is capped to this (default 1024)")
    p.add_argument("--max-new-premises", type=int,
                   help="new premises one request may upload, what GET /max-new-premises says (default 2048)")
    p.add_argument("--cache-size", type=int, help="new-premise embeddings kept between requests (default 16384)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    _add_model_check_arguments(p)
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):  # the launcher and the ranks read it from the environment
        os.environ["LEANAGENT_VERBOSE"] = "1"
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
