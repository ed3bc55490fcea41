"""Start a rank program under torchrun, stream its output, and always clean up the whole job.

Why torchrun and not Lightning's own launcher: Lightning's default DDP launcher re-runs
`sys.argv` for the other ranks, which inside a Prefect worker would re-run the flow. Under
torchrun Lightning detects the elastic environment and starts nothing itself.

Why a process group of our own: torchrun forwards SIGTERM to its workers, but a SIGKILL to
torchrun alone orphans them, and Prefect's runner signals a single PID. The job therefore runs
in its own session; on interrupt, deadline or a stale heartbeat we SIGTERM the group, wait,
then SIGKILL it.
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
from leanagent.train.heartbeat import heartbeat_dir, stale_ranks

SCRUBBED_ENV = (
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS",
)
RANK_LINE = re.compile(r"^\[rank (\d+)\] ?(.*)$")
FAILED_RANK = re.compile(r"rank\s*:\s*(\d+)")
TAIL_LINES = 30
GRACE_SECONDS = 30.0


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
    """torchrun for `python -m leanagent.train.programs ...`: one process per device, also on CPU."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.devices}"]
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


def end_process_group(proc: subprocess.Popen, grace_s: float = GRACE_SECONDS) -> None:
    """SIGTERM the whole session, give it `grace_s` to write what it can, then SIGKILL what remains."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not _group_alive(pgid):
                return
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def launch(
    cfg: TrainerConfig,
    program_args: Sequence[str],
    job_dir: Path,
    on_line: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
    grace_s: float = GRACE_SECONDS,
    entry: Sequence[str] = PROGRAMS_ENTRY,
) -> LaunchResult:
    """Run one rank program to completion and return its `result.json`.

    `on_line` receives every output line, rank lines as `[rank N] ...` and torchrun's own lines
    as they come. Raises LaunchError with the failing rank's last lines when anything fails.
    """
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    # A retry reuses the job folder: the failed attempt's heartbeats are stale by now and must not count.
    shutil.rmtree(heartbeat_dir(job_dir), ignore_errors=True)
    emit = on_line or (lambda line: print(line, flush=True))
    log_dir = job_dir / "logs" / f"attempt-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = torchrun_command(cfg, program_args, log_dir=log_dir, entry=entry)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_environment(),
                            start_new_session=True, bufsize=0)
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
                    _route(raw.decode("utf-8", "replace").rstrip("\r"), tails, launcher_tail, emit)
            now = time.monotonic()
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
        emit("[launcher] interrupted: ending the job's process group")
        end_process_group(proc, grace_s)
        raise
    finally:
        sel.close()
    if buffer:
        _route(buffer.decode("utf-8", "replace"), tails, launcher_tail, emit)
    if reason is not None:
        emit(f"[launcher] {reason}: ending the job's process group")
        end_process_group(proc, grace_s)
        raise LaunchError(f"{_label(program_args)} job in {job_dir}: {reason}", proc.returncode, None,
                          list(launcher_tail))
    returncode = proc.wait()
    # A clean exit of torchrun still leaves orphans if a rank forked; make sure none survive.
    end_process_group(proc, grace_s=1.0)
    tail_map = {r: list(t) for r, t in tails.items()}
    if returncode != 0:
        raise _failure(program_args, job_dir, returncode, tail_map, list(launcher_tail))
    result_path = job_dir / result_filename(cfg.node_rank)
    if not result_path.is_file():
        raise LaunchError(f"{job_dir}: the job exited 0 but wrote no {result_path.name}", returncode, None,
                          list(launcher_tail))
    return LaunchResult(returncode, read_json(result_path), time.monotonic() - started)


def _route(line: str, tails, launcher_tail, emit) -> None:
    m = RANK_LINE.match(line)
    if m:
        tails[int(m.group(1))].append(m.group(2))
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
