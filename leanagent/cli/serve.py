"""`serve`: an index behind Lean's premise-selection API (the server itself is `leanagent.serve`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from leanagent.cli.common import (
    CommandError,
    add_dtype_argument,
    add_model_check_arguments,
    check_device,
    option_error,
)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="answer Lean's premise-selection API (premiseSelection.apiBaseUrl) from an index",
                       description="Serve an INDEX over HTTP with the protocol of Lean's premise-selection cloud "
                                   "client: GET /indexed-modules, /indexed-premises, /max-new-premises, /health and "
                                   "POST /retrieve. The model and embeddings are loaded once.")
    p.add_argument("index", help="an INDEX folder written by `leanagent index`")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=23337, help="port (default 23337; 0: any free port, printed)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"],
                   help="mps: Apple GPUs, untested here")
    add_dtype_argument(p)
    p.add_argument("--max-k", type=int, help="a larger k is capped to this (default 1024)")
    p.add_argument("--max-new-premises", type=int,
                   help="new premises one request may upload, what GET /max-new-premises says (default 2048)")
    p.add_argument("--cache-size", type=int, help="new-premise embeddings kept between requests (default 16384)")
    p.add_argument("--batching", action=argparse.BooleanOptionalAction, default=None,
                   help="concurrent requests' states and new premises share encoder passes (the default; "
                        "--no-batching: one request's passes at a time, as before)")
    p.add_argument("--batch-tokens", type=int, help="tokens (bytes) one shared pass takes at most (default 32768)")
    p.add_argument("--batch-wait-ms", type=float,
                   help="how long a pass waits for requests still arriving (default 2; a lone client never waits)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    add_model_check_arguments(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from leanagent.serve import ServeError, ServeLimits, serve_index

    check_device(args.device)
    given = {"max_k": args.max_k, "max_new_premises": args.max_new_premises, "cache_size": args.cache_size,
             "batching": args.batching, "batch_tokens": args.batch_tokens,
             "batch_wait_ms": args.batch_wait_ms}
    try:
        limits = ServeLimits(**{key: value for key, value in given.items() if value is not None})
    except ValidationError as exc:
        raise option_error(exc) from None
    try:
        serve_index(Path(args.index), args.host, args.port, device=args.device, model=args.model, force=args.force,
                    limits=limits, access_log=args.access_log, dtype=args.dtype)
    except ServeError as exc:
        raise CommandError(str(exc)) from None
    return 0
