"""The local launcher: torchrun on this machine (or one node of a static multi-node job), in its own session.

Why torchrun and not Lightning's own launcher: Lightning's default DDP launcher re-runs `sys.argv` for
the other ranks, which inside a Prefect worker would re-run the flow. Under torchrun Lightning detects
the elastic environment and starts nothing itself.

Why we end every process ourselves: torchrun forwards SIGTERM to its workers, but starts each in a
session of its own, so no signal to torchrun's group reaches them, and a SIGKILL to torchrun alone
orphans them; Prefect's runner signals a single PID. On interrupt, deadline or a stale heartbeat we
SIGTERM every rank we know (`JobProcesses`: torchrun's descendants as psutil sees them, and the pid
records the ranks write), wake stopped ones, wait the grace (less on an interrupt, or once a rank has
gone), then SIGKILL whatever is left, torchrun included, each pid checked against its start time. If the
launcher itself dies, torchrun's watchdog (and on Linux its parent-death signal) and each rank's watcher
end the job (`leanagent/ground/supervision.py`).

Runs wherever torchrun and psutil do (Linux, macOS): nothing here is Linux-only but the parent-death
signal, which `parent_death_signal` leaves out elsewhere.

`launcher: local` (the default) takes no section of its own: its settings are `trainer.*` (devices, and for a
static multi-node job num_nodes, node_rank, rdzv_endpoint). Its checks: a multi-node job names node 0's
`host:port`, and `accelerator: gpu` finds `trainer.devices` GPUs on this machine. Nothing of it is queued, so
`leanagent status` and `cancel` have nothing to say of it: a local job lives as long as whoever launched it.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from leanagent.ground.config import PipelineConfig, TrainerConfig
from leanagent.ground.job import PROGRAMS_ENTRY
from leanagent.ground.supervision import (
    HoldSignals,
    children,
    descendants,
    find_process,
    parent_death_signal,
    rank_records,
    running,
    signal_verified,
    supervisor_environment,
)
from leanagent.launch.base import GRACE_SECONDS, Launcher, LauncherPlugin, RunningJob, child_environment
from leanagent.launch.quiet import quiet_environment

KILL_WAIT_SECONDS = 15.0  # after SIGKILL: only a process in uninterruptible sleep (D) takes longer
REFRESH_SECONDS = 1.0  # how often the launcher looks for new processes of the job
# Once a rank has ended, its peers cannot complete any collective (with the seed's one-year DDP timeout they
# would wait for a year): after SIGTERM, the survivors get this long for what they can do alone, not all of grace_s.
PEER_GONE_GRACE_SECONDS = 5.0


class LocalPlugin(LauncherPlugin):
    """`launcher: local`: torchrun on this machine."""

    name = "local"

    def launcher(self, cfg: PipelineConfig) -> LocalLauncher:
        return LocalLauncher(cfg.trainer)

    def check_config(self, cfg: PipelineConfig) -> list[str]:
        if cfg.trainer.num_nodes > 1 and not cfg.trainer.rdzv_endpoint:
            return [f"trainer.rdzv_endpoint (host:port of node 0) is required when trainer.num_nodes > 1 with "
                    f"launcher: {self.name} (a launcher with a cluster of its own may find the first node itself)"]
        return []

    def preflight(self, cfg: PipelineConfig, visible_gpus: Callable[[], int]) -> list[str]:
        return check_accelerator(cfg.trainer, visible_gpus) + check_rendezvous(cfg.trainer)


PLUGIN = LocalPlugin()


def check_accelerator(trainer: TrainerConfig, visible_gpus: Callable[[], int]) -> list[str]:
    """`accelerator: gpu` on this machine: at least `trainer.devices` GPUs visible to torch."""
    if trainer.accelerator not in ("gpu", "cuda"):
        return []
    device_count = visible_gpus()
    if device_count >= trainer.devices:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    fix = (f"lower trainer.devices to {device_count}" if device_count else
           "set trainer.accelerator: cpu, or run where the GPUs are visible")
    return [f"trainer.accelerator: {trainer.accelerator} asks for trainer.devices: {trainer.devices} GPU(s), but "
            f"torch sees {device_count} on this machine{where}; {fix}"]


def check_rendezvous(trainer: TrainerConfig) -> list[str]:
    """A static multi-node job's `trainer.rdzv_endpoint` is host:port."""
    if trainer.num_nodes <= 1:
        return []
    endpoint = (trainer.rdzv_endpoint or "").strip()
    problem = (f"trainer.rdzv_endpoint {endpoint!r} is not host:port (num_nodes: {trainer.num_nodes}); give node 0's "
               f"address and a free port, e.g. host0:29500")
    try:
        parts = urlsplit("//" + endpoint)
        host, port = parts.hostname, parts.port
    except ValueError:
        return [problem]
    if not host or port is None or not 0 < port < 65536 or parts.path or parts.query or parts.fragment \
            or parts.username is not None:
        return [problem]
    return []


def torchrun_command(cfg: TrainerConfig, program_args: Sequence[str], log_dir: Path | None = None,
                     entry: Sequence[str] = PROGRAMS_ENTRY) -> list[str]:
    """torchrun (with a launcher watchdog, leanagent/launch/torchrun.py) for `python -m leanagent.train.programs
    ...`: one process per device, also on CPU."""
    cmd = [sys.executable, "-m", "leanagent.launch.torchrun", f"--nproc-per-node={cfg.devices}"]
    if cfg.num_nodes > 1:
        cmd += [f"--nnodes={cfg.num_nodes}", f"--node-rank={cfg.node_rank}", "--rdzv-backend=static",
                f"--rdzv-endpoint={cfg.rdzv_endpoint}"]
    else:
        cmd += ["--standalone", "--nnodes=1"]
    if log_dir is not None:
        cmd += [f"--log-dir={log_dir}", "--tee=3"]
    cmd += [*entry, *program_args]
    return cmd


class JobProcesses:
    """Every process of one job that this machine runs, each held as a `psutil.Process` (pid and start time).

    torchrun (our child) is known from the start; its descendants (the ranks, in sessions of their
    own, and their DataLoader workers) are found with `Process.children(recursive=True)`, every
    `REFRESH_SECONDS` while the job runs, and once more before anything is signalled; the ranks' own
    records in `JOB/pids/` add any that were orphaned before a look saw them. A pid whose start time
    changed is another process and is never signalled.
    """

    def __init__(self, proc: subprocess.Popen, job_dir: Path) -> None:
        self.proc = proc
        self.job_dir = job_dir
        self.known: dict[int, psutil.Process] = {}
        # The rank processes among them (torchrun's children, pid records); None: a recorded rank found ended.
        self.ranks: dict[int, psutil.Process | None] = {}
        self.torchrun = find_process(proc.pid)  # our unreaped child: this pid is torchrun's until we wait for it
        if self.torchrun is not None:
            self.known[proc.pid] = self.torchrun
        self._refreshed = 0.0

    def refresh(self, force: bool = True) -> dict[int, psutil.Process]:
        """Look for new processes of the job; return those still running (pid -> process)."""
        now = time.monotonic()
        if not force and now - self._refreshed < REFRESH_SECONDS:
            return self.known
        self._refreshed = now
        alive = {pid: p for pid, p in self.known.items() if running(p)}
        if self.torchrun is not None and self.torchrun.pid in alive:
            for rank in children(self.torchrun):
                self.ranks.setdefault(rank.pid, rank)
        for root in list(alive.values()):
            for p in descendants(root):
                alive.setdefault(p.pid, p)
        for pid, start in rank_records(self.job_dir).items():
            if pid not in self.ranks:
                self.ranks[pid] = find_process(pid, start)
            rank = self.ranks[pid]
            if rank is not None and running(rank):
                alive.setdefault(pid, rank)
        # Forget the dead: their pids may be reused by anyone.
        self.known = {pid: p for pid, p in alive.items() if running(p)}
        return self.known

    def alive(self) -> dict[int, psutil.Process]:
        return self.refresh(force=True)

    def ranks_ended(self) -> bool:
        """Some rank has ended while another still runs."""
        alive = [rank is not None and running(rank) for rank in self.ranks.values()]
        return any(alive) and not all(alive)

    def signal(self, sig: int, torchrun: bool = True) -> int:
        """`sig` to every known process and to the process group each leads; the number signalled.

        `torchrun=False` spares torchrun itself: a second SIGTERM (its parent-death signal, if the launcher
        dies during the grace) can break its own clean-up and leave it waiting forever on its log threads.
        Ended ranks make it end its job and exit by itself.
        """
        spare = self.torchrun.pid if self.torchrun is not None and not torchrun else None
        return sum(signal_verified(p, sig, group=True) for pid, p in list(self.known.items()) if pid != spare)


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


class LocalJob(RunningJob):
    """torchrun and its ranks on this machine, read through one pipe."""

    def __init__(self, proc: subprocess.Popen, job_dir: Path) -> None:
        self.proc = proc
        self.processes = JobProcesses(proc, job_dir)
        self._selector = selectors.DefaultSelector()
        assert proc.stdout is not None
        self._selector.register(proc.stdout, selectors.EVENT_READ)
        self._open = True

    def read(self, timeout_s: float) -> bytes | None:
        if not self._open:
            return None
        out = b""
        for _key, _ in self._selector.select(timeout=timeout_s):
            chunk = os.read(self.proc.stdout.fileno(), 65536)  # type: ignore[union-attr]
            if not chunk:
                self._selector.unregister(self.proc.stdout)
                self._selector.close()
                self._open = False
                return out or None
            out += chunk
        return out

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def refresh(self) -> None:
        self.processes.refresh(force=False)

    def wait(self) -> int:
        return self.proc.wait()

    def end(self, grace_s: float, emit: Callable[[str], None], interrupted: bool = False) -> None:
        end_job(self.processes, grace_s, emit, interrupted=interrupted)
        if self._open:
            self._selector.close()
            self._open = False


class LocalLauncher(Launcher):
    """torchrun here: `--standalone`, or one node of `trainer.num_nodes` with torchrun's static rendezvous.

    `entry` replaces `-m leanagent.train.programs` (tests run probe scripts under the same launcher).
    """

    def __init__(self, cfg: TrainerConfig, entry: Sequence[str] = PROGRAMS_ENTRY) -> None:
        self.cfg = cfg
        self.entry = tuple(entry)
        self.node_rank = cfg.node_rank
        self.devices = cfg.devices

    def start(self, program_args: Sequence[str], job_dir: Path, log_dir: Path, label: str = "") -> LocalJob:
        cmd = torchrun_command(self.cfg, program_args, log_dir=log_dir, entry=self.entry)
        env = {**child_environment(), **supervisor_environment(job_dir)}
        quiet_environment(env, self.cfg.devices)
        # Own session: signals meant for the launcher (a terminal's Ctrl-C) do not hit the ranks mid-step; the
        # launcher ends the job itself. PDEATHSIG: if this thread dies (SIGKILL, OOM), the kernel SIGTERMs torchrun.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=parent_death_signal(signal.SIGTERM), bufsize=0)
        return LocalJob(proc, job_dir)
