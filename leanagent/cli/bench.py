"""`bench`: how fast each stage of the data and model path runs (the measurements are `leanagent.bench`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError

from leanagent.cli.common import CommandError, check_device, option_error


def add_parsers(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--fisher-examples", type=int, default=8, help="examples the Fisher rows run (default 8)")
    p.add_argument("--fisher-methods", help="comma-separated: loop, vectorised (default loop on cpu, both on cuda)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled training row (and compile times)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    dataset = Path(args.dataset)
    if not (dataset / "corpus.jsonl").is_file():  # before torch is imported: answered at once
        raise CommandError(f"{dataset}: no corpus.jsonl (write one with `leanagent demo-data OUT --mathlib-scale`)")

    from leanagent.bench import BenchOptions, format_table, run_bench, write_json

    try:
        options = BenchOptions(dataset=dataset, model=args.model, preset=args.preset, device=args.device,
                               split=args.split, min_seconds=args.min_seconds, embed_sample=args.embed_sample,
                               fisher_examples=args.fisher_examples,
                               fisher_methods=tuple(args.fisher_methods.split(",")) if args.fisher_methods else None,
                               launch=not args.no_launch, compile=not args.no_compile,
                               train_max_len=args.train_max_len, train_layers=args.train_layers,
                               train_batches=args.train_batches, states=tuple(Path(p) for p in args.states or ()))
    except ValidationError as exc:
        raise option_error(exc) from None
    missing = [str(p) for p in options.states if not p.is_file()]
    if missing:
        raise CommandError(f"--states: no such file: {', '.join(missing)}")
    check_device(args.device)
    result = run_bench(options)
    print(format_table(result))
    if args.json:
        write_json(result, Path(args.json))
    return 0
