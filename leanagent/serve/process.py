"""The process `leanagent serve` runs: the listening socket, uvicorn, and the signals that stop it.

The index is loaded and the app built before the socket listens, so a client never meets a half-built server.
The socket is bound here, not by uvicorn, so that `port=0` works and the announced URL names the real port.
SIGINT, SIGTERM and SIGHUP stop it gracefully (uvicorn's own handlers while it runs, ours around them), and
the process exits 0 saying why it stopped and how many retrievals it answered.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from pathlib import Path

import uvicorn

from leanagent.index import PremiseIndex, PremiseIndexError
from leanagent.serve.app import create_app
from leanagent.serve.schemas import ServeLimits
from leanagent.supervision import Interrupted, interrupt_on_signals

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 23337
GRACEFUL_SHUTDOWN_S = 10


class ServeError(Exception):
    """The server cannot start: its index cannot be used, or its address cannot be listened on."""


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def serve_index(folder: Path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, device: str = "cpu",
                model: str | None = None, force: bool = False, limits: ServeLimits | None = None,
                access_log: bool = False, log: Callable[[str], None] = _to_stderr, dtype: str = "auto") -> int:
    """Serve the index in `folder` until a signal stops it; the retrievals answered.

    `model`, `force` and `dtype` are `PremiseIndex.load`'s (another path to the same weights; a changed model,
    warned about). Raises ServeError, before anything listens, for an index or an address that cannot be used.
    """
    try:
        index = PremiseIndex.load(Path(folder), device=device, model=model, force=force, dtype=dtype)
    except PremiseIndexError as exc:
        raise ServeError(str(exc)) from None
    for warning in index.warnings:
        log(f"warning: {warning}")
    app = create_app(index, limits)  # before listening: a client never meets a half-built server
    try:
        sock = listen(host, port)
    except OSError as exc:
        raise ServeError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://[{bound_host}]:{bound_port}" if ":" in bound_host else f"http://{bound_host}:{bound_port}"
    config = uvicorn.Config(app, log_level="info" if access_log else "warning", access_log=access_log,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    reason = "shutdown"
    try:
        # Ours until uvicorn takes the signals over, and again after: it shuts down gracefully, then re-raises
        # the signal it got, which ours turns into Interrupted. A signal during start-up stops as cleanly.
        with interrupt_on_signals():
            log(f"serving {len(index)} premises of {folder} ({index.dtype}) at {url}; in Lean: set_option "
                f"premiseSelection.apiBaseUrl \"{url}\"  (Ctrl-C stops)")
            uvicorn.Server(config).run(sockets=[sock])
    except Interrupted as exc:
        reason = str(exc)
    finally:
        sock.close()
    requests = app.state.premise_server.requests
    log(f"stopped ({reason}) after {requests} retrieval(s)")
    return requests


def listen(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> socket.socket:
    """A listening TCP socket for uvicorn's `sockets=` (bound by us, so that port 0 can be reported).

    Made with proto IPPROTO_TCP, and with TCP_NODELAY, which accepted connections inherit: asyncio sets NODELAY
    only on sockets whose proto says TCP, and `socket.create_server` leaves it 0. Without it every response
    (headers, then body: two writes) waited for the client's delayed ACK, 40 ms a request on Linux."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
                               flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock
