"""Nothing of a job outlives whoever launched it, however that process ends.

A job is a torchrun process and its ranks, each rank in a session of its own (torchrun starts
every worker with `start_new_session=True`), all in a session apart from the launcher's. So no
signal sent to one group reaches them all, and nothing the kernel does when the launcher dies
reaches any of them. Three mechanisms, each covering what the others cannot:

1. The launcher knows every process of the job by pid AND start time (`ProcInfo.start`, field 22
   of /proc/PID/stat, in clock ticks since boot): it walks /proc for torchrun's descendants while
   the job runs, and each rank writes its own record into `JOB/pids/` (`start()`). It signals
   them one by one (and their process groups), so a rank that is stopped, hung or ignoring
   SIGTERM is SIGKILLed after the grace period, and a recycled pid is never signalled: a pid
   whose start time differs is another process (leanagent/launch/local.py, `end_job`).
2. torchrun is started with the parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGTERM)`, set in
   the child between fork and exec by `parent_death_signal()`): when the launching thread dies,
   SIGKILL included, the kernel sends torchrun SIGTERM, and torchrun ends its workers (SIGTERM,
   and SIGKILL 30 s later). That clean-up can outlive the workers, so torchrun runs under a
   watchdog of ours (leanagent/launch/torchrun.py) that SIGKILLs the job and exits within a second
   of the launcher's death.
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

Linux only (/proc, prctl); this module imports nothing heavy, so the launcher can use it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from leanagent.atomic import write_json_atomic

ENV_SUPERVISOR_PID = "LEANAGENT_SUPERVISOR_PID"
ENV_SUPERVISOR_START = "LEANAGENT_SUPERVISOR_START"
ENV_JOB_DIR = "LEANAGENT_JOB_DIR"
SUPERVISION_ENV = (ENV_SUPERVISOR_PID, ENV_SUPERVISOR_START, ENV_JOB_DIR)
PIDS_DIR = "pids"
WATCH_INTERVAL_S = 1.0
EXIT_SUPERVISOR_GONE = 75  # a rank that ended itself because nobody supervises it any more
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    start: int  # clock ticks after boot: with the pid, names one process for the machine's uptime
    state: str  # R, S, D, T (stopped), t (traced), Z (zombie), X (dead), ...

    @property
    def running(self) -> bool:
        """Not a zombie: a zombie has ended and only waits to be reaped."""
        return self.state not in ("Z", "X", "x")


def read_proc(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    rest = data[data.rindex(b")") + 2:].split()
    return ProcInfo(pid=pid, ppid=int(rest[1]), pgid=int(rest[2]), start=int(rest[19]), state=rest[0].decode())


def process_table() -> dict[int, ProcInfo]:
    table: dict[int, ProcInfo] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            info = read_proc(int(entry.name))
            if info is not None:
                table[info.pid] = info
    return table


def start_time(pid: int) -> int | None:
    info = read_proc(pid)
    return None if info is None else info.start


def is_running(pid: int, start: int) -> bool:
    """The very process that had this start time is alive and not a zombie."""
    info = read_proc(pid)
    return info is not None and info.start == start and info.running


def descendants(table: dict[int, ProcInfo], roots: set[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def machine_identity() -> str:
    """This boot of this machine and this pid namespace: a pid means nothing outside them (shared job folders)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/{namespace}"


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


def rank_records(job_dir: Path) -> dict[int, int]:
    """pid -> start time of the ranks that recorded themselves on THIS machine (other nodes' pids are not ours)."""
    here = machine_identity()
    records: dict[int, int] = {}
    folder = pids_dir(job_dir)
    if not folder.is_dir():
        return records
    for path in folder.glob("rank*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("machine") == here and isinstance(data.get("pid"), int) and isinstance(data.get("start"), int):
            records[data["pid"]] = data["start"]
    return records


def signal_verified(pid: int, start: int, sig: int, group: bool = False) -> bool:
    """Send `sig` to the process `pid` only if it is still the one that started at `start`.

    With `group`, also to its process group when it leads one (a rank's DataLoader workers), never to
    the caller's own group. Returns whether anything was signalled.
    """
    info = read_proc(pid)
    if info is None or info.start != start or not info.running:
        return False
    try:
        if group and info.pgid == pid and pid != os.getpgrp():
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
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

    The kernel tracks the creating *thread*: call Popen from the thread that waits for the child.
    If the parent died between fork and prctl, the child signals itself at once. None off Linux.
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
    supervisor: tuple[int, int] | None = None
    try:
        supervisor = (int(os.environ[ENV_SUPERVISOR_PID]), int(os.environ[ENV_SUPERVISOR_START]))
    except (KeyError, ValueError):
        supervisor = None
    parent: tuple[int, int] | None = None
    if "TORCHELASTIC_RUN_ID" in os.environ:
        ppid = os.getppid()
        parent_start = start_time(ppid)
        parent = (ppid, parent_start) if parent_start is not None else None
    if supervisor is None and parent is None:
        return None

    def check() -> str | None:
        if supervisor is not None and not is_running(*supervisor):
            return f"the launcher (pid {supervisor[0]}) is gone"
        if parent is not None and os.getppid() != parent[0]:
            return f"torchrun (pid {parent[0]}) is gone"
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


def end_orphaned_job(job_dir: Path | None, reason: str, parent: tuple[int, int] | None) -> None:
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
            if pid != me:
                signal_verified(pid, start, signal.SIGKILL, group=True)
    if parent is not None and os.getppid() == parent[0]:
        signal_verified(*parent, signal.SIGKILL)
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
