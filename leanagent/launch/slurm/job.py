"""The SLURM launcher's side of one job: submitted with `sbatch --parsable` (or reattached to), then watched.

Supervision, from wherever the flow runs (a login node, a Prefect worker):
- the job's state is polled (`queue.query_state`): PENDING waits (its reason shown as SLURM gives it), RUNNING
  runs, COMPLETED reads `result.json`; FAILED, OUT_OF_MEMORY, BOOT_FAIL, DEADLINE and a cancel fail with the
  job's last lines; TIMEOUT, PREEMPTED and NODE_FAIL, and a job whose ranks stopped to be resumed, are submitted
  again (up to `slurm.max_requeues`) and go on from the job's newest checkpoint;
- before its time limit (`slurm.signal_lead_s`) the job script touches a stop file, which the ranks read at
  step boundaries (`train.callbacks.StopOnRequest`): they agree, save a step checkpoint and exit to be resumed;
- `JOB/slurm/job.json` records every submission: a rerun of a flow whose launcher was SIGKILLed finds the
  job still queued or running and reattaches to it instead of submitting a second one;
- an interrupt, a deadline or a stale heartbeat ends the job: the stop file first (a checkpoint), then
  `scancel` once the grace is over.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from leanagent.ground.atomic import write_atomic, write_json_atomic
from leanagent.ground.config import PipelineConfig
from leanagent.ground.job import NEEDS_RESUME_FILE, PROGRAMS_ENTRY, heartbeat_dir
from leanagent.ground.json_files import MIB, read_json_file
from leanagent.ground.supervision import SUPERVISION_ENV
from leanagent.launch.base import Launcher, RunningJob, child_environment
from leanagent.launch.quiet import quiet_environment
from leanagent.launch.slurm.queue import (
    RECORD,
    RESUMABLE,
    RUNNING,
    SLURM_DIR,
    WAITING,
    JobState,
    SlurmError,
    first_error,
    query_state,
    slurm_command,
)
from leanagent.launch.slurm.script import SCRIPT, STOP_FILE, render_script
from leanagent.launch.slurm.settings import SlurmConfig, slurm_settings

END_WAIT_SECONDS = 30.0  # after scancel: SLURM's KillWait, then the state turns final


class SlurmLauncher(Launcher):
    """Submits a job's script with `sbatch --parsable` (or reattaches to its job) and watches it."""

    def __init__(self, cfg: PipelineConfig, slurm: SlurmConfig | None = None,
                 entry: Sequence[str] = PROGRAMS_ENTRY) -> None:
        self.cfg = cfg
        self.slurm = slurm if slurm is not None else slurm_settings(cfg)
        self.entry = tuple(entry)
        self.devices = self.slurm.gpus_per_node or cfg.trainer.devices

    def start(self, program_args: Sequence[str], job_dir: Path, log_dir: Path, label: str = "job") -> SlurmJob:
        job_dir = Path(job_dir).resolve()
        folder = job_dir / SLURM_DIR
        folder.mkdir(parents=True, exist_ok=True)
        script = render_script(self.cfg, self.slurm, program_args, job_dir, label, self.entry)
        write_atomic(folder / SCRIPT, lambda f: f.write(script))
        job = SlurmJob(self, job_dir)
        record = job.record()
        if record["job_ids"]:
            latest = record["job_ids"][-1]
            state = query_state(latest, folder)
            if state is not None and not state.final:
                job.attach(latest, f"reattached to job {latest} ({state.state}), submitted earlier for this stage")
                return job
        job.submit()
        return job

    def environment(self) -> dict[str, str]:
        """What sbatch hands the job (--export=ALL): ours less the variables that would confuse torchrun or
        Lightning, and less the launcher's own pid (the job is not its child and may run on other machines)."""
        env = child_environment()
        for key in SUPERVISION_ENV:
            env.pop(key, None)
        quiet_environment(env, self.devices)
        return env


class SlurmJob(RunningJob):
    """One stage's SLURM job, across its resubmissions: output, state, resubmission, cancellation."""

    def __init__(self, launcher: SlurmLauncher, job_dir: Path) -> None:
        self.launcher = launcher
        self.slurm = launcher.slurm
        self.job_dir = job_dir
        self.folder = job_dir / SLURM_DIR
        self.job_id: int | None = None
        self._offset = 0
        self._pending: list[str] = []  # launcher lines to show: state changes, resubmissions
        self._state: JobState | None = None
        self._shown: tuple[str, str] | None = None
        self._polled = 0.0
        self._exit: int | None = None
        self._drained = False

    # -- the record ---------------------------------------------------------------------------------
    def record(self) -> dict:
        path = self.folder / RECORD
        if path.is_file():
            data = read_json_file(path, MIB, "SLURM job record")
            data.setdefault("job_ids", [])
            data.setdefault("submitted_at", [])
            data.setdefault("resubmissions", 0)
            return data
        return {"job_ids": [], "submitted_at": [], "resubmissions": 0}

    def _write_record(self, data: dict) -> None:
        write_json_atomic(self.folder / RECORD, data)

    def attach(self, job_id: int, why: str) -> None:
        self.job_id, self._offset, self._exit, self._state, self._drained = job_id, 0, None, None, False
        self._pending.append(f"slurm: {why}")
        self._poll(force=True)

    def submit(self, resubmission: bool = False) -> None:
        """sbatch the script; the job id and time go into job.json before anything else can happen."""
        for stale in (self.folder / STOP_FILE, self.job_dir / NEEDS_RESUME_FILE):
            stale.unlink(missing_ok=True)
        done = subprocess.run(["sbatch", "--parsable", str(self.folder / SCRIPT)], capture_output=True, text=True,
                              env=self.launcher.environment(), timeout=120)
        if done.returncode != 0:
            raise SlurmError(f"sbatch {self.folder / SCRIPT}: {first_error(done)}")
        job_id = int(done.stdout.strip().split(";")[0])
        data = self.record()
        data["job_ids"].append(job_id)
        data["submitted_at"].append(time.time())
        data["resubmissions"] += int(resubmission)
        data["script"] = str(self.folder / SCRIPT)
        self._write_record(data)
        self.attach(job_id, f"submitted job {job_id} ({self.folder / SCRIPT})")

    # -- RunningJob ---------------------------------------------------------------------------------
    def read(self, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + timeout_s
        while True:
            chunk = self._new_output()
            if self._pending:
                chunk = "".join(f"{line}\n" for line in self._pending).encode() + chunk
                self._pending.clear()
            if chunk:
                return chunk
            if self._exit is not None:
                if self._drained:
                    return None
                self._drained = True  # one more look: output written just before the end
                continue
            if time.monotonic() >= deadline:
                return b""
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def _new_output(self) -> bytes:
        if self.job_id is None:
            return b""
        path = self.folder / f"slurm-{self.job_id}.out"
        try:
            with open(path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return b""
        cut = data.rfind(b"\n") + 1  # whole lines only; the rest comes with the next read
        self._offset += cut
        return data[:cut]

    def refresh(self) -> None:
        self._poll()

    def exit_code(self) -> int | None:
        return self._exit

    def wait(self) -> int:
        while self._exit is None:
            time.sleep(self.slurm.poll_s)
            self._poll(force=True)
        return self._exit

    def _poll(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._exit is not None or self.job_id is None or (not force and now - self._polled < self.slurm.poll_s):
            return
        self._polled = now
        state = query_state(self.job_id, self.folder)
        if state is None:
            self._pending.append(f"slurm: job {self.job_id} is unknown to squeue, scontrol and sacct, and left no "
                                 f"exit record: ended without trace")
            self._exit = 1
            return
        previous = self._state
        self._state = state
        if (state.state, state.reason) != self._shown:
            self._shown = (state.state, state.reason)
            if state.state in WAITING:
                where = f" in partition {state.partition}" if state.partition else ""
                why = f" ({state.reason})" if state.reason else ""  # as SLURM gives it; none: left out
                self._pending.append(f"slurm: job {self.job_id} pending{where}{why}")
                # A requeued job waits again: its ranks' old heartbeats would age meanwhile.
                shutil.rmtree(heartbeat_dir(self.job_dir), ignore_errors=True)
            elif state.state in RUNNING and (previous is None or previous.state not in RUNNING):
                self._pending.append(f"slurm: job {self.job_id} running")
        if not state.final:
            return
        stopped = (self.job_dir / NEEDS_RESUME_FILE).is_file()
        if state.state in RESUMABLE or (state.state == "COMPLETED" and stopped):
            why = "its ranks stopped to be resumed" if state.state == "COMPLETED" else f"it ended {state.state}"
            used = self.record()["resubmissions"]
            if used < self.slurm.max_requeues:
                self._pending.append(f"slurm: job {self.job_id}: {why}; submitting it again "
                                     f"({used + 1} of slurm.max_requeues {self.slurm.max_requeues})")
                self.submit(resubmission=True)
                return
            self._pending.append(f"slurm: job {self.job_id}: {why}, and its {used} resubmission(s) "
                                 f"(slurm.max_requeues) are used up")
            self._exit = 1
            return
        if state.state == "COMPLETED":
            self._exit = 0 if state.exit_code in (None, 0) else state.exit_code
            return
        self._pending.append(f"slurm: job {self.job_id} ended {state.state}"
                             + (f" ({state.reason})" if state.reason else "")
                             + (f", exit code {state.exit_code}" if state.exit_code else ""))
        self._exit = state.exit_code or 1

    def end(self, grace_s: float, emit: Callable[[str], None], interrupted: bool = False) -> None:
        """The stop file (the ranks checkpoint and exit at their next step), then scancel after the grace."""
        if self.job_id is None:
            return
        state = query_state(self.job_id, self.folder)
        if state is None or state.final:
            return
        if state.state in RUNNING and grace_s > 1.0:
            emit(f"[launcher] slurm: asking job {self.job_id}'s ranks to checkpoint and stop")
            (self.folder / STOP_FILE).touch()
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                state = query_state(self.job_id, self.folder)
                if state is None or state.final:
                    return
                time.sleep(min(1.0, self.slurm.poll_s))
        emit(f"[launcher] slurm: scancel {self.job_id}")
        slurm_command("scancel", "--full", str(self.job_id), check=False)
        deadline = time.monotonic() + END_WAIT_SECONDS
        while time.monotonic() < deadline:
            state = query_state(self.job_id, self.folder)
            if state is None or state.final:
                return
            time.sleep(0.5)
        emit(f"[launcher] slurm: job {self.job_id} still {state.state if state else '?'} after scancel")
