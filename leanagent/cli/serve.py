"""`serve`: an index, or a lifelong run's newest stage, behind Lean's premise-selection API (`leanagent.serve`).

The limits' flags come from `ServeLimits`, so each is defined, defaulted and described once.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from leanagent.cli.common import (
    CommandError,
    add_dtype_argument,
    add_model_check_arguments,
    add_model_options,
    check_device,
    check_run_or_index,
    model_from_args,
)

TOKEN_ENV = "LEANAGENT_SERVE_TOKEN"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from leanagent.serve.schemas import ServeLimits

    p = sub.add_parser("serve", help="answer Lean's premise-selection API (premiseSelection.apiBaseUrl) from an "
                                     "index or a run's newest stage",
                       description="Serve over HTTP with the protocol of Lean's premise-selection cloud client: GET "
                                   "/indexed-modules, /indexed-premises, /max-new-premises, /health and POST "
                                   "/retrieve. SOURCE is an INDEX folder (`leanagent index`, `leanagent evaluate "
                                   "--index`) or a lifelong RUN_DIR: then its newest finished stage, and each newer "
                                   "one as the run learns it, without a restart. The model and embeddings are loaded "
                                   "once; every request's work is bounded by the limits below.")
    p.add_argument("source", metavar="SOURCE", help="an INDEX folder, or a RUN_DIR (its manifest.json)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface, "
                        "which needs a token)")
    p.add_argument("--insecure-no-token", action="store_true",
                   help="serve beyond this machine without a token: anyone who reaches the port may use it")
    p.add_argument("--port", type=int, default=23337, help="port (default 23337; 0: any free port, printed)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"], help="where the encoder runs (mps: "
                                                                                    "Apple GPUs, untested here)")
    add_dtype_argument(p)
    p.add_argument("--token-file", metavar="FILE",
                   help=f"require this access token (the file's first line, 16 or more of letters, digits and -._~; "
                        f"a new file gets a random one, readable by you alone, and a file others can read is "
                        f"refused) as the first part of every path, so Lean's URL is http://HOST:PORT/TOKEN; the "
                        f"environment's {TOKEN_ENV} does the same")
    p.add_argument("--follow-s", type=float, default=10.0,
                   help="with a RUN_DIR: how often to look for a newer finished stage, in seconds (default 10)")
    p.add_argument("--openapi", action="store_true", help="also serve the API's schema at /openapi.json")
    p.add_argument("--access-log", action="store_true", help="log every request")
    add_model_check_arguments(p)
    limits = p.add_argument_group("limits", "what one request may hold and what the server keeps")
    add_model_options(limits, ServeLimits)
    p.set_defaults(func=cmd_serve)


def read_token(file: str | None) -> tuple[str | None, str]:
    """The token and where it is read: `--token-file` (written with a random one when missing, mode 0600; refused
    when others may read it), else the environment; each checked for length and characters."""
    from leanagent.serve.access import AccessError, check_token, read_token_file

    try:
        if file is None:
            token = os.environ.get(TOKEN_ENV, "").strip()
            return (check_token(token, TOKEN_ENV) if token else None), f"${TOKEN_ENV}"
        return read_token_file(Path(file)), f"the first line of {file}"
    except AccessError as exc:
        raise CommandError(str(exc)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from leanagent.serve.access import AccessError, require_token
    from leanagent.serve.schemas import ServeLimits

    check_device(args.device)
    limits = model_from_args(ServeLimits, args)
    if args.follow_s <= 0:
        raise CommandError(f"--follow-s {args.follow_s}: must be positive")
    token, token_source = read_token(args.token_file)
    try:  # before the server's modules (torch, uvicorn) are imported: a refusal in a blink
        require_token(args.host, token, args.insecure_no_token)
    except AccessError as exc:
        raise CommandError(str(exc)) from None
    check_run_or_index(Path(args.source))  # before the server's modules (torch, uvicorn): one line, now
    from leanagent.serve import ServeError, serve  # the model's stack: seconds to import

    try:
        return serve(Path(args.source), args.host, args.port, device=args.device, model=args.model, force=args.force,
                     limits=limits, access_log=args.access_log, dtype=args.dtype, engine=args.engine, token=token,
                     follow_s=args.follow_s, openapi=args.openapi, token_source=token_source,
                     insecure_no_token=args.insecure_no_token)
    except ServeError as exc:
        raise CommandError(str(exc)) from None
