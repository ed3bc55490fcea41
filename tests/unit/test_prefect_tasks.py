"""Task options that decide how failures are handled, checked without launching anything."""

from __future__ import annotations

from prefect.states import Failed

from leanagent.ground.job import JobFinishedError, JobInputError
from leanagent.launch.base import LaunchError
from leanagent.tasks.jobs import rank_job, retry_unless_bad_input
from leanagent.tasks.options import JobOptions


def test_retries_are_not_spent_on_refused_input() -> None:
    def retried(exc: BaseException) -> bool:
        return retry_unless_bad_input(None, None, Failed(data=exc))  # type: ignore[arg-type]

    assert retried(LaunchError("rank 1 died", 1, []))
    assert not retried(JobInputError("no such checkpoint"))
    assert not retried(JobFinishedError("result.json exists"))


def test_jobs_retry_twice_by_default() -> None:
    """README's default, for a task called on its own as for the flow's options: 2 retries, 10 s apart."""
    assert (JobOptions().retries, JobOptions().retry_delay_s) == (2, 10.0)
    assert (rank_job.retries, rank_job.retry_delay_seconds) == (2, 10.0)
