"""Prefect tasks that launch one rank program each: launch, forward logs, return the result.

The tasks hold no training logic: `leanagent.preflight.run_job.run_job` checks the inputs, runs torchrun
in its own process group and enforces the deadline. What the tasks add is what only Prefect can
give: every output line in the flow run's logs, and retries. A retry reuses the same job folder,
so a train retry resumes from its `last.ckpt`, and a Fisher or evaluation retry overwrites only
its own partial files (result.json is written last, so a failed attempt leaves none).

Retries are skipped for errors that a retry cannot fix: bad input found before launch, and a
job folder that already holds a result.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from leanagent.tasks.options import JobOptions
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from leanagent.ground.config import PipelineConfig
from leanagent.ground.job import IndexRequest, JobFinishedError, JobInputError, Program
from leanagent.preflight.run_job import run_job

# The flow passes its JobOptions to every task; these are the same defaults for a task called on its own.
DEFAULT_RETRIES: int = JobOptions.model_fields["retries"].default
DEFAULT_RETRY_DELAY_S: float = JobOptions.model_fields["retry_delay_s"].default
NOT_RETRYABLE = (JobInputError, JobFinishedError)


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


def _run(program: Program, cfg: PipelineConfig, config_path: Path, dataset: Path | list[Path], out: Path,
         checkpoint: Path | None, fisher: Path | None, timeout_s: float | None,
         heartbeat_timeout_s: float | None, validate: bool, label: str | None,
         index: IndexRequest | None = None) -> dict:
    # reuse_finished: a job whose result.json landed just before a crash (and before the manifest
    # recorded it) is taken as it is, not refused and not rerun.
    return run_job(cfg, Path(config_path), program, dataset, Path(out), checkpoint=checkpoint, fisher=fisher,
                   on_line=forward_to_run_logger(), timeout_s=timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
                   reuse_finished=True, validate=validate, label=label, index=index)


_TASK_OPTIONS: dict[str, Any] = {
    "retries": DEFAULT_RETRIES,
    "retry_delay_seconds": DEFAULT_RETRY_DELAY_S,
    "retry_condition_fn": retry_unless_bad_input,
    # The run manifest decides what is finished; Prefect's input-hash cache would second-guess it.
    "cache_policy": NO_CACHE,
}


@task(name="train-retriever", **_TASK_OPTIONS)
def train_retriever(cfg: PipelineConfig, config_path: Path, dataset: Path, out: Path,
                    checkpoint: Path | None = None, fisher: Path | None = None, timeout_s: float | None = None,
                    heartbeat_timeout_s: float | None = None, validate: bool = True, label: str | None = None) -> dict:
    """Train on one repository from `checkpoint` (or the pretrained model), with EWC when `fisher` is given.

    Args:
        cfg: The run's config.
        config_path: The same config as YAML, which every rank reads.
        dataset: The repository's dataset folder (under merge_all: its merge with the earlier ones).
        out: The job folder; a rerun with the same folder resumes the training or returns its result.
        checkpoint: Where training starts; None: model.name_or_path.
        fisher: The previous repository's Fisher file, for EWC.
        timeout_s: Deadline of one attempt, in seconds.
        heartbeat_timeout_s: End a job whose ranks have not reported progress for this long.
        validate: Validate the dataset first (the flow has already).
        label: What the job's progress lines call it, e.g. `train repo_new` (default: the program and the dataset
            folder's name).
    """
    return _run("train", cfg, config_path, dataset, out, checkpoint, fisher, timeout_s, heartbeat_timeout_s, validate,
                label)


@task(name="compute-fisher", **_TASK_OPTIONS)
def compute_fisher(cfg: PipelineConfig, config_path: Path, dataset: Path, out: Path, checkpoint: Path,
                   timeout_s: float | None = None, heartbeat_timeout_s: float | None = None,
                   validate: bool = True, label: str | None = None) -> dict:
    """The diagonal Fisher of `checkpoint` on a repository, which anchors the next repository's EWC.

    Args:
        cfg: The run's config.
        config_path: The same config as YAML, which every rank reads.
        dataset: The dataset the checkpoint was trained on.
        out: The job folder.
        checkpoint: The trained checkpoint.
        timeout_s: Deadline of one attempt, in seconds.
        heartbeat_timeout_s: End a job whose ranks have not reported progress for this long.
        validate: Validate the dataset first (the flow has already).
        label: What the job's progress lines call it (default: the program and the dataset folder's name).
    """
    return _run("fisher", cfg, config_path, dataset, out, checkpoint, None, timeout_s, heartbeat_timeout_s, validate,
                label)


@task(name="evaluate-retriever", **_TASK_OPTIONS)
def evaluate_retriever(cfg: PipelineConfig, config_path: Path, datasets: list[Path], out: Path,
                       checkpoint: Path | None, timeout_s: float | None = None,
                       heartbeat_timeout_s: float | None = None, validate: bool = True,
                       label: str | None = None, index: IndexRequest | None = None) -> dict:
    """R@1, R@10 and MRR of `checkpoint` on the test split of each of `datasets`, in one job that loads the model
    once; the result's `evaluations` lists them in order.

    Args:
        cfg: The run's config.
        config_path: The same config as YAML, which every rank reads.
        datasets: The repositories' dataset folders.
        out: The job folder.
        checkpoint: The model to score; None: the untrained model.name_or_path.
        timeout_s: Deadline of one attempt, in seconds.
        heartbeat_timeout_s: End a job whose ranks have not reported progress for this long.
        validate: Validate the datasets first (the flow has already).
        label: What the job's progress lines call it (default: the program and the dataset folders' names).
        index: Also write the model's premise index over these datasets' corpora (the stage a server serves).
    """
    return _run("evaluate", cfg, config_path, list(datasets), out, checkpoint, None, timeout_s,
                heartbeat_timeout_s, validate, label, index)
