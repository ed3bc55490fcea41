"""What a job hands back: each rank program's result, one pydantic model per program, and how a result.json is read.

The rank program writes its model as `result.json` (`leanagent/train/programs.py`); the launcher reads it back as that
model (`read_result`), and `run_job`, the Prefect task and the flow's stages hand on the model itself; the run's
manifest stores it as a stage's result (`StageResult`, told apart by `program`), and the report, the server's
follower and the next stage read its typed fields. A file edited by hand, cut short, or written by another version
must be refused in one line naming the file and the key, before anything uses it, not fail later as a traceback.
Keys nobody reads are kept as they are (`extra="allow"`): a newer writer's additions pass through.

`JobResult` is the common part (which program, in what precision, on how many ranks, and what the job cost); each
program's model adds what its readers take.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)

from leanagent.ground.config import Precision
from leanagent.ground.json_files import MIB, JsonFileError, read_model

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


class ResultUnreadableError(JsonFileError):
    """A result.json (or a manifest's stage result) that is not JSON or not of its program's result's shape."""


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


class JobResult(BaseModel):
    """What every job's result says: its program, the precision and ranks it ran on, where it ran, and what it cost
    (`timings`: rank 0's parts, `leanagent.ground.timings`; `wall_seconds`: as its launcher waited for it)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    program: StrictStr
    precision: Precision | None = None  # the trainer precision the job ran in (`auto` resolved by its ranks)
    world_size: int | None = Field(None, ge=1, le=MAX_COUNT, strict=True)
    out: StrictStr | None = None  # the job folder
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

    def as_json(self) -> dict[str, Any]:
        """The result as its JSON file holds it: the keys it was given, under their file names."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class TrainResult(JobResult):
    """A training job's: the checkpoint the next repository starts from, and how training went."""

    program: Literal["train"]
    checkpoint: StrictStr  # the newest (LeanAgent) or the best epoch's: `lifelong.checkpoint`
    best_checkpoint: StrictStr | None = None
    latest_checkpoint: StrictStr | None = None
    last_checkpoint: StrictStr | None = None
    dataset: StrictStr | None = None
    epoch: int | None = _count()
    global_step: int | None = _count()
    target_epochs: int | None = _count()
    start_epochs: int | None = _count()  # epochs the start checkpoint had trained (ours or a reference's)
    start_global_step: int | None = _count()
    resumed_from: StrictStr | None = None
    unreadable_checkpoints: list[StrictStr] = []
    ewc: StrictBool | None = None
    metrics: Metrics | None = None
    history: list[dict[StrictStr, Any]] = []  # this repository's validations, one per epoch
    num_train_examples: int | None = _count()
    fit_seconds: float | None = _seconds()
    first_train_batch_time: float | None = _seconds()  # epoch seconds: when the first training batch started


class FisherResult(JobResult):
    """A Fisher job's: the Fisher file the next repository's training is anchored by."""

    program: Literal["fisher"]
    fisher: StrictStr
    dataset: StrictStr | None = None
    checkpoint: StrictStr | None = None
    fit_seconds: float | None = _seconds()


class Evaluation(BaseModel):
    """One dataset's scores."""

    model_config = ConfigDict(extra="allow")

    dataset: StrictStr | None = None
    metrics: Metrics


class EvaluateResult(JobResult):
    """An evaluation job's: one model scored on several datasets, and the premise index it wrote, if any. With one
    dataset its evaluation is also at the top (`dataset`, `metrics`), as an evaluation stage's result has it."""

    program: Literal["evaluate"]
    checkpoint: StrictStr | None = None  # the model scored: a checkpoint, or the base model's name
    evaluations: list[Evaluation] = Field(min_length=1)
    dataset: StrictStr | None = None
    metrics: Metrics | None = None
    index: StrictStr | None = None  # the stage's premise index, written by this job

    def one(self, k: int) -> EvaluateResult:
        """The result of this job for its `k`-th dataset alone, as an evaluation stage records it: its evaluation,
        with the job's model, ranks, folder, cost and index (the cost is the whole job's, once per `out`)."""
        evaluation = self.evaluations[k]
        return self.model_copy(update={"evaluations": [evaluation], "dataset": evaluation.dataset,
                                       "metrics": evaluation.metrics})


class ReplayDraw(BaseModel):
    """One earlier repository's share of training theorems in a replay merge (`leanagent.data.replay`): its draw's
    fraction and key, and how many of how many it kept. `merge.json` lists the positions kept as well; the manifest
    leaves them out (the merged files' digests pin them)."""

    model_config = ConfigDict(extra="forbid")

    fraction: float = Field(gt=0, le=1)
    key: StrictStr
    of: StrictInt = Field(ge=0)
    kept: StrictInt = Field(ge=0)
    positions: list[StrictInt] | None = None


class MergeResult(BaseModel):
    """A merge stage's (`leanagent.run.strategy`, not a rank program): the merged dataset, its counts, the digests
    of what it read and wrote, and under replay each earlier repository's draw."""

    model_config = ConfigDict(extra="allow")

    program: Literal["merge"]
    dataset: StrictStr
    sources: list[StrictStr] = []  # the repositories merged, in curriculum order
    files: int | None = _count()
    theorems: dict[StrictStr, StrictInt] | None = None
    duplicate_theorems: int | None = _count()
    corpus_conflicts: int | None = _count()
    inputs: dict[StrictStr, dict[StrictStr, StrictStr]] = {}
    outputs: dict[StrictStr, StrictStr] = {}
    replay: dict[StrictStr, ReplayDraw] = {}

    def as_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


# What a finished stage's result is, by its `program`.
STAGE_RESULTS: dict[str, type[BaseModel]] = {"train": TrainResult, "fisher": FisherResult,
                                             "evaluate": EvaluateResult, "merge": MergeResult}


def _as_its_program(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A stage's result validated as its program's model, so that a wrong key is named from the result down (not
    under the union's tag); anything without a known program goes to the union, which says what is wrong."""
    program = value.get("program") if isinstance(value, dict) else None
    model = STAGE_RESULTS.get(program) if isinstance(program, str) else None
    return model.model_validate(value) if model is not None else handler(value)


# A finished stage's result, as the manifest stores it: the model its job returned, told apart by `program`.
StageResult = Annotated[TrainResult | FisherResult | EvaluateResult | MergeResult, Field(discriminator="program"),
                        WrapValidator(_as_its_program)]

R = TypeVar("R", bound=JobResult)


def read_result(path: Path, model: type[R]) -> R:
    """A job's result.json as `model` (its program's), capped (`MAX_RESULT_BYTES`) and checked; one line naming the
    file and the key for anything else."""
    return read_model(path, model, MAX_RESULT_BYTES, "job's result.json", ResultUnreadableError, "rerun the job")
