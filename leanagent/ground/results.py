"""A job's `result.json` as its readers read it: every key a reader takes, typed, with its range.

The rank programs write it (`leanagent/train/programs.py`); the launchers return it, the flow records it in the
run's manifest as a stage's result, and the report, the server's follower and the next stage read it back. A
file edited by hand, cut short, or written by another version must be refused in one line naming the file and
the key, before anything uses it, not fail later as a traceback. Keys nobody reads are kept as they are
(`extra="allow"`): a newer writer's additions pass through.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_validator,
)

from leanagent.ground.config import Precision
from leanagent.ground.job import JobInputError
from leanagent.ground.json_files import MIB, read_json_file, validate_as

# The most a result.json holds: a few kB per dataset an evaluation job scores.
MAX_RESULT_BYTES = 16 * MIB

# Non-negative counts and seconds; a count beyond this is no count a run makes.
MAX_COUNT = 10**12


def _count() -> Any:
    return Field(None, ge=0, le=MAX_COUNT, strict=True)


def _seconds() -> Any:
    return Field(None, ge=0, allow_inf_nan=False, strict=True)


def _percent(alias: str) -> Any:
    return Field(None, alias=alias, ge=0, le=100, allow_inf_nan=False, strict=True)


class ResultUnreadableError(JobInputError):
    """A result.json (or a manifest's stage result) that is not JSON or not of a result's shape."""


class Metrics(BaseModel):
    """An evaluation's or a training's metrics: recalls in percent, MRR in [0, 1], any other metric a finite
    number (or null where it was not computed)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    recall_1: float | None = _percent("Recall@1")
    recall_10: float | None = _percent("Recall@10")
    recall_10_val: float | None = _percent("Recall@10_val")
    checkpoint_recall_10_val: float | None = _percent("checkpoint_Recall@10_val")
    mrr: float | None = Field(None, alias="MRR", ge=0, le=1, allow_inf_nan=False, strict=True)
    num_contexts: int | None = _count()

    @model_validator(mode="after")
    def _others_finite(self) -> Self:
        for key, value in (self.model_extra or {}).items():
            if value is not None and not (isinstance(value, int | float) and not isinstance(value, bool)
                                          and math.isfinite(value)):
                raise ValueError(f"metric {key!r} must be a finite number or null, not {str(value)[:40]!r}")
        return self


class JobCost(BaseModel):
    """What a job says about its cost (`leanagent.ground.timings.COST_KEYS`)."""

    model_config = ConfigDict(extra="allow")

    timings: dict[StrictStr, StrictFloat] | None = None
    premises_embedded: int | None = _count()
    premises_in_corpora: int | None = _count()
    peak_rss_mb: float | None = _seconds()
    wall_seconds: float | None = _seconds()

    @model_validator(mode="after")
    def _timings_in_range(self) -> Self:
        for part, seconds in (self.timings or {}).items():
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"timings.{part}: {seconds} is not a number of seconds")
        return self


class EvaluationJob(JobCost):
    """An evaluation stage's record of the job that evaluated it (one job evaluates several repositories)."""

    out: StrictStr | None = None
    index: StrictStr | None = None  # the stage's premise index, written by that job


class Evaluation(BaseModel):
    model_config = ConfigDict(extra="allow")

    dataset: StrictStr | None = None
    metrics: Metrics


class JobResult(JobCost):
    """result.json of any rank program, and a stage's result in the manifest (which adds `job` to an
    evaluation's): the keys its readers take."""

    program: StrictStr | None = None
    precision: Precision | None = None  # the trainer precision the job ran in (`auto` resolved by its ranks)
    checkpoint: StrictStr | None = None
    fisher: StrictStr | None = None
    dataset: StrictStr | None = None
    epoch: int | None = _count()
    world_size: int | None = Field(None, ge=1, le=MAX_COUNT, strict=True)
    metrics: Metrics | None = None
    evaluations: list[Evaluation] | None = None
    index: StrictStr | None = None
    job: EvaluationJob | None = None
    ewc: StrictBool | None = None
    # a merge stage's (leanagent.run.strategy): its counts and the digests of what it read and wrote
    files: int | None = _count()
    theorems: dict[StrictStr, StrictInt] | None = None
    duplicate_theorems: int | None = _count()
    corpus_conflicts: int | None = _count()
    inputs: dict[StrictStr, dict[StrictStr, StrictStr]] | None = None
    outputs: dict[StrictStr, StrictStr] | None = None


def check_result(data: Any, where: str) -> dict[str, Any]:
    """`data` when it is a job result (a JSON object of the typed keys' types and ranges); else
    ResultUnreadableError naming `where` and the key."""
    validate_as(data, JobResult, where, "job's result", ResultUnreadableError)
    return data


def read_result(path: Path) -> dict[str, Any]:
    """A job's result.json, capped (`MAX_RESULT_BYTES`) and checked (`check_result`); one line naming the file for
    anything else."""
    data = read_json_file(path, MAX_RESULT_BYTES, "job's result.json", ResultUnreadableError, "rerun the job")
    validate_as(data, JobResult, str(path), "job's result", ResultUnreadableError, "rerun the job")
    return data
