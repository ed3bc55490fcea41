"""Start a rank program under torchrun, stream its output, and always clean up the whole job.

Why torchrun and not Lightning's own launcher: Lightning's default DDP launcher re-runs
`sys.argv` for the other ranks, which inside a Prefect worker would re-run the flow. Under
torchrun Lightning detects the elastic environment and starts nothing itself.

Why we end every process ourselves: torchrun forwards SIGTERM to its workers, but starts each
in a session of its own, so no signal to torchrun's group reaches them, and a SIGKILL to torchrun
alone orphans them; Prefect's runner signals a single PID. On interrupt, deadline or a stale
heartbeat we SIGTERM every rank we know (`JobProcesses`: torchrun's descendants seen in /proc, and
the pid records the ranks write), wake stopped ones, wait `grace_s` (less on an interrupt, or once
a rank has gone), then SIGKILL whatever is left, torchrun included, each pid checked against its
start time. `launch()` returns only when none is
left. If the launcher itself dies, torchrun's parent-death signal and each rank's watcher end the
job (`leanagent/train/supervision.py`).
"""

from __future__ import annotations

import collections
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from leanagent.atomic import read_json
from leanagent.config import TrainerConfig
from leanagent.train.heartbeat import heartbeat_dir, read_progress, stale_ranks
from leanagent.train.progress_view import job_label, progress_view
from leanagent.train.quiet import NoiseFilter, quiet_environment, verbose
from leanagent.train.supervision import (
    SUPERVISION_ENV,
    HoldSignals,
    descendants,
    is_running,
    parent_death_signal,
    pids_dir,
    process_table,
    rank_records,
    read_proc,
    signal_verified,
    supervisor_environment,
)

SCRUBBED_ENV = (
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS", *SUPERVISION_ENV,
)
RANK_LINE = re.compile(r"^\[rank (\d+)\] ?(.*)$")
FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)")
TAIL_LINES = 30
GRACE_SECONDS = 30.0
KILL_WAIT_SECONDS = 15.0  # after SIGKILL: only a process in uninterruptible sleep (D) takes longer
REFRESH_SECONDS = 1.0  # how often the launcher looks for new processes of the job
# Once a rank has ended, its peers cannot complete any collective (with the seed's one-year DDP timeout they
# would wait for a year): after SIGTERM, the survivors get this long for what they can do alone, not all of grace_s.
PEER_GONE_GRACE_SECONDS = 5.0
# Ending a job because the launcher was interrupted: Prefect's runner SIGKILLs a cancelled flow-run process 30 s
# after its SIGTERM, and the job must be over (and the stage recorded) before that. Under Lightning 2.6 the grace
# buys little anyway: its SIGTERM handler broadcasts from inside the handler, which can deadlock the ranks.
INTERRUPT_GRACE_SECONDS = 10.0


def result_filename(node_rank: int = 0) -> str:
    """Global rank 0 writes result.json; local rank 0 of every other node its own file (job folders may be shared)."""
    return "result.json" if node_rank == 0 else f"result.node{node_rank}.json"


class LaunchError(RuntimeError):
    """A rank program failed, or the job was ended by a deadline, a stale heartbeat or an interrupt."""

    def __init__(self, message: str, returncode: int | None, failing_rank: int | None, tail: list[str]) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.failing_rank = failing_rank
        self.tail = tail


@dataclass
class LaunchResult:
    returncode: int
    result: dict
    wall_seconds: float


PROGRAMS_ENTRY = ("-m", "leanagent.train.programs")


def torchrun_command(cfg: TrainerConfig, program_args: Sequence[str], log_dir: Path | None = None,
                     entry: Sequence[str] = PROGRAMS_ENTRY) -> list[str]:
    """torchrun (with a launcher watchdog, leanagent/train/torchrun.py) for `python -m leanagent.train.programs
    ...`: one process per device, also on CPU."""
    cmd = [sys.executable, "-m", "leanagent.train.torchrun", f"--nproc-per-node={cfg.devices}"]
    if cfg.num_nodes > 1:
        cmd += [f"--nnodes={cfg.num_nodes}", f"--node-rank={cfg.node_rank}", "--rdzv-backend=static",
                f"--rdzv-endpoint={cfg.rdzv_endpoint}"]
    else:
        cmd += ["--standalone", "--nnodes=1"]
    if log_dir is not None:
        cmd += [f"--log-dir={log_dir}", "--tee=3"]
    cmd += [*entry, *program_args]
    return cmd


def child_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for key in SCRUBBED_ENV:
        env.pop(key, None)
    # torchrun prefixes every worker line with its global rank, so the supervisor can attribute it.
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank ${rank}] "
    env["PYTHONUNBUFFERED"] = "1"
    return env


class JobProcesses:
    """Every process of one job that this machine runs, each by pid and start time.

    torchrun (our child) is known from the start; its descendants (the ranks, in sessions of their
    own, and their DataLoader workers) are found by walking /proc, every `REFRESH_SECONDS` while the
    job runs, and once more before anything is signalled; the ranks' own records in `JOB/pids/`
    add any that were orphaned before a walk saw them. A pid whose start time changed is another
    process and is never signalled.
    """

    def __init__(self, proc: subprocess.Popen, job_dir: Path) -> None:
        self.proc = proc
        self.job_dir = job_dir
        self.known: dict[int, int] = {}  # pid -> start time
        self.ranks: dict[int, int] = {}  # the rank processes among them (torchrun's children, pid records)
        info = read_proc(proc.pid)  # our unreaped child: this pid is torchrun's until we wait for it
        self.torchrun = (proc.pid, info.start) if info is not None else None
        if self.torchrun is not None:
            self.known[proc.pid] = info.start
        self._refreshed = 0.0

    def refresh(self, force: bool = True) -> dict[int, int]:
        """Look for new processes of the job; return those still running (pid -> start time)."""
        now = time.monotonic()
        if not force and now - self._refreshed < REFRESH_SECONDS:
            return self.known
        self._refreshed = now
        table = process_table()
        running = {pid: start for pid, start in self.known.items()
                   if pid in table and table[pid].start == start and table[pid].running}
        for pid in descendants(table, set(running)):
            running.setdefault(pid, table[pid].start)
            if self.torchrun is not None and table[pid].ppid == self.torchrun[0] and self.torchrun[0] in running:
                self.ranks.setdefault(pid, table[pid].start)
        for pid, start in rank_records(self.job_dir).items():
            self.ranks.setdefault(pid, start)
            if pid in table and table[pid].start == start and table[pid].running:
                running.setdefault(pid, start)
        # Forget the dead: their pids may be reused by anyone.
        self.known = {pid: start for pid, start in running.items() if table[pid].running}
        return self.known

    def alive(self) -> dict[int, int]:
        return self.refresh(force=True)

    def ranks_ended(self) -> bool:
        """Some rank has ended while another still runs."""
        alive = [is_running(pid, start) for pid, start in self.ranks.items()]
        return any(alive) and not all(alive)

    def signal(self, sig: int, torchrun: bool = True) -> int:
        """`sig` to every known process and to the process group each leads; the number signalled.

        `torchrun=False` spares torchrun itself: a second SIGTERM (its parent-death signal, if the launcher
        dies during the grace) can break its own clean-up and leave it waiting forever on its log threads.
        Ended ranks make it end its job and exit by itself.
        """
        spare = self.torchrun[0] if self.torchrun is not None and not torchrun else None
        return sum(signal_verified(pid, start, sig, group=True) for pid, start in list(self.known.items())
                   if pid != spare)


def end_job(jobs: JobProcesses, grace_s: float = GRACE_SECONDS, emit: Callable[[str], None] | None = None,
            interrupted: bool = False) -> None:
    """SIGTERM every process of the job, give them `grace_s` to write what they can, SIGKILL what remains.

    Once one rank has ended, the others get at most PEER_GONE_GRACE_SECONDS more: they cannot complete
    a collective without it. Returns when none is left (or, for a process in uninterruptible sleep, after
    KILL_WAIT_SECONDS more).
    A SIGINT/SIGTERM/SIGHUP meanwhile (in the main thread) skips the rest of the grace period; unless the
    job is being ended because of an interrupt already, that signal is delivered again afterwards.
    """
    hurry = HoldSignals(redeliver=not interrupted)
    with hurry:
        alive = jobs.alive()
        if not alive:
            _reap(jobs.proc)
            return
        if emit is not None and grace_s > 1.0:
            emit(f"[launcher] SIGTERM to the ranks ({len(alive)} process(es) in the job: {sorted(alive)})")
        jobs.signal(signal.SIGTERM, torchrun=False)
        jobs.signal(signal.SIGCONT)  # a stopped rank cannot act on SIGTERM until it runs again
        if _wait_until_gone(jobs, grace_s, hurry):
            return
        alive = jobs.alive()
        if emit is not None:
            emit(f"[launcher] SIGKILL to {len(alive)} process(es) still running: {sorted(alive)}")
        jobs.signal(signal.SIGKILL)
        if _wait_until_gone(jobs, KILL_WAIT_SECONDS, None):
            return
        if emit is not None:
            emit(f"[launcher] still running after SIGKILL (uninterruptible sleep?): {sorted(jobs.alive())}")


def _wait_until_gone(jobs: JobProcesses, wait_s: float, hurry: HoldSignals | None) -> bool:
    deadline = time.monotonic() + wait_s
    peer_gone = hurry is None  # only the grace period (with `hurry`) is cut short
    while True:
        _reap(jobs.proc, block=False)
        if not jobs.alive():
            _reap(jobs.proc)
            return True
        if not peer_gone and jobs.ranks_ended():
            peer_gone = True
            deadline = min(deadline, time.monotonic() + PEER_GONE_GRACE_SECONDS)
        if time.monotonic() >= deadline or (hurry is not None and hurry.signalled is not None):
            return False
        time.sleep(0.1)


def _reap(proc: subprocess.Popen, block: bool = True) -> None:
    try:
        proc.wait(timeout=5.0) if block else proc.poll()
    except subprocess.TimeoutExpired:
        pass


def launch(
    cfg: TrainerConfig,
    program_args: Sequence[str],
    job_dir: Path,
    on_line: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
    grace_s: float = GRACE_SECONDS,
    entry: Sequence[str] = PROGRAMS_ENTRY,
    progress_interval_s: float | None = None,
) -> LaunchResult:
    """Run one rank program to completion and return its `result.json`.

    `on_line` receives every output line, rank lines as `[rank N] ...` and torchrun's own lines
    as they come, less known third-party noise unless LEANAGENT_VERBOSE is set (`quiet.py`; the
    rank log files under JOB/logs/ keep everything), plus `[progress] ...` lines when stderr is
    not a terminal (a bar when it is; `progress_view.py`). Raises LaunchError with the failing
    rank's last lines when anything fails.
    """
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    # A retry reuses the job folder: the failed attempt's heartbeats are stale by now and must not count.
    shutil.rmtree(heartbeat_dir(job_dir), ignore_errors=True)
    shutil.rmtree(pids_dir(job_dir), ignore_errors=True)
    sink = on_line or (lambda line: print(line, flush=True))
    view = progress_view(job_label(program_args), sink, progress_interval_s)

    def emit(line: str) -> None:
        if view is None:
            sink(line)
            return
        with view.writing():
            sink(line)

    noise = NoiseFilter(enabled=not verbose())
    log_dir = job_dir / "logs" / f"attempt-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = torchrun_command(cfg, program_args, log_dir=log_dir, entry=entry)
    started = time.monotonic()
    env = {**child_environment(), **supervisor_environment(job_dir)}
    quiet_environment(env, cfg.devices)
    # Own session: signals meant for the launcher (a terminal's Ctrl-C) do not hit the ranks mid-step; the
    # launcher ends the job itself. PDEATHSIG: if this thread dies (SIGKILL, OOM), the kernel SIGTERMs torchrun.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=parent_death_signal(signal.SIGTERM), bufsize=0)
    jobs = JobProcesses(proc, job_dir)
    tails: dict[int, collections.deque[str]] = collections.defaultdict(lambda: collections.deque(maxlen=TAIL_LINES))
    launcher_tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    reason: str | None = None
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    sel.register(proc.stdout, selectors.EVENT_READ)
    buffer = b""
    exited_at: float | None = None
    try:
        while sel.get_map():
            for _key, _ in sel.select(timeout=0.5):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    sel.unregister(proc.stdout)
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    _route(raw.decode("utf-8", "replace").rstrip("\r"), tails, launcher_tail, emit, noise)
            if view is not None:
                progress = read_progress(job_dir)
                if progress is not None:
                    view.update(progress)
            now = time.monotonic()
            jobs.refresh(force=False)
            if proc.poll() is not None:
                # Stop reading soon after torchrun exits, even if an orphan still holds the pipe open.
                exited_at = exited_at or now
                if now - exited_at > 5.0:
                    break
            if timeout_s is not None and now - started > timeout_s:
                reason = f"deadline of {timeout_s:.0f} s reached"
                break
            if heartbeat_timeout_s is not None:
                stale = stale_ranks(job_dir, heartbeat_timeout_s)
                if stale:
                    reason = f"no heartbeat for {heartbeat_timeout_s:.0f} s from {', '.join(stale)}"
                    break
    except BaseException:
        emit("[launcher] interrupted: ending every process of the job")
        end_job(jobs, min(grace_s, INTERRUPT_GRACE_SECONDS), emit, interrupted=True)
        raise
    finally:
        sel.close()
        if view is not None:
            progress = read_progress(job_dir)  # the last snapshot, written as training ended
            if progress is not None:
                view.update(progress)
            view.close()
    if buffer:
        _route(buffer.decode("utf-8", "replace"), tails, launcher_tail, emit, noise)
    if reason is not None:
        emit(f"[launcher] {reason}: ending every process of the job")
        end_job(jobs, grace_s, emit)
        raise LaunchError(f"{_label(program_args)} job in {job_dir}: {reason}", proc.returncode, None,
                          list(launcher_tail))
    returncode = proc.wait()
    # torchrun has exited: a rank it could not end (stopped, hung) or a forked child may still run.
    end_job(jobs, grace_s=1.0, emit=emit)
    tail_map = {r: list(t) for r, t in tails.items()}
    if returncode != 0:
        raise _failure(program_args, job_dir, returncode, tail_map, list(launcher_tail))
    result_path = job_dir / result_filename(cfg.node_rank)
    if not result_path.is_file():
        raise LaunchError(f"{job_dir}: the job exited 0 but wrote no {result_path.name}", returncode, None,
                          list(launcher_tail))
    return LaunchResult(returncode, read_json(result_path), time.monotonic() - started)


def _route(line: str, tails, launcher_tail, emit, noise: NoiseFilter | None = None) -> None:
    m = RANK_LINE.match(line)
    if m:
        tails[int(m.group(1))].append(m.group(2))
        if noise is None or noise.keep(int(m.group(1)), m.group(2)):
            emit(line)
    else:
        launcher_tail.append(line)
        emit(f"[launcher] {line}" if line else line)


def _failure(program_args, job_dir, returncode, tails: dict[int, list[str]], launcher_tail: list[str]) -> LaunchError:
    rank = _failing_rank(tails, launcher_tail)
    lines = tails.get(rank, []) if rank is not None else launcher_tail
    where = f"rank {rank}" if rank is not None else "torchrun"
    body = "\n".join(f"  {line}" for line in lines[-TAIL_LINES:])
    message = f"{_label(program_args)} job in {job_dir} failed (exit {returncode}); last lines of {where}:\n{body}"
    return LaunchError(message, returncode, rank, lines)


def _label(program_args: Sequence[str]) -> str:
    return program_args[0] if program_args else "torchrun"


def _failing_rank(tails: dict[int, list[str]], launcher_tail: list[str]) -> int | None:
    """torchrun's summary names the first failed rank; otherwise the rank that printed a traceback."""
    summary = "\n".join(launcher_tail)
    if "Root Cause" in summary:
        m = FAILED_RANK.search(summary[summary.index("Root Cause"):])
        if m:
            return int(m.group(1))
    for rank in sorted(tails):
        if any(line.startswith("Traceback") for line in tails[rank]):
            return rank
    return min(tails) if tails else None
