"""The model commands: `init-model` (a random ByT5-architecture encoder, offline) and `export` (a checkpoint as
a Hugging Face model folder with a model card, or an index as LeanCopilot's retriever: one entry of
`EXPORT_FORMATS` each)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from leanagent.cli.common import CommandError
from leanagent.ground.names import PRESET_NAMES, TINY

BASE_MODEL_HELP = ("for a LeanAgent/ReProver checkpoint: the HF folder or cached id giving its architecture "
                   "(default: its model_name, else byt5-small's shape)")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init-model", help="write a random ByT5-architecture encoder (offline)")
    p.add_argument("out", help="a new or empty folder: a Hugging Face model folder (config, weights, tokenizer)")
    p.add_argument("--preset", default=TINY, choices=PRESET_NAMES,
                   help="tiny: a few layers, for CPU runs; byt5-small: the retriever's shape (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser("export", help="write a model as a Hugging Face folder (--format hf), or an index as "
                                      "LeanCopilot's retriever folders (--format leancopilot)",
                       description="; ".join(f"--format {name}: {fmt.help}" for name, fmt in EXPORT_FORMATS.items()))
    p.add_argument("checkpoint", metavar="SOURCE", help="hf: a leanagent .ckpt, a LeanAgent/ReProver .ckpt (or "
                                                        "consolidated DeepSpeed folder), or a Hugging Face model "
                                                        "folder; leancopilot: an INDEX folder, or a lifelong RUN_DIR "
                                                        "(its newest finished stage's index)")
    p.add_argument("out", help="a new or empty folder")
    p.add_argument("--format", default="hf", choices=list(EXPORT_FORMATS), help="what to write (default hf)")
    p.add_argument("--install", action="store_true",
                   help="leancopilot: also put the folders into LeanCopilot's model cache ($LEAN_COPILOT_CACHE_DIR, "
                        "else ~/.cache/lean_copilot/models), moving the ones there aside with a dated suffix")
    p.add_argument("--force", action="store_true", help="replace what an earlier export wrote in OUT (anything "
                                                        "else there is kept)")
    p.add_argument("--base-model", help=BASE_MODEL_HELP)
    p.set_defaults(func=cmd_export)


def cmd_init_model(args: argparse.Namespace) -> int:
    from leanagent.model.presets import write_random_encoder

    try:
        write_random_encoder(Path(args.out), args.preset, seed=args.seed)
    except FileExistsError as exc:
        raise CommandError(str(exc)) from None
    print(f"wrote a randomly initialised '{args.preset}' ByT5 encoder and tokenizer to {args.out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.install and args.format != "leancopilot":
        raise CommandError("--install: only with --format leancopilot")
    if args.base_model and args.format != "hf":
        raise CommandError("--base-model: only with --format hf (an index names its own model)")
    return EXPORT_FORMATS[args.format].run(args)


def _export_hf(args: argparse.Namespace) -> int:
    from leanagent.checkpoints.files import BadFileError
    from leanagent.export.hf import export_model
    from leanagent.model.loading import ModelSourceError

    try:
        out = export_model(Path(args.checkpoint), Path(args.out), force=args.force, base_model=args.base_model)
    except (ModelSourceError, BadFileError, FileExistsError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from None
    print(f"wrote {out}: model.safetensors, config.json, tokenizer files, retriever.json, README.md")
    return 0


def _export_leancopilot(args: argparse.Namespace) -> int:
    from leanagent.export.leancopilot import export_leancopilot
    from leanagent.export.leancopilot_native import DEFAULT_K
    from leanagent.index.files import PremiseIndexError
    from leanagent.model.ct2 import Ct2Missing
    from leanagent.serve import ServeError, resolve_source

    try:
        folder, stage = resolve_source(Path(args.checkpoint))
        done = export_leancopilot(folder, Path(args.out), force=args.force, do_install=args.install,
                                  stage=stage["stage"] if stage else None)
    except (PremiseIndexError, ServeError, Ct2Missing, FileExistsError) as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(f"{args.out}: cannot be written ({exc.strerror or exc})") from None
    for warning in done.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    what = f"stage {stage['stage']} (#{stage['stage_number']}), " if stage else ""
    rest = done.premises - done.code_from_corpus
    code = (f"code of all {done.premises:,} from their corpora" if not rest else
            f"code of {done.code_from_corpus:,} from their corpora, of the other {rest:,} from the embedded text")
    print(f"wrote {done.out} from {what}{folder}: {done.premises:,} premises ({done.width} wide); {code}; README.md "
          f"says where LeanCopilot reads the two folders")
    print(f"checked as LeanCopilot runs it on {done.checked_states:,} states: {DEFAULT_K} premises each (its "
          f"default k), never the placeholder row 0, which ranked {done.placeholder_best_rank:,} of "
          f"{done.premises + 1:,} at best")
    for aside in done.moved_aside:
        print(f"moved aside: {aside}")
    for target in done.installed:
        print(f"installed: {target}")
    return 0


@dataclass(frozen=True)
class ExportFormat:
    help: str
    run: Callable[[argparse.Namespace], int]


EXPORT_FORMATS: dict[str, ExportFormat] = {
    "hf": ExportFormat("a checkpoint or model folder as a Hugging Face model folder with a model card", _export_hf),
    "leancopilot": ExportFormat("an index, or a run's newest stage, as LeanCopilot's two retriever folders (a "
                                "CTranslate2 encoder; embeddings.npy and dictionary.json), with a README saying "
                                "where they go", _export_leancopilot),
}
