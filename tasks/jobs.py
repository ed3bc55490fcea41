"""The Prefect task that launches a rank program's job: launch, forward logs, return the result.

The tasks hold no training logic: `leanagent.preflight.run_job.run_job` checks the inputs, runs torchrun
in its own process group and enforces the deadline. What the tasks add is what only Prefect can
give: every output line in the flow run's logs, and retries. A retry reuses the same job folder,
so a train retry resumes from its `last.ckpt`, and a Fisher or evaluation retry overwrites only
its own partial files (result.json is written last, so a failed attempt leaves none).

Retries are skipped for errors that a retry cannot fix: bad input found before launch, a job folder
that already holds a result, and a finished job's result.json that is not one (edited, cut short).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from leanagent.ground.job import JobFinishedError, JobInputError, JobRequest
from leanagent.ground.results import JobResult, ResultUnreadableError
from leanagent.preflight.run_job import run_job
from leanagent.tasks.options import JobOptions

# The flow passes its JobOptions to every task; these are the same defaults for a task called on its own.
DEFAULT_RETRIES: int = JobOptions.model_fields["retries"].default
DEFAULT_RETRY_DELAY_S: float = JobOptions.model_fields["retry_delay_s"].default
NOT_RETRYABLE = (JobInputError, JobFinishedError, ResultUnreadableError)


def retry_unless_bad_input(task: Any, task_run: TaskRun, state: State) -> bool:
    """Prefect's retry_condition_fn: relaunching cannot fix a refused input, so do not spend a retry on it."""
    return not isinstance(state.data, NOT_RETRYABLE)


def forward_to_run_logger() -> Callable[[str], None]:
    """Each job line verbatim into the task run's log; rank lines already start with `[rank N]`."""
    logger = get_run_logger()

    def on_line(line: str) -> None:
        if line.strip():
            logger.info(line)

    return on_line


_TASK_OPTIONS: dict[str, Any] = {
    "retries": DEFAULT_RETRIES,
    "retry_delay_seconds": DEFAULT_RETRY_DELAY_S,
    "retry_condition_fn": retry_unless_bad_input,
    # The run manifest decides what is finished; Prefect's input-hash cache would second-guess it.
    "cache_policy": NO_CACHE,
}


@task(name="rank-job", **_TASK_OPTIONS)
def rank_job(job: JobRequest) -> JobResult:
    """One job of a rank program (train, fisher, evaluate: `leanagent.ground.job.PROGRAMS`), launched by the config's
    launcher, its lines in this task run's log; returns its result, as its program's model.

    A job whose result.json landed just before a crash (and before the manifest recorded it) is taken as it is, not
    refused and not rerun.

    Args:
        job: The job: its program, its config (each rank reads a copy), its datasets, folder, checkpoint, Fisher
            file and premise index, its deadlines, what its progress lines call it, and whether its datasets were
            validated already (the flow's were).
    """
    return run_job(job, on_line=forward_to_run_logger(), reuse_finished=True)
