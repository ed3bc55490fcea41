"""`serve`: an index, or a lifelong run's newest stage, behind Lean's premise-selection API (`leanagent.serve`).

The limits' flags come from `ServeLimits`, so each is defined, defaulted and described once.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path

from leanagent.cli.common import (
    CommandError,
    add_dtype_argument,
    add_model_check_arguments,
    add_model_options,
    check_device,
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
                        "with a warning, and a token is advised)")
    p.add_argument("--port", type=int, default=23337, help="port (default 23337; 0: any free port, printed)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"], help="where the encoder runs (mps: "
                                                                                    "Apple GPUs, untested here)")
    add_dtype_argument(p)
    p.add_argument("--token-file", metavar="FILE",
                   help=f"require this access token (the file's first line; a new file gets a random one, readable "
                        f"by you alone) as the first part of every path, so Lean's URL is http://HOST:PORT/TOKEN; "
                        f"the environment's {TOKEN_ENV} does the same")
    p.add_argument("--follow-s", type=float, default=10.0,
                   help="with a RUN_DIR: how often to look for a newer finished stage, in seconds (default 10)")
    p.add_argument("--openapi", action="store_true", help="also serve the API's schema at /openapi.json")
    p.add_argument("--access-log", action="store_true", help="log every request")
    add_model_check_arguments(p)
    limits = p.add_argument_group("limits", "what one request may hold and what the server keeps")
    add_model_options(limits, ServeLimits)
    p.set_defaults(func=cmd_serve)


def read_token(file: str | None) -> str | None:
    """The token of `--token-file` (created with a random one if missing, mode 0600), else of the environment."""
    if file is None:
        token = os.environ.get(TOKEN_ENV, "").strip()
        return token or None
    path = Path(file)
    if not path.exists():
        token = secrets.token_urlsafe(24)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise CommandError(f"--token-file {file}: cannot be created ({exc.strerror or exc})") from None
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"--token-file {file}: cannot be read ({type(exc).__name__})") from None
    token = lines[0].strip() if lines else ""
    if not token or not all(c.isalnum() or c in "-_.~" for c in token):
        raise CommandError(f"--token-file {file}: its first line must be a token of letters, digits and -_.~ "
                           f"(it rides in a URL's path)")
    return token


def cmd_serve(args: argparse.Namespace) -> int:
    from leanagent.serve import ServeError, serve
    from leanagent.serve.schemas import ServeLimits

    check_device(args.device)
    limits = model_from_args(ServeLimits, args)
    if args.follow_s <= 0:
        raise CommandError(f"--follow-s {args.follow_s}: must be positive")
    token = read_token(args.token_file)
    try:
        return serve(Path(args.source), args.host, args.port, device=args.device, model=args.model, force=args.force,
                     limits=limits, access_log=args.access_log, dtype=args.dtype, engine=args.engine, token=token,
                     follow_s=args.follow_s, openapi=args.openapi)
    except ServeError as exc:
        raise CommandError(str(exc)) from None
