"""Nothing of a job outlives whoever launched it, however that process ends.

A job is a torchrun process and its ranks, each rank in a session of its own (torchrun starts
every worker with `start_new_session=True`), all in a session apart from the launcher's. So no
signal sent to one group reaches them all, and nothing the kernel does when the launcher dies
reaches any of them. Three mechanisms, each covering what the others cannot:

1. The launcher knows every process of the job by pid AND start time (psutil's `create_time`):
   it asks psutil for torchrun's descendants (`Process.children(recursive=True)`) while the job
   runs, and each rank writes its own record into `JOB/pids/` (`start()`). It signals them one
   by one (and their process groups), so a rank that is stopped, hung or ignoring SIGTERM is
   SIGKILLed after the grace period, and a recycled pid is never signalled: a pid whose start
   time differs is another process (leanagent/launch/local.py, `end_job`).
2. On Linux, torchrun is started with the parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGTERM)`,
   set in the child between fork and exec by `parent_death_signal()`): when the launching thread
   dies, SIGKILL included, the kernel sends torchrun SIGTERM, and torchrun ends its workers (SIGTERM,
   and SIGKILL 30 s later). That clean-up can outlive the workers, so torchrun runs under a
   watchdog of ours (leanagent/launch/torchrun.py) that SIGKILLs the job and exits within a second
   of the launcher's death. Elsewhere (macOS) the watchdog alone does it.
3. Each rank runs a daemon thread (`watch_supervisor()`) that checks, every second, that the
   launcher (pid and start time in LEANAGENT_SUPERVISOR_PID / _START) and its parent torchrun
   are still there. When either is gone, the first rank to notice SIGKILLs the sibling ranks of
   this machine (one that is stopped or hung cannot watch for itself), torchrun, and its own
   process group: the main thread may be stuck in a collective, so no clean-up is attempted; a
   rerun resumes from the job's last checkpoint.

`leanagent run` starts Prefect's temporary server with the same parent-death signal, so it ends
with the command too (flows/temporary_server.py).
`HoldSignals` keeps a second Ctrl-C or SIGTERM from cutting short the ending of a job or the
record that a stage was interrupted; `interrupt_on_signals` turns SIGINT, SIGTERM and SIGHUP into
`Interrupted` in the commands, so that a launcher in the middle of a job ends it.

Why start times are compared with a tolerance: a start time crosses processes as seconds since the
epoch (an environment variable, a pid record), which psutil derives from the boot time each reading;
two readings of one process agree to psutil's precision (0.01 s on Linux), while a recycled pid would
need the pid counter to wrap within `START_TOLERANCE_S`. Once found, a process is held as a
`psutil.Process`, whose own identity check does not depend on the wall clock.

POSIX (Linux, macOS); the parent-death signal is a Linux-only extra. This module imports nothing
heavy, so the launcher can use it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import psutil

from leanagent.ground.atomic import write_json_atomic
from leanagent.ground.json_files import KIB, JsonFileError, read_json_file

ENV_SUPERVISOR_PID = "LEANAGENT_SUPERVISOR_PID"
ENV_SUPERVISOR_START = "LEANAGENT_SUPERVISOR_START"
ENV_JOB_DIR = "LEANAGENT_JOB_DIR"
SUPERVISION_ENV = (ENV_SUPERVISOR_PID, ENV_SUPERVISOR_START, ENV_JOB_DIR)
PIDS_DIR = "pids"
WATCH_INTERVAL_S = 1.0
START_TOLERANCE_S = 1.0  # two readings of one process's start time (see the module docstring)
EXIT_SUPERVISOR_GONE = 75  # a rank that ended itself because nobody supervises it any more
PR_SET_PDEATHSIG = 1
GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)  # ended: a zombie only waits to be reaped


def running(proc: psutil.Process) -> bool:
    """Still the process `proc` was (psutil checks its pid against its start time), and not a zombie."""
    try:
        return proc.is_running() and proc.status() not in GONE
    except psutil.Error:
        return False


def find_process(pid: int, start: float | None = None) -> psutil.Process | None:
    """The running process `pid`; with `start`, only if it is the one that started then (not a recycled pid)."""
    try:
        proc = psutil.Process(pid)
        if start is not None and abs(proc.create_time() - start) > START_TOLERANCE_S:
            return None
    except psutil.Error:
        return None
    return proc if running(proc) else None


def start_time(pid: int) -> float | None:
    """When `pid` started, in seconds since the epoch (with the pid, names one process); None if there is none."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def is_running(pid: int, start: float) -> bool:
    """The very process that had this start time is alive and not a zombie."""
    return find_process(pid, start) is not None


def descendants(proc: psutil.Process) -> list[psutil.Process]:
    """Every process below `proc` (children, theirs, ...); none once it has gone."""
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children()
    except psutil.Error:
        return []


def machine_identity() -> str:
    """This boot of this machine: a pid means nothing outside it (job folders on a shared filesystem)."""
    return f"{socket.gethostname()}/{psutil.boot_time():.0f}"


def supervisor_environment(job_dir: Path) -> dict[str, str]:
    """What the launcher hands every rank so that it can watch the launcher and record itself."""
    me = os.getpid()
    return {ENV_SUPERVISOR_PID: str(me), ENV_SUPERVISOR_START: str(start_time(me) or 0),
            ENV_JOB_DIR: str(Path(job_dir).resolve())}


def pids_dir(job_dir: Path) -> Path:
    return Path(job_dir) / PIDS_DIR


def record_rank(job_dir: Path) -> Path:
    """`JOB/pids/rankN.json`: this rank's pid and start time, for the launcher and for sibling ranks."""
    rank = os.environ.get("RANK", "0")
    me = os.getpid()
    path = pids_dir(job_dir) / f"rank{rank}.json"
    write_json_atomic(path, {"rank": int(rank), "pid": me, "start": start_time(me), "machine": machine_identity()})
    return path


def rank_records(job_dir: Path) -> dict[int, float]:
    """pid -> start time of the ranks that recorded themselves on THIS machine (other nodes' pids are not ours)."""
    here = machine_identity()
    records: dict[int, float] = {}
    folder = pids_dir(job_dir)
    if not folder.is_dir():
        return records
    for path in folder.glob("rank*.json"):
        try:
            data = read_json_file(path, 64 * KIB)
        except JsonFileError:
            continue
        pid, start = data.get("pid"), data.get("start")
        if data.get("machine") == here and isinstance(pid, int) and isinstance(start, (int, float)) \
                and not isinstance(start, bool):
            records[pid] = float(start)
    return records


def signal_verified(proc: psutil.Process, sig: int, group: bool = False) -> bool:
    """Send `sig` to `proc` only if it is still that process (psutil checks its start time) and has not ended.

    With `group`, also to its process group when it leads one (a rank's DataLoader workers), never to
    the caller's own group. Returns whether anything was signalled.
    """
    if not running(proc):
        return False
    try:
        if group and os.getpgid(proc.pid) == proc.pid and proc.pid != os.getpgrp():
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError, psutil.Error):
        return False
    return True


def _resolve_prctl() -> Callable[..., int] | None:
    # Resolved once, before any fork: a child between fork and exec must not load libraries or import.
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _resolve_prctl()


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the kernel send `sig` to the child when the thread that started it dies.

    Linux only (prctl): None elsewhere, where the watchdogs of the module docstring do the work alone.
    The kernel tracks the creating *thread*: call Popen from the thread that waits for the child.
    If the parent died between fork and prctl, the child signals itself at once.
    """
    prctl = _PRCTL
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


class HoldSignals:
    """Hold SIGINT, SIGTERM and SIGHUP while a block that must not be cut short runs (ending a job, recording
    that it was interrupted); `signalled` tells whether one came meanwhile.

    With `redeliver`, the last one is sent again once the previous handlers are back: deferred, not lost.
    Works from the main thread only (where Python runs signal handlers); elsewhere it holds nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, redeliver: bool = True) -> None:
        self.redeliver = redeliver
        self.signalled: int | None = None
        self._previous: dict[int, object] = {}

    def _handler(self, signum: int, frame: object) -> None:
        self.signalled = signum

    def __enter__(self) -> HoldSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                current = signal.getsignal(sig)
                # None: a handler set outside Python, which we could not restore; SIG_IGN: nothing to hold.
                if current is not None and current is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        if self.redeliver and self.signalled is not None:
            os.kill(os.getpid(), self.signalled)


def watch_supervisor(job_dir: Path | None, interval_s: float = WATCH_INTERVAL_S) -> threading.Thread | None:
    """In a rank: end this machine's part of the job when the launcher or torchrun is gone.

    Watches the launcher named by LEANAGENT_SUPERVISOR_PID/_START, and, under torchrun, the parent
    process. Does nothing when neither applies (a rank program run by hand).
    """
    try:
        supervisor_pid = int(os.environ[ENV_SUPERVISOR_PID])
        supervisor: psutil.Process | None = find_process(supervisor_pid, float(os.environ[ENV_SUPERVISOR_START]))
    except (KeyError, ValueError):
        supervisor_pid, supervisor = None, None
    parent = find_process(os.getppid()) if "TORCHELASTIC_RUN_ID" in os.environ else None
    if supervisor_pid is None and parent is None:
        return None

    def check() -> str | None:
        if supervisor_pid is not None and (supervisor is None or not running(supervisor)):
            return f"the launcher (pid {supervisor_pid}) is gone"
        if parent is not None and os.getppid() != parent.pid:
            return f"torchrun (pid {parent.pid}) is gone"
        return None

    def loop() -> None:
        while True:
            reason = check()
            if reason is not None:
                end_orphaned_job(job_dir, reason, parent)
            time.sleep(interval_s)

    thread = threading.Thread(target=loop, name="leanagent-supervision", daemon=True)
    thread.start()
    return thread


def end_orphaned_job(job_dir: Path | None, reason: str, parent: psutil.Process | None) -> None:
    """SIGKILL the sibling ranks of this machine (a stopped or hung one cannot watch for itself), torchrun
    (whose own clean-up takes 30 s), then this rank with its process group. Nobody collects the job's
    result any more; a rerun resumes from its last checkpoint."""
    me = os.getpid()
    try:
        print(f"[supervision] rank {os.environ.get('RANK', '?')}: {reason}; ending the job's processes",
              file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # nobody reads our output any more
    if job_dir is not None:
        for pid, start in rank_records(job_dir).items():
            sibling = find_process(pid, start) if pid != me else None
            if sibling is not None:
                signal_verified(sibling, signal.SIGKILL, group=True)
    if parent is not None and os.getppid() == parent.pid:
        signal_verified(parent, signal.SIGKILL)
    if os.getpgid(0) == me:  # our own session (torchrun's workers): our DataLoader workers go too
        os.killpg(me, signal.SIGKILL)
    os._exit(EXIT_SUPERVISOR_GONE)


def start(job_dir: Path | None = None) -> None:
    """Called first thing in a rank program: record this rank and watch its supervisor.

    The job folder defaults to LEANAGENT_JOB_DIR (set by the launcher); without one nothing is recorded.
    """
    folder = Path(job_dir) if job_dir is not None else (Path(os.environ[ENV_JOB_DIR]) if ENV_JOB_DIR in os.environ
                                                         else None)
    if folder is not None:
        record_rank(folder)
    watch_supervisor(folder)


def raise_in_thread(ident: int, exc_type: type[BaseException]) -> bool:
    """Raise `exc_type` in the thread `ident` at its next Python instruction (CPython's PyThreadState_SetAsyncExc).

    Signals reach only the main thread: this is how an interrupt reaches a thread that launched a job (a sweep's
    setup), so that its launcher ends the job there as it would in the main thread. A thread blocked in a C call
    gets it when the call returns: the launchers poll (every POLL_SECONDS). True when the thread was found."""
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc_type)) == 1


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP, raised in the main thread: code that ends jobs on Ctrl-C ends them on all three."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum  # what a shell reports for a process ended by this signal


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into `Interrupted`, so the launcher ends every job (SIGTERM, grace,
    SIGKILL) and the command exits 128 + signal instead of dying with its jobs orphaned."""

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    # A signal already ignored stays ignored (`nohup`, a shell's background job).
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
