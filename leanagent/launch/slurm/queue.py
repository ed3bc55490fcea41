"""SLURM's queue, as its own commands tell it: a job's state, and the jobs a run_dir has on record.

The state is read from `squeue`, then `scontrol show job` once squeue has let go of the job, then `sacct` where
the cluster keeps accounting, then the exit record the job script writes itself (`JOB/slurm/exit-ID.json`): a
cluster without accounting that has forgotten the job (MinJobAge) still gives the right answer.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from leanagent.ground.json_files import KIB, MIB, JsonFileError, read_json_file
from leanagent.launch.base import LaunchError

SLURM_DIR = "slurm"  # JOB/slurm/: the script, the record of submissions, SLURM's output, the exit records
RECORD = "job.json"
WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED",
           "SPECIAL_EXIT", "STAGE_OUT", "SIGNALING"}
RUNNING = {"RUNNING", "COMPLETING"}
FAILED = {"FAILED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "CANCELLED", "REVOKED"}
RESUMABLE = {"TIMEOUT", "PREEMPTED", "NODE_FAIL"}
SQUEUE_FORMAT = "%T|%r|%P"
NO_REASON = {"", "None", "(null)"}  # what squeue and scontrol print for a job that has no reason


class SlurmError(LaunchError):
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
        raise SlurmError(f"{' '.join(args[:2])}: {first_error(done)}")
    return done


def first_error(done: subprocess.CompletedProcess) -> str:
    return (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[-1]


@dataclass(frozen=True)
class JobState:
    state: str  # SLURM's base state, e.g. PENDING, RUNNING, COMPLETED, TIMEOUT
    reason: str = ""  # as SLURM gives it (Resources, Priority, BeginTime, ...); "" when it gives none
    partition: str = ""
    exit_code: int | None = None

    def __post_init__(self) -> None:
        if self.reason in NO_REASON:
            object.__setattr__(self, "reason", "")

    @property
    def final(self) -> bool:
        return self.state not in WAITING | RUNNING

    def describe(self) -> str:
        """`PENDING (Resources)`, or the state alone when SLURM gives no reason."""
        return f"{self.state} ({self.reason})" if self.reason else self.state


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
        return int(read_json_file(Path(record_dir) / f"exit-{job_id}.json", KIB)["exit_code"])
    except (JsonFileError, ValueError, KeyError, TypeError):
        return None


def run_jobs(run_dir: Path) -> list[tuple[Path, int, JobState | None]]:
    """Every stage of a run_dir with a SLURM job, its latest job id and that job's state (None: forgotten)."""
    found = []
    for record in sorted(Path(run_dir).glob(f"jobs/**/{SLURM_DIR}/{RECORD}")):
        try:
            ids = read_json_file(record, MIB).get("job_ids") or []
        except (JsonFileError, AttributeError):
            continue
        if ids:
            found.append((record.parent.parent, int(ids[-1]), query_state(int(ids[-1]), record.parent)))
    return found
