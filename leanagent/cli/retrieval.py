"""`index` (embed a dataset's corpus once) and `retrieve` (the top-k premises of that index for a proof state)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from leanagent.cli.common import (
    CommandError,
    add_dtype_argument,
    add_model_check_arguments,
    check_device,
    check_run_or_index,
)
from leanagent.cli.model import BASE_MODEL_HELP
from leanagent.ground.json_files import MIB, read_capped


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("index", help="embed a dataset's corpus once, for `leanagent retrieve`")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--checkpoint", help="a leanagent or LeanAgent/ReProver .ckpt")
    group.add_argument("--model", help="a Hugging Face model folder (e.g. from `leanagent export`)")
    p.add_argument("--dataset", required=True, help="a LeanDojo dataset folder (its corpus.jsonl is embedded)")
    p.add_argument("--out", required=True, help="the INDEX folder: new or empty")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"],
                   help="where the encoder runs (default cpu)")
    add_dtype_argument(p)
    p.add_argument("--batch-tokens", type=int, help="padded tokens per embedding batch (default: the model's "
                                                    "eval_batch_size x max_seq_len)")
    p.add_argument("--force", action="store_true", help="replace an index already in --out")
    p.add_argument("--base-model", help=BASE_MODEL_HELP)
    p.set_defaults(func=cmd_index)

    p = sub.add_parser("retrieve", help="the top-k premises of an index (or a run's newest stage) for a proof state")
    p.add_argument("index", metavar="SOURCE", help="an INDEX folder (`leanagent index`), or a lifelong RUN_DIR: its "
                                                   "newest finished stage's index")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--state", help="the proof state (a leading `N goals` is dropped, as in training)")
    group.add_argument("--state-file", help="read the proof state from this file")
    p.add_argument("--file", help="only premises accessible in this file (a corpus path or a unique suffix)...")
    p.add_argument("--line", type=int, help="...at this line: its imports' premises and its own ending before")
    p.add_argument("--column", type=int, default=0, help="with --line: the column (default 0, the line's start)")
    p.add_argument("-k", type=int, default=10, help="how many premises to print (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"],
                   help="where the encoder runs (default cpu)")
    add_dtype_argument(p)
    add_model_check_arguments(p)
    p.set_defaults(func=cmd_retrieve)


def cmd_index(args: argparse.Namespace) -> int:
    from leanagent.checkpoints.files import BadFileError
    from leanagent.data.errors import DatasetError
    from leanagent.index.build import build_index
    from leanagent.index.files import IndexNotWritten, PremiseIndexError
    from leanagent.model.loading import ModelSourceError

    check_device(args.device)
    if args.batch_tokens is not None and args.batch_tokens < 1:
        raise CommandError(f"--batch-tokens {args.batch_tokens}: must be positive")
    try:
        meta = build_index(Path(args.checkpoint or args.model), Path(args.dataset), Path(args.out),
                           device=args.device, batch_tokens=args.batch_tokens, force=args.force, dtype=args.dtype,
                           engine=args.engine, base_model=args.base_model)
    except (PremiseIndexError, ModelSourceError, BadFileError, DatasetError, FileNotFoundError,
            IndexNotWritten) as exc:
        raise CommandError(str(exc)) from None
    print(f"indexed {meta['num_premises']} premises of {meta['num_files']} files ({meta['embedding_dim']} wide) "
          f"in {meta['embed_seconds']:.1f}s ({meta['engine']} {meta['embedded_at']}): {args.out}")
    return 0


STATE_FILE_BYTES = 4 * MIB  # far past any proof state (the model reads its first 1,024 bytes)


def read_state_file(path: Path) -> str:
    """A proof state's file: a regular file of at most STATE_FILE_BYTES, checked on the open file before it is read,
    in UTF-8 (one line naming it otherwise)."""
    try:
        return read_capped(path, STATE_FILE_BYTES, "proof state's file", CommandError).decode("utf-8")
    except CommandError as exc:
        raise CommandError(f"--state-file {exc}") from None
    except UnicodeDecodeError as exc:
        raise CommandError(f"--state-file {path}: not UTF-8 text (byte {exc.start})") from None


def cmd_retrieve(args: argparse.Namespace) -> int:
    check_device(args.device)
    state = args.state if args.state_file is None else read_state_file(Path(args.state_file))
    check_run_or_index(Path(args.index))  # before the model's stack is imported: one line, now

    from leanagent.index.files import FILE_WITHOUT_LINE, PremiseIndexError
    from leanagent.index.query import PremiseIndex
    from leanagent.serve import ServeError, resolve_source

    if (args.file is None) != (args.line is None):  # before the model is loaded
        raise CommandError(FILE_WITHOUT_LINE)
    try:
        loading = time.perf_counter()
        folder, stage = resolve_source(Path(args.index))
        index = PremiseIndex.load(folder, device=args.device, model=args.model, force=args.force, dtype=args.dtype,
                                  engine=args.engine)
        for warning in index.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        start = time.perf_counter()
        hits = index.retrieve(state, k=args.k, file=args.file, line=args.line, column=args.column)
        seconds = time.perf_counter() - start
    except (PremiseIndexError, ServeError) as exc:
        raise CommandError(str(exc)) from None
    if args.json:
        print(json.dumps({"index": str(folder), **(stage or {}), "file": args.file, "line": args.line, "k": args.k,
                          "engine": index.engine, "dtype": index.dtype, "scoring": index.scoring,
                          "seconds": round(seconds, 6), "premises": [h.to_json() for h in hits]}, ensure_ascii=False,
                         allow_nan=False))
        return 0
    if stage is not None:
        print(f"stage {stage['stage']} (#{stage['stage_number']}): {folder}", file=sys.stderr)
    for h in hits:
        print(f"{h.rank:>3}  {h.score:+.4f}  {h.full_name}  ({h.path}:{h.start[0]})")
    if not hits:
        print("no accessible premise", file=sys.stderr)
    # A prover keeps the index loaded (`leanagent.PremiseIndex`); this process paid for imports and loading once.
    print(f"answered in {1000 * seconds:.1f} ms by {index.describe_engine()} (index and model loaded in "
          f"{start - loading:.1f} s)", file=sys.stderr)
    return 0
