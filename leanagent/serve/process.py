"""The process `leanagent serve` runs: what it serves, the listening socket, uvicorn, and the signals that stop it.

The source is an INDEX folder, or a lifelong run's RUN_DIR: then the run's newest finished stage, followed as the
run goes on (`follow.py`). The index is loaded and the app built before the socket listens, so a client never
meets a half-built server. The socket is bound here, not by uvicorn, so that `port=0` works and the announced URL
names the real port. Connections are bounded (`protocol.py`): a request must arrive whole within
`request_timeout_s`, and at most `max_connections` are open, within the process's descriptor limit (raised to
its hard limit where it can be, else the connections and the accept burst lowered to fit). SIGINT, SIGTERM and
SIGHUP stop it gracefully (uvicorn's own handlers while it runs, ours around them): requests running get
`STOP_ANSWERED_S` to be answered, then each one left a 503 (`app.Stop`), well within uvicorn's window, and the
process exits 128 + the signal's number, as every leanagent command does, saying why it stopped and how many
retrievals it answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import uvicorn

from leanagent.ground.names import AUTO
from leanagent.ground.supervision import Interrupted, interrupt_on_signals
from leanagent.index.files import PremiseIndexError
from leanagent.index.query import PremiseIndex
from leanagent.run.manifest import ManifestUnreadableError
from leanagent.serve.access import REDACTED, AccessError, RedactToken, is_loopback, require_token
from leanagent.serve.app import Stop, create_app, returnable_large_allocations
from leanagent.serve.follow import (
    DEFAULT_FOLLOW_S,
    ServerHolder,
    Stage,
    StageFollower,
    StageRefused,
    check_inside,
    is_run_dir,
    run_stages,
)
from leanagent.serve.protocol import OncePerMinute, bounded_protocol, quiet_accept_errors
from leanagent.serve.schemas import ServeLimits
from leanagent.serve.server import PremiseServer, StageInfo

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 23337
GRACEFUL_SHUTDOWN_S = 10
# Of uvicorn's window, the time requests running at a stop have to finish; those left then get a 503 (`Stop`), and
# the rest of the window is for their answers to go out, so uvicorn never cancels one (a 500 and a traceback).
STOP_ANSWERED_S = 5.0
# At the stop, at most this long for a stage being loaded and for the encoder's thread, before the model is freed.
RELEASE_WAIT_S = 10.0
SPARE_DESCRIPTORS = 32  # beside the connections and those open at the start: a new stage's files, the manifest
# Connections asyncio accepts in one go when the listening socket is ready (the `backlog` uvicorn passes it, also the
# kernel's queue). Each holds a descriptor before it is counted, or refused, two turns of the event loop later, so
# up to four such bursts are open beyond the connections counted: the descriptors must leave room for them.
ACCEPT_BURST = 2048  # uvicorn's default backlog
BURSTS_IN_FLIGHT = 4
MIN_BURST = 8


class ServeError(Exception):
    """The server cannot start: its index cannot be used, or its address cannot be listened on."""


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def newest_stage(run_dir: Path) -> Stage:
    """The stage a RUN_DIR serves now: its newest finished stage with an index, inside the run's folder."""
    try:
        stages = run_stages(run_dir)
        if stages:
            check_inside(run_dir, stages[-1])
    except (ManifestUnreadableError, StageRefused) as exc:
        raise ServeError(str(exc)) from None
    if not stages:
        raise ServeError(f"{run_dir}: no stage of this run has a premise index yet (each repository's evaluation "
                         f"writes one when it is done); serve an INDEX, or start the server once a stage is done")
    return stages[-1]


def lean_url(host: str, port: int, token: str | None = None) -> str:
    """The URL to give Lean (premiseSelection.apiBaseUrl): an address that listens on every interface is reached
    by this machine's name."""
    shown = machine_name() if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}" + (f"/{token}" if token else "")


def machine_name() -> str:
    """The name other machines reach this one by: its fully qualified name, unless that is a loopback name (where
    /etc/hosts maps the host's name to 127.0.0.1 beside `localhost`, `getfqdn` gives `localhost`), then its host
    name, then its first address that is not loopback."""
    for name in (socket.getfqdn(), socket.gethostname()):
        if name and not _loopback_name(name):
            return name
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(address.address.split("%")[0]):
                return address.address.split("%")[0]
    return socket.gethostname() or "localhost"


def _loopback_name(name: str) -> bool:
    return name == "localhost" or name.startswith("localhost.") or name.endswith(".localhost") or is_loopback(name)


def descriptor_room(wanted: int, log: Callable[[str], None]) -> tuple[int, int]:
    """(connections, accept burst) the process can hold within its descriptor limit: `wanted` connections and
    `ACCEPT_BURST`, after raising the soft limit towards the hard one if it must; or, where the limit is lower, a
    burst and as many connections as it leaves (said once), so that the process never runs out of descriptors
    ("Too many open files") however fast clients connect."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    base = _open_descriptors() + SPARE_DESCRIPTORS
    need = wanted + base + BURSTS_IN_FLIGHT * ACCEPT_BURST
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted, ACCEPT_BURST
    burst = (soft - base - wanted) // BURSTS_IN_FLIGHT  # every connection wanted, a smaller burst
    if burst >= MIN_BURST:
        return wanted, burst
    burst = max(MIN_BURST, (soft - base) // (2 * BURSTS_IN_FLIGHT))  # else half the room for the bursts
    room = max(1, soft - base - BURSTS_IN_FLIGHT * burst)
    log(f"warning: --max-connections {wanted}: the process may open {soft} files, so at most {room} connections, "
        f"{burst} accepted at once (raise `ulimit -n` for more)")
    return min(room, wanted), burst


def _open_descriptors() -> int:
    """Descriptors open now (the index's files, the model's, logs, the listening socket)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 64  # no way to count them here: a margin


class _Server(uvicorn.Server):
    """uvicorn's server, with `ready` called once it answers: the banner says "serving" only then. Before it, a
    signal meets ours (`interrupt_on_signals`, an exception wherever the main thread is, uvicorn's imports
    included); after it, uvicorn's own handlers, which stop it gracefully."""

    def __init__(self, config: uvicorn.Config, ready: Callable[[], None], stop: Stop) -> None:
        super().__init__(config)
        self._ready = ready
        self._stop = stop

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._stop.begin(STOP_ANSWERED_S)
        await super().shutdown(sockets=sockets)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        await super().serve(sockets=sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self._ready()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's graceful stop for SIGHUP too (a closed terminal, a session's end), as for SIGINT and SIGTERM:
        requests in flight are answered, then the signal is raised again for `interrupt_on_signals` (exit 129). A
        SIGHUP ignored (`nohup`) stays ignored."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        wanted = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in wanted
                    if signal.getsignal(sig) is not signal.SIG_IGN}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for captured in reversed(self._captured_signals):
            signal.raise_signal(captured)


def serve(source: Path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, device: str = "cpu",
          model: str | None = None, force: bool = False, limits: ServeLimits | None = None, access_log: bool = False,
          log: Callable[[str], None] = _to_stderr, dtype: str = "auto", token: str | None = None,
          follow_s: float = DEFAULT_FOLLOW_S, openapi: bool = False, token_source: str = "the token",
          insecure_no_token: bool = False, engine: str = AUTO) -> int:
    """Serve an INDEX folder, or a RUN_DIR's newest stage (followed every `follow_s` seconds), until a signal stops
    it; the exit code: 0 when told to stop, 128 + N after signal N.

    `model`, `force`, `dtype` and `engine` are `PremiseIndex.load`'s (another path to the same weights; a changed
    model, warned about; ct2: each stage's model converted once, cached next to its index, converted on the
    follower's thread at a swap, as the index is loaded). `token_source` says where the token is read (the banner
    shows it, never the token); `insecure_no_token`: serve beyond this machine without one. Raises ServeError,
    before anything is loaded or listens, for a source or an address that cannot be used."""
    limits = limits or ServeLimits()
    source = Path(source)
    try:
        require_token(host, token, insecure_no_token)
    except AccessError as exc:
        raise ServeError(str(exc)) from None
    returnable_large_allocations()
    follows = is_run_dir(source)

    def load(folder: Path, stage: Stage | None) -> PremiseServer:
        index = PremiseIndex.load(folder, device=device, model=model, force=force, dtype=dtype, engine=engine)
        for warning in index.warnings:
            log(f"warning: {warning}")
        return PremiseServer(index, limits, StageInfo(stage.name, stage.position) if stage else None)

    stage = newest_stage(source) if follows else None
    try:
        holder = ServerHolder(load(stage.index if stage else source, stage))
    except PremiseIndexError as exc:
        raise ServeError(str(exc)) from None
    stop = Stop()
    app = create_app(holder, token=token, openapi=openapi, stop=stop)  # before listening: never a half-built server
    connections, burst = descriptor_room(limits.max_connections + limits.health_connections, log)
    try:
        sock = listen(host, port)
    except OSError as exc:
        raise ServeError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    bound_host, bound_port = sock.getsockname()[:2]
    url = lean_url(bound_host, bound_port, REDACTED if token else None)
    health = min(limits.health_connections, connections // 2)
    config = uvicorn.Config(app, http=bounded_protocol(limits.request_timeout_s, connections - health, health),
                            log_level="info" if access_log else "warning", access_log=access_log,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, backlog=burst,
                            # The app has no start-up or shut-down handlers. uvicorn's lifespan task catches every
                            # BaseException: a Ctrl-C landing in it during start-up was swallowed, and that server
                            # went on serving (seen once, found idle in its event loop hours later).
                            lifespan="off")
    follower = StageFollower(source, holder, stage, lambda s: load(s.index, s), log, follow_s) if stage else None
    # Read now, not kept: a reference held here would keep this stage's model and embeddings after a swap.
    count, engine_line = len(holder.current.premise_names), holder.current.index.describe_engine()
    what = (f"stage {stage.name} (#{stage.position + 1}) of {source}, followed every {follow_s:g} s" if stage
            else str(source))
    code, reason = 0, "shutdown"
    try:
        # Ours until uvicorn takes the signals over, and again after: it shuts down gracefully, then re-raises
        # the signal it got, which ours turns into Interrupted. A signal during start-up stops as cleanly.
        with interrupt_on_signals(), quiet_logs(token):
            _warn_beyond_loopback(bound_host, bound_port, token, log)
            where = f" ({REDACTED}: {token_source})" if token else ""
            banner = (f"serving {count} premises of {what} ({engine_line}) at {url}; in Lean: "
                      f"set_option premiseSelection.apiBaseUrl \"{url}\"{where}  (Ctrl-C stops)")

            def ready() -> None:  # the banner, then the follower: a swap is never reported before it
                log(banner)
                if follower is not None:
                    follower.start()

            _Server(config, ready, stop).run(sockets=[sock])
    except Interrupted as exc:
        code, reason = exc.exit_code, str(exc)
    finally:
        if follower is not None:
            follower.stop(RELEASE_WAIT_S)
        sock.close()
        holder.release(RELEASE_WAIT_S)
    log(f"stopped ({reason}) after {holder.requests} retrieval(s)")
    return code


# The loggers a server's lines go through (uvicorn's, ours, asyncio's), and the root one, whose handlers print them.
LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "leanagent", "leanagent.serve", "asyncio", "")


@contextlib.contextmanager
def quiet_logs(token: str | None) -> Iterator[None]:
    """uvicorn's log as a shared server needs it: its per-request warnings (a malformed request, one a client can
    send thousands of) at most once a minute each, and the token in no line (the access log has whole paths): on
    each logger and on each handler that prints, so a line from a logger below them is redacted too."""
    filters: list[tuple[logging.Logger | logging.Handler, logging.Filter]] = [
        (logging.getLogger("uvicorn.error"), OncePerMinute())]
    if token:
        redact = RedactToken(token)
        loggers = [logging.getLogger(name) for name in LOGGERS]
        handlers = {id(h): h for logger in loggers for h in logger.handlers}
        filters += [(where, redact) for where in (*loggers, *handlers.values())]
    for where, f in filters:
        where.addFilter(f)
    try:
        yield
    finally:
        for where, f in filters:
            where.removeFilter(f)


def _warn_beyond_loopback(host: str, port: int, token: str | None, log: Callable[[str], None]) -> None:
    if is_loopback(host):
        return
    where = "every network interface" if host in ("0.0.0.0", "::") else host
    if token is None:
        log(f"warning: listening on {where} without a token (--insecure-no-token): anyone who can reach port {port} "
            f"can use this server and read what it indexes")
    else:
        log(f"warning: listening on {where}, with a token in the URL's path: plain HTTP, so on a network you trust "
            f"(or behind a TLS proxy)")


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


def resolve_source(source: Path) -> tuple[Path, dict[str, Any] | None]:
    """An INDEX folder as it is, a RUN_DIR as its newest stage's index (and the stage): what `retrieve` reads."""
    if is_run_dir(source):
        stage = newest_stage(source)
        return stage.index, {"stage": stage.name, "stage_number": stage.position + 1}
    return source, None
