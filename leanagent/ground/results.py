"""A job's `result.json` as its readers read it: every key a reader takes, typed, with its range.

The rank programs write it (`leanagent/train/programs.py`); the launchers return it, the flow records it in the
run's manifest as a stage's result, and the report, the server's follower and the next stage read it back. A
file edited by hand, cut short, or written by another version must be refused in one line naming the file and
the key, before anything uses it, not fail later as a traceback. Keys nobody reads are kept as they are
(`extra="allow"`): a newer writer's additions pass through.
"""

from __future__ import annotations

import json
import math
import re
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
    ValidationError,
    model_validator,
)

from leanagent.ground.config import Precision
from leanagent.ground.job import JobInputError

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


def describe_error(exc: ValidationError, prefix: str = "") -> str:
    """The first problem of a validation, as `key.path: what is wrong` (one line; the rest counted)."""
    errors = exc.errors()
    first = errors[0]
    key = ".".join(str(p) for p in (*([prefix] if prefix else []), *first["loc"])) or "(top level)"
    got = first.get("input")
    shown = json.dumps(got, default=str)[:40] if not isinstance(got, dict | list) else type(got).__name__
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = re.sub(r"^Input should be a valid dictionary or instance of \w+", "must be an object", first["msg"])
    message = re.sub(r"^(Input|Value) should be ", "must be ", message).replace("Value error, ", "")
    found = "" if first["type"] == "value_error" else f" (found {shown})"  # a rule's own message says it
    return f"{key}: {message.rstrip('.')}{found}{more}"


def check_result(data: Any, where: str) -> dict[str, Any]:
    """`data` when it is a job result (a JSON object of the typed keys' types and ranges); else
    ResultUnreadableError naming `where` and the key."""
    if not isinstance(data, dict):
        raise ResultUnreadableError(f"{where}: a JSON {type(data).__name__}, not a job's result (an object)")
    try:
        JobResult.model_validate(data)
    except ValidationError as exc:
        raise ResultUnreadableError(f"{where}: {describe_error(exc)}") from None
    return data


def read_result(path: Path) -> dict[str, Any]:
    """A job's result.json, checked (`check_result`); one line naming the file for anything else."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultUnreadableError(f"{path}: not a readable result ({type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0][:120]}); rerun the job") from None
    return check_result(data, str(path))
