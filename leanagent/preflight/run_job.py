"""One job = one rank program (train, fisher or evaluate) in one job folder: checked, then launched.

The command line and the Prefect tasks both come through `run_job` with one `JobRequest`, so the checks done
before any accelerator time is spent (the job's shape, then `leanagent.preflight.checks`: inputs, model, devices,
disk, a finished job folder) are the same for both, and so is the launcher the config names.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from leanagent.ground.job import JobFinishedError, JobInputError, JobRequest, result_filename
from leanagent.ground.results import JobResult, read_result
from leanagent.launch.registry import launcher_for
from leanagent.preflight.checks import preflight_job


def check_job(job: JobRequest) -> None:
    """The job's shape (`JobRequest.refusal`) here; its inputs, model, devices and disk in
    `leanagent.preflight.checks` (PreflightError)."""
    refusal = job.refusal()
    if refusal is not None:
        raise JobInputError(refusal)
    preflight_job(job)


def run_job(job: JobRequest, on_line: Callable[[str], None] | None = None, reuse_finished: bool = False) -> JobResult:
    """Check, launch (the launcher its config names), return the job's result (its program's model), with the wall
    time the caller waited for it (`wall_seconds`).

    A job folder with a result is returned as is when `reuse_finished`, refused otherwise. A folder with checkpoints
    but no result is an interrupted training job: the train program resumes it from its newest checkpoint. The job's
    deadlines are the launcher's to enforce, and its `title` is what its progress lines call it.
    """
    result_file = job.out / result_filename(job.config.trainer.node_rank)
    if result_file.is_file():
        if reuse_finished:
            return read_result(result_file, job.spec.result)
        raise JobFinishedError(f"{result_file} exists: this job is finished; choose a new output folder "
                               f"(nothing was overwritten)")
    started = time.monotonic()
    check_job(job)
    result = launcher_for(job.config).launch(job, on_line=on_line)
    # The job as its caller waited for it: the checks, the launch (torchrun, a SLURM queue) and the ranks' own time.
    return result.model_copy(update={"wall_seconds": round(time.monotonic() - started, 3)})
