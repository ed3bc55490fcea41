"""Prefect's temporary local server for `leanagent run`, bound to this process and out of the terminal's reach.

With no PREFECT_API_URL, Prefect's first client starts a server as a plain child process
(`prefect.server.api.server.SubprocessASGIServer`: uvicorn) and stops it from an atexit hook. Three things
go wrong with that child as it is:

- it is in the terminal's foreground process group, so a Ctrl-C (SIGINT to the whole group) stops it
  at the very moment the flow needs it to record the interrupted stage: the flow then retries its API
  calls for minutes and dies with connection tracebacks;
- a SIGKILL of this process (the OOM killer) leaves it running, since no atexit hook runs;
- two started at once on one database (two runs on one machine, one Prefect home) both migrate it as they start,
  and race on its tables: one dies with "Application startup failed" and about 180 lines of tracebacks before
  Prefect starts it again.

So we create that same singleton first, from this (main) thread, with its uvicorn child in a session
of its own (no terminal signal reaches it) and the parent-death signal set (`prctl(PR_SET_PDEATHSIG,
SIGTERM)`, leanagent/ground/supervision.py), one start at a time per database (a lock beside it: the
second run waits for the first's server to be up, then finds the tables made), and stop it ourselves when the
command ends. Prefect's own code finds it running (`SubprocessASGIServer()` returns the one instance) and uses
it. This module is the one place that knows those internals: a no-op with a configured server, or if Prefect's
internals are not the ones expected.

The child's output reaches the terminal through a pipe that is cut when the stop begins: uvicorn's
shutdown cancels the server's background services mid-query, and SQLAlchemy logs each connection it
could not roll back as an ERROR with a 20-line traceback ("Exception during reset or similar"), after
the command's last word. What the server says while the command runs still reaches the terminal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import (
    PREFECT_API_DATABASE_CONNECTION_URL,
    PREFECT_API_URL,
    PREFECT_HOME,
    PREFECT_SERVER_EPHEMERAL_ENABLED,
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
)
from sqlalchemy.engine import make_url

from leanagent.ground.atomic import out_folder_problem
from leanagent.ground.pid_lock import LockHeld, PidLock
from leanagent.ground.supervision import parent_death_signal

# The temporary server's defaults, under any value the user set (environment, profile, prefect.toml: Prefect
# passes those to the server's environment after these). Its telemetry service writes a session row into the
# fresh SQLite database while the server's other services and the flow's first calls write too, and the
# "database is locked" it can hit is logged as a long traceback; a throwaway local server has nothing to report.
TEMPORARY_SERVER_DEFAULTS = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
# Prefect waits 20 s for its temporary server by default: on a busy 2-core laptop (a training job beside it) that
# start takes longer, and the run would end before it began. Said explicitly, the setting is taken as given.
STARTUP_FLOOR_S = 120


def startup_timeout() -> int:
    """How long to wait for the temporary server: the user's setting when set, else at least `STARTUP_FLOOR_S`."""
    configured = int(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in os.environ:
        return configured
    return max(configured, STARTUP_FLOOR_S)


DRAIN_SECONDS = 5.0  # for the logs and events still queued for the server when the command ends


@contextmanager
def temporary_server() -> Iterator[None]:
    """Prefect's temporary server for the block (when no server is configured), stopped when it ends.

    Before it stops, the logs and events still queued for it are sent (a bounded wait): after, they would fail
    with "--- Error logging to API ---" as the interpreter exits.
    """
    started = _start()
    try:
        yield
    finally:
        if started is not None:
            server, output = started
            try:
                send_queued()
            finally:
                output.cut()
                server.stop()
                output.close()


def send_queued() -> None:
    """Send the logs and events still queued for the API (a bounded wait), now rather than at the interpreter's
    exit, where a slow send prints "EventsWorker - Still processing items" after the command's last word."""
    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=DRAIN_SECONDS)


class ServerOutput:
    """A child's stdout and stderr, passed on to this process's stderr (fd 2, as an inherited one would be)
    until `cut`, then read and dropped until the child exits.

    Give `writer` to each Popen, then call `started` once no more children will be started (the pipe ends
    when the last child holding it exits); `close` waits a bounded time for that end.
    """

    def __init__(self, sink_fd: int = 2) -> None:
        self._reader, self.writer = os.pipe()
        self._sink = sink_fd
        self._cut = threading.Event()
        self._pump = threading.Thread(target=self._pass_on, name="temporary-server-output", daemon=True)
        self._pump.start()

    def _pass_on(self) -> None:
        with os.fdopen(self._reader, "rb", buffering=0) as pipe:
            for line in pipe:  # read to the end whatever happens, so that the child never blocks on a full pipe
                if not self._cut.is_set():
                    try:
                        os.write(self._sink, line)
                    except OSError:  # this process's stderr is gone: nothing more can be shown
                        self._cut.set()

    def started(self) -> None:
        """This process's copy of the write end is closed: the children hold theirs."""
        if self.writer >= 0:
            os.close(self.writer)
            self.writer = -1

    def cut(self) -> None:
        self._cut.set()

    def close(self, timeout: float = 10.0) -> None:
        self.started()
        self._pump.join(timeout)


def _start():  # -> tuple[SubprocessASGIServer, ServerOutput] | None
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    import prefect.server.api.server as server_module

    base = getattr(server_module, "SubprocessASGIServer", None)
    preexec = parent_death_signal(signal.SIGTERM)
    if (base is None or preexec is None or not hasattr(base, "_run_uvicorn_command")
            or not isinstance(getattr(base, "_instances", None), dict) or None in base._instances
            or not isinstance(getattr(server_module, "subprocess", None), types.ModuleType)):
        return None

    class ServerBoundToThisProcess(base):  # type: ignore[misc, valid-type]
        def _run_uvicorn_command(self):  # type: ignore[no-untyped-def]
            real = server_module.subprocess
            bound = types.ModuleType(real.__name__)
            bound.__dict__.update(real.__dict__)
            bound.Popen = lambda *args, **kwargs: real.Popen(*args, **{
                "preexec_fn": preexec, "start_new_session": True, "stdout": output.writer,
                "stderr": output.writer, **kwargs,
                "env": {**TEMPORARY_SERVER_DEFAULTS, **(kwargs.get("env") or os.environ)}})
            server_module.subprocess = bound  # only `_run_uvicorn_command` reads it, and only here
            try:
                return super()._run_uvicorn_command()
            finally:
                server_module.subprocess = real

    with _one_start_at_a_time():
        output = ServerOutput()
        server = ServerBoundToThisProcess()
        try:
            server.start(timeout=startup_timeout())
        except RuntimeError as exc:  # Prefect's own "Timed out while attempting to connect ...", with the output
            server.stop()
            output.close()
            reason = (str(exc).strip().splitlines() or ["no reason given"])[0][:300]
            raise TemporaryServerError(
                f"Prefect's temporary server did not start ({reason}); "
                f"{_CHECK_HOME.format(home=PREFECT_HOME.value())}") from None
        finally:
            output.started()
    return server, output


_CHECK_HOME = ("check that PREFECT_HOME ({home}) is a folder it can create and write, or set PREFECT_API_URL to a "
               "running server (`prefect server start`)")


def start_lock() -> Path:
    """The file that lets one temporary server at a time start on the database: beside its SQLite file (every
    Prefect home that names that file shares it), in the Prefect home for any other database."""
    url = make_url(PREFECT_API_DATABASE_CONNECTION_URL.value())
    if url.get_backend_name() == "sqlite" and url.database and ":memory:" not in url.database:
        database = Path(url.database)
        return database.with_name(f".{database.name}.leanagent-start.lock")
    return Path(PREFECT_HOME.value()) / ".leanagent-temporary-server-start.lock"


@contextmanager
def _one_start_at_a_time() -> Iterator[None]:
    """Held while the temporary server starts: it migrates its database as it starts, and two servers migrating one
    database at once race on its tables (`no such table: ...`, "Application startup failed" and 180 lines of
    tracebacks, two `leanagent run`s started together on one machine). The second waits, saying so in one line,
    and finds the tables made; the servers then share the database, each run's flow runs recorded in it as before.
    Only leanagent's commands take this lock: a server started another way (`prefect server start`) is not held."""
    lock = PidLock(start_lock())
    problem = out_folder_problem(lock.path.parent)  # Prefect's home as a file, or read-only: said as it is
    if problem is not None:
        raise TemporaryServerError(f"Prefect's temporary server cannot start: {problem}; "
                                   f"{_CHECK_HOME.format(home=PREFECT_HOME.value())}")
    try:
        lock.acquire(wait_s=startup_timeout(), on_wait=lambda holder: print(
            f"waiting for another run's temporary Prefect server (pid {holder}) to finish starting on the database "
            f"in {lock.path.parent}: they start one at a time", file=sys.stderr, flush=True))
    except LockHeld as exc:
        raise TemporaryServerError(
            f"another run's temporary Prefect server (pid {exc.holder}) was still starting on the database in "
            f"{lock.path.parent} after {startup_timeout()} s; rerun when it has started, or set PREFECT_API_URL to "
            f"a running server (`prefect server start`)") from None
    except OSError as exc:
        raise TemporaryServerError(
            f"Prefect's temporary server cannot start: {lock.path} ({exc.strerror or exc}); "
            f"{_CHECK_HOME.format(home=PREFECT_HOME.value())}") from None
    with lock:
        yield


class TemporaryServerError(RuntimeError):
    """The temporary server could not be started; the message is one line saying what to check."""
