"""The SLURM launcher (`launcher: slurm`): each job is one SLURM job, submitted and watched with SLURM's own tools.

The job script, `JOB/slurm/job.sbatch`, is written for a person to read and resubmit by hand. It runs one
torchrun agent per node through `srun`, with torchrun's c10d rendezvous at the first node of the allocation
on a port derived from the job id; Lightning finds TorchElastic's variables before SLURM's, so the rank
programs run exactly as under the local launcher. Its output goes to `JOB/slurm/slurm-ID.out` with
`--open-mode=append`, so a requeue keeps what came before.

Supervision, from wherever the flow runs (a login node, a Prefect worker):
- the job's state is polled (`squeue`, then `scontrol show job` once squeue has let go of it, then `sacct` where
  the cluster keeps accounting, then the exit record the job script writes itself): PENDING waits (its reason
  is shown), RUNNING runs, COMPLETED reads `result.json`; FAILED, OUT_OF_MEMORY, BOOT_FAIL, DEADLINE and a
  cancel fail with the job's last lines; TIMEOUT, PREEMPTED and NODE_FAIL, and a job whose ranks stopped to be
  resumed, are submitted again (up to `slurm.max_requeues`) and go on from the job's newest checkpoint;
- before its time limit (`slurm.signal_lead_s`, `--signal=B:USR2@...`) the job script touches a stop file,
  which the ranks read at step boundaries (`train.callbacks.StopOnRequest`): they agree, save a step
  checkpoint and exit to be resumed. torchrun never sees USR2 (older torchrun dies of it);
- `JOB/slurm/job.json` records every submission: a rerun of a flow whose launcher was SIGKILLed finds the
  job still queued or running and reattaches to it instead of submitting a second one;
- an interrupt, a deadline or a stale heartbeat ends the job: the stop file first (a checkpoint), then
  `scancel` once the grace is over.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from leanagent.atomic import read_json, write_atomic, write_json_atomic
from leanagent.config import PipelineConfig, SlurmConfig
from leanagent.job import NEEDS_RESUME_FILE, PROGRAMS_MODULE, STOP_FILE_ENV, heartbeat_dir
from leanagent.launch.base import Launcher, RunningJob, child_environment
from leanagent.launch.quiet import quiet_environment
from leanagent.supervision import SUPERVISION_ENV

SLURM_DIR = "slurm"
SCRIPT = "job.sbatch"
RECORD = "job.json"
STOP_FILE = "stop"
PROGRAMS_ENTRY = ("-m", PROGRAMS_MODULE)
WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED",
           "SPECIAL_EXIT", "STAGE_OUT", "SIGNALING"}
RUNNING = {"RUNNING", "COMPLETING"}
FAILED = {"FAILED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "CANCELLED", "REVOKED"}
RESUMABLE = {"TIMEOUT", "PREEMPTED", "NODE_FAIL"}
END_WAIT_SECONDS = 30.0  # after scancel: SLURM's KillWait, then the state turns final
SQUEUE_FORMAT = "%T|%r|%P"


def launcher(cfg: PipelineConfig) -> SlurmLauncher:
    """`launcher: slurm`."""
    return SlurmLauncher(cfg)


class SlurmError(RuntimeError):
    """A SLURM command failed; the message is its own first line of error."""


def slurm_command(*args: str, check: bool = True, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """One SLURM client command (sbatch, squeue, scontrol, scancel, sacct, sinfo), its output as text."""
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]}: not found on PATH (is this a SLURM login node?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(args[:2])}: no answer within {timeout_s:.0f} s") from None
    if check and done.returncode != 0:
        reason = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
        raise SlurmError(f"{' '.join(args[:2])}: {reason}")
    return done


# ---- the job script --------------------------------------------------------------------------------

def sbatch_options(cfg: PipelineConfig, job_dir: Path, name: str) -> list[str]:
    slurm, trainer = cfg.slurm, cfg.trainer
    out = job_dir / SLURM_DIR
    options = [f"--job-name={name}", f"--nodes={slurm.nodes or trainer.num_nodes}", "--ntasks-per-node=1",
               f"--output={out}/slurm-%j.out", "--open-mode=append", "--requeue",
               f"--signal=B:USR2@{slurm.signal_lead_s}"]
    if trainer.accelerator in ("gpu", "cuda"):
        options.append(f"--gpus-per-node={slurm.gpus_per_node or trainer.devices}")
    for flag, value in (("partition", slurm.partition), ("account", slurm.account), ("qos", slurm.qos),
                        ("time", slurm.time), ("cpus-per-task", slurm.cpus_per_task), ("mem", slurm.mem),
                        ("constraint", slurm.constraint)):
        if value is not None:
            options.append(f"--{flag}={value}")
    return options + list(slurm.extra_args)


def render_script(cfg: PipelineConfig, program_args: Sequence[str], job_dir: Path,
                  entry: Sequence[str] = PROGRAMS_ENTRY) -> str:
    """The batch script: one torchrun agent per node under `srun`, c10d rendezvous at the first node."""
    job_dir = Path(job_dir).resolve()
    out = job_dir / SLURM_DIR
    name = f"leanagent-{'-'.join(Path(a).name for a in _datasets(program_args)) or 'job'}-{program_args[0]}" \
        if program_args else "leanagent-job"
    lines = ["#!/bin/bash", f"# Written by leanagent for {job_dir}; resubmit by hand with: sbatch {out / SCRIPT}"]
    lines += [f"#SBATCH {option}" for option in sbatch_options(cfg, job_dir, name)]
    program = " ".join(shlex.quote(a) for a in (*entry, *program_args))
    devices = cfg.slurm.gpus_per_node or cfg.trainer.devices
    lines += [
        "set -u",
        *cfg.slurm.setup,
        f"cd {shlex.quote(str(Path.cwd()))}",
        f"export {STOP_FILE_ENV}={shlex.quote(str(out / STOP_FILE))}",
        # Time limit or preemption ahead (--signal=B:USR2@lead): the ranks checkpoint and stop at their next step.
        f'trap \'echo "slurm: job $SLURM_JOB_ID has {cfg.slurm.signal_lead_s} s left: asking the ranks to '
        f'checkpoint and stop"; touch "${STOP_FILE_ENV}"\' USR2',
        # The run_dir must be writable where the ranks run, not only where the flow runs.
        f'srun --ntasks-per-node=1 bash -c {shlex.quote(f"touch {out}/.writable-$(hostname)-$SLURM_NODEID")} '
        f'|| {{ echo "error: {job_dir} is not writable from the compute nodes ($SLURM_JOB_NODELIST); put run_dir '
        f'on a filesystem they share"; exit 2; }}',
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "addr=$(scontrol show node \"$head\" | grep -oP 'NodeAddr=\\K\\S+')",
        "port=$((20000 + SLURM_JOB_ID % 20000))",
        f"srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} -m leanagent.launch.torchrun "
        f"--nnodes=\"$SLURM_NNODES\" --nproc-per-node={devices} --rdzv-backend=c10d "
        f"--rdzv-endpoint=\"$addr:$port\" --rdzv-id=\"$SLURM_JOB_ID\" "
        f"--log-dir={shlex.quote(str(job_dir / 'logs'))}/slurm-\"$SLURM_JOB_ID\"-\"${{SLURM_RESTART_COUNT:-0}}\" "
        f"--tee=3 "
        f"{program} &",
        "child=$!",
        # `wait` returns early when the USR2 trap runs: wait again until srun itself has ended.
        'while true; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || break; done',
        f'echo "{{\\"job_id\\": $SLURM_JOB_ID, \\"exit_code\\": $rc}}" '
        f'> {shlex.quote(str(out))}/exit-"$SLURM_JOB_ID".json',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def _datasets(program_args: Sequence[str]) -> list[str]:
    args = list(program_args)
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--dataset"]


# ---- the queue -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobState:
    state: str  # SLURM's base state, e.g. PENDING, RUNNING, COMPLETED, TIMEOUT
    reason: str = ""
    partition: str = ""
    exit_code: int | None = None

    @property
    def final(self) -> bool:
        return self.state not in WAITING | RUNNING


def query_state(job_id: int, record_dir: Path | None = None) -> JobState | None:
    """The job's state from the queue, or after the queue has let go of it from what else knows it."""
    done = slurm_command("squeue", "-h", "-t", "all", "-j", str(job_id), "-o", SQUEUE_FORMAT, check=False)
    line = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""
    if line:
        state, reason, partition = (line.split("|") + ["", ""])[:3]
        return JobState(_base(state), reason, partition, _exit_record(record_dir, job_id))
    shown = slurm_command("scontrol", "show", "job", "-o", str(job_id), check=False)
    if shown.returncode == 0 and "JobState=" in shown.stdout:
        fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
        code = fields.get("ExitCode", "").split(":")[0]
        return JobState(_base(fields.get("JobState", "")), fields.get("Reason", ""), fields.get("Partition", ""),
                        int(code) if code.isdigit() else None)
    if shutil.which("sacct"):
        acct = slurm_command("sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State,ExitCode", check=False)
        if acct.returncode == 0 and acct.stdout.strip():
            state, _, code = acct.stdout.strip().splitlines()[0].partition("|")
            return JobState(_base(state), "", "", int(code.split(":")[0]) if code[:1].isdigit() else None)
    code = _exit_record(record_dir, job_id)
    if code is not None:  # the job script's own record: the ground truth once SLURM has forgotten the job
        return JobState("COMPLETED" if code == 0 else "FAILED", "", "", code)
    return None


def _base(state: str) -> str:
    """`CANCELLED by 0` -> `CANCELLED`."""
    return state.split()[0].rstrip("+") if state else "UNKNOWN"


def _exit_record(record_dir: Path | None, job_id: int) -> int | None:
    if record_dir is None:
        return None
    try:
        return int(read_json(Path(record_dir) / f"exit-{job_id}.json")["exit_code"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---- submitting and watching ----------------------------------------------------------------------

class SlurmLauncher(Launcher):
    """Submits a job's script with `sbatch --parsable` (or reattaches to its job) and watches it."""

    def __init__(self, cfg: PipelineConfig, entry: Sequence[str] = PROGRAMS_ENTRY) -> None:
        self.cfg = cfg
        self.entry = tuple(entry)
        self.devices = cfg.slurm.gpus_per_node or cfg.trainer.devices

    def start(self, program_args: Sequence[str], job_dir: Path, log_dir: Path) -> SlurmJob:
        job_dir = Path(job_dir).resolve()
        folder = job_dir / SLURM_DIR
        folder.mkdir(parents=True, exist_ok=True)
        script = folder / SCRIPT
        write_atomic(script, lambda f: f.write(render_script(self.cfg, program_args, job_dir, self.entry)))
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
        self.slurm: SlurmConfig = launcher.cfg.slurm
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
            data = read_json(path)
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
            reason = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]
            raise SlurmError(f"sbatch {self.folder / SCRIPT}: {reason}")
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
                self._pending.append(f"slurm: job {self.job_id} pending{where} ({state.reason or 'None'})")
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
                             + (f" ({state.reason})" if state.reason and state.reason != "None" else "")
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


# ---- what a run has in the queue (leanagent status / cancel) --------------------------------------

def run_jobs(run_dir: Path) -> list[tuple[Path, int, JobState | None]]:
    """Every stage of a run_dir with a SLURM job, its latest job id and that job's state (None: forgotten)."""
    found = []
    for record in sorted(Path(run_dir).glob(f"jobs/**/{SLURM_DIR}/{RECORD}")):
        try:
            ids = json.loads(record.read_text()).get("job_ids") or []
        except (OSError, ValueError):
            continue
        if ids:
            found.append((record.parent.parent, int(ids[-1]), query_state(int(ids[-1]), record.parent)))
    return found


def queued(run_dir: Path) -> list[tuple[Path, int, JobState]]:
    return [(job, jid, s) for job, jid, s in run_jobs(run_dir) if s is not None and not s.final]


def cancel(run_dir: Path) -> list[int]:
    """scancel every job of the run still in the queue; their ids."""
    ids = [jid for _, jid, _ in queued(run_dir)]
    if ids:
        slurm_command("scancel", "--full", *map(str, ids))
    return ids

