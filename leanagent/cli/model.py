"""The model commands: `init-model` (a random ByT5-architecture encoder, offline) and `export` (a checkpoint as
a Hugging Face model folder with a model card)."""

from __future__ import annotations

import argparse
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

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder with a model card")
    p.add_argument("checkpoint", help="a leanagent .ckpt, a LeanAgent/ReProver .ckpt (or consolidated DeepSpeed "
                                      "folder), or a Hugging Face model folder")
    p.add_argument("out", help="a new or empty folder")
    p.add_argument("--force", action="store_true", help="replace model files already in OUT (others are kept)")
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
    from leanagent.checkpoints.files import BadFileError
    from leanagent.export.hf import export_model
    from leanagent.model.loading import ModelSourceError

    try:
        out = export_model(Path(args.checkpoint), Path(args.out), force=args.force, base_model=args.base_model)
    except (ModelSourceError, BadFileError, FileExistsError, FileNotFoundError) as exc:
        raise CommandError(str(exc)) from None
    print(f"wrote {out}: model.safetensors, config.json, tokenizer files, retriever.json, README.md")
    return 0
