"""torchrun, unchanged, plus a watchdog: if the launcher is gone, the job ends within a second.

`python -m leanagent.launch.torchrun ARGS` is `python -m torch.distributed.run ARGS` (the same
arguments, rendezvous and elastic agent), started by the launcher with a parent-death SIGTERM.
That signal starts torchrun's own clean-up (SIGTERM to the workers, SIGKILL 30 s later), which
ends ranks that cannot watch for themselves (still importing, say). But that clean-up can outlive
its workers: a second signal during it, or a log-tailing thread that never finishes, leaves the
agent waiting at exit forever (seen in CI: torchrun alone, sleeping, after its ranks had gone).
Nobody collects the job's result once the launcher is gone, so this daemon thread does not wait:
it SIGKILLs every descendant of torchrun (and their process groups) and the ranks recorded in the
job folder, then exits. A rerun resumes from the job's last checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

from leanagent.ground.exit_fast import freeze_for_exit
from leanagent.ground.supervision import (
    ENV_JOB_DIR,
    ENV_SUPERVISOR_PID,
    ENV_SUPERVISOR_START,
    EXIT_SUPERVISOR_GONE,
    WATCH_INTERVAL_S,
    descendants,
    find_process,
    rank_records,
    running,
    signal_verified,
)


def end_the_job() -> None:
    """SIGKILL this agent's workers and their groups (by pid and start time), then exit at once."""
    targets = {p.pid: p for p in descendants(psutil.Process())}
    if ENV_JOB_DIR in os.environ:
        for pid, start in rank_records(Path(os.environ[ENV_JOB_DIR])).items():
            rank = targets.get(pid) or find_process(pid, start)
            if rank is not None:
                targets[pid] = rank
    for proc in targets.values():
        signal_verified(proc, signal.SIGKILL, group=True)
    os._exit(EXIT_SUPERVISOR_GONE)


def watch_launcher(interval_s: float = WATCH_INTERVAL_S) -> threading.Thread | None:
    """End the job when the launcher named by LEANAGENT_SUPERVISOR_PID/_START is gone; None without one."""
    try:
        pid = int(os.environ[ENV_SUPERVISOR_PID])
        launcher = find_process(pid, float(os.environ[ENV_SUPERVISOR_START]))
    except (KeyError, ValueError):
        return None

    def loop() -> None:
        while launcher is not None and running(launcher):
            time.sleep(interval_s)
        try:
            print(f"[supervision] torchrun: the launcher (pid {pid}) is gone; ending the job's processes",
                  file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass  # nobody reads our output any more
        end_the_job()

    thread = threading.Thread(target=loop, name="leanagent-launcher-watch", daemon=True)
    thread.start()
    return thread


def main() -> None:
    watch_launcher()
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main()
    finally:
        freeze_for_exit()


if __name__ == "__main__":
    main()
