"""A run's manifest.json as a file: its name, how it is read (one line naming the file for anything that is not a
manifest), the stages it records and their names, and what a reader (the report, the server, the flow) asks of it.

Why a manifest at all: a lifelong run is a chain of jobs (train, Fisher, evaluations per repository) that takes
days; after a crash or a cancel the rerun must skip every finished stage and never touch its checkpoint. The
manifest is rewritten atomically after every stage (`leanagent.run.state.RunState`), so a reader (the UI, a rerun,
a person) always sees a whole file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from leanagent.data.strategies import merges
from leanagent.ground.json_files import MIB, read_json_file, validate_as
from leanagent.ground.results import JobResult

MANIFEST_NAME = "manifest.json"
JOBS_DIR = "jobs"  # run_dir/jobs/STAGE: each stage's job folder
# The most a manifest holds: a few kB per stage, and a run of a hundred repositories has about 5,000 stages.
MAX_MANIFEST_BYTES = 64 * MIB


# 2: the repositories left the fingerprint, each recorded with its dataset's digests; version 1 manifests load.
MANIFEST_VERSION = 2


class ManifestMismatchError(ValueError):
    """The run_dir holds another experiment, or a sequence of repositories the config does not extend; nothing
    was written."""


class ManifestUnreadableError(ManifestMismatchError):
    """The run_dir's manifest.json is cut short, not JSON, or not a manifest; nothing was written."""


class StageRecord(BaseModel):
    """A stage as the manifest records it (`leanagent.run.state.RunState`): a finished one holds its result."""

    model_config = ConfigDict(extra="allow")

    status: StrictStr
    result: JobResult | None = None
    error: StrictStr | None = None
    reason: StrictStr | None = None

    @model_validator(mode="after")
    def _done_has_result(self) -> Self:
        if self.status == "done" and self.result is None:
            raise ValueError("a finished stage (status done) without its result")
        return self


# What each finished stage's readers take from its result: the flow the next stage's inputs, the report its rows.
REQUIRED_RESULT_KEYS = {"train": ("checkpoint",), "fisher": ("fisher",), "merge": ("dataset",)}


class RepoRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: StrictInt | None = Field(None, ge=0, le=10**6)
    name: StrictStr | None = None
    path: StrictStr | None = None
    dataset: dict[StrictStr, StrictStr] | None = None
    stages: dict[StrictStr, StageRecord] = {}

    @model_validator(mode="after")
    def _finished_results_hold_what_is_read(self) -> Self:
        for name, stage in self.stages.items():
            if stage.status != "done" or stage.result is None:
                continue
            if name.startswith("eval-") and (stage.result.metrics is None or stage.result.metrics.recall_10 is None):
                raise ValueError(f"stages.{name}.result.metrics: a finished evaluation without its Recall@10")
            for key in REQUIRED_RESULT_KEYS.get(name, ()):
                if getattr(stage.result, key) is None:
                    raise ValueError(f"stages.{name}.result.{key}: missing from a finished {name} stage")
        return self


class LifelongRecord(BaseModel):
    """The config's lifelong section, as the report and the flow read it back."""

    model_config = ConfigDict(extra="allow")

    dataset_strategy: StrictStr | None = None
    replay_fraction: float | None = Field(None, gt=0, le=1, strict=True)
    curriculum: StrictBool | None = None
    ewc_lambda: float | None = Field(None, ge=0, allow_inf_nan=False, strict=True)


class ConfigRecord(BaseModel):
    """The config a manifest records (`fingerprint_fields`): its sections are objects; a version 1 manifest's holds
    its repositories."""

    model_config = ConfigDict(extra="allow")

    lifelong: LifelongRecord | None = None
    model: dict[StrictStr, Any] | None = None
    data: dict[StrictStr, Any] | None = None
    trainer: dict[StrictStr, Any] | None = None
    repos: list[dict[StrictStr, Any]] | None = None


class ManifestRecord(BaseModel):
    """manifest.json: every key a reader takes (the flow resuming a run, `report`, the server following it),
    typed, with its range; keys nobody reads pass as they are (`extra="allow"`)."""

    model_config = ConfigDict(extra="allow")

    version: StrictInt | None = Field(None, ge=1, le=MANIFEST_VERSION)
    fingerprint: StrictStr | None = None
    config: ConfigRecord = ConfigRecord()
    order: list[StrictStr] | None = None
    given: list[StrictStr] | None = None
    repos: dict[StrictStr, RepoRecord] = {}
    created_at: StrictStr | None = None
    updated_at: StrictStr | None = None


def check_manifest(data: Any, path: Path) -> dict[str, Any]:
    """`data` when it is a run manifest (`ManifestRecord`); ManifestUnreadableError naming the file and the key."""
    validate_as(data, ManifestRecord, str(path), "run manifest", ManifestUnreadableError, _UNREADABLE)
    return data


def not_a_run(path: Path) -> str | None:
    """Why `path` is no run_dir of `leanagent run`, in one line naming it (no such folder, a file, a folder with
    neither a manifest nor job folders); None when it is one. A run writes its manifest before its first job; a run
    whose manifest is gone but whose jobs may still be queued keeps its `jobs` folder, and is still one."""
    path = Path(path)
    if path.is_file():
        return f"{path}: a file, not a run_dir of `leanagent run`"
    if not path.is_dir():
        return f"{path}: no such folder (not a run_dir of `leanagent run`)"
    if not (path / MANIFEST_NAME).is_file() and not (path / JOBS_DIR).is_dir():
        return f"{path}: a folder with neither {MANIFEST_NAME} nor {JOBS_DIR}/ (not a run_dir of `leanagent run`)"
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    """A run's manifest.json, or ManifestUnreadableError naming the file, what is wrong (the key, for a manifest
    of the wrong shape) and what to do (a file cut short by a full disk or a copy, or edited by hand, is never
    overwritten). Refused from its size alone past `MAX_MANIFEST_BYTES`."""
    return check_manifest(read_json_file(path, MAX_MANIFEST_BYTES, "run manifest", ManifestUnreadableError,
                                         _UNREADABLE), path)


_UNREADABLE = ("it was cut short or edited. Restore it from a copy, or move the run_dir aside to start the run "
               "afresh; nothing was changed")


@dataclass(frozen=True)
class RepoEntry:
    """A repository as the sequence knows it: its display name, its folder, and {file: SHA-256} of its dataset
    (`leanagent.data.merge.digests`; None when its folder is missing, which the preflight reports)."""

    name: str
    path: Path
    dataset: dict[str, str] | None = None


def repo_key(index: int, name: str) -> str:
    """`00-name`: the index keeps two repositories of one display name apart and sorts in curriculum order."""
    return f"{index:02d}-{name}"


TRAIN, FISHER, EVAL_UNTRAINED, MERGE = "train", "fisher", "eval-untrained", "merge"


def eval_stage(target_index: int, target_name: str) -> str:
    """The evaluation, after training on a repository, of the model on repository `target_index`'s test split."""
    return f"eval-{target_index:02d}-{target_name}"


def stage_name(index: int, name: str, stage: str) -> str:
    """`00-name/train`, `00-name/fisher`, `00-name/eval-01-other`: also the job folder under run_dir/jobs."""
    return f"{repo_key(index, name)}/{stage}"


def repo_stages(index: int, names: list[str], merged: bool = False) -> list[str]:
    """Every stage of repository `index` of the sequence `names`: its untrained evaluation, (its merge,) its
    training, its Fisher, and the evaluations of its model on repositories 0..index."""
    name = names[index]
    stages = [EVAL_UNTRAINED, *([MERGE] if merged else []), TRAIN, FISHER,
              *(eval_stage(j, names[j]) for j in range(index + 1))]
    return [stage_name(index, name, stage) for stage in stages]


def recorded_sequence(manifest: dict[str, Any]) -> list[RepoEntry]:
    """The repositories a manifest has recorded, in their order (a version 1 manifest's have no digests)."""
    repos = manifest.get("repos", {})
    out = []
    for i, name in enumerate(manifest.get("order") or []):
        repo = repos.get(repo_key(i, name), {})
        out.append(RepoEntry(name, Path(repo.get("path", "")), repo.get("dataset")))
    return out


def given_before(manifest: dict[str, Any]) -> list[str]:
    """The names in the order the run's config gave them (a version 1 manifest has them in its config)."""
    if manifest.get("given") is not None:
        return list(manifest["given"])
    listed = manifest.get("config", {}).get("repos") or []
    return [r.get("name") or Path(r.get("path", "")).name for r in listed if isinstance(r, dict)]


def waiting_repositories(manifest: dict[str, Any]) -> list[str]:
    """The repositories of a manifest's sequence with a stage still to run (not finished, failed or interrupted)."""
    names = list(manifest.get("order") or [])
    merged = merges(((manifest.get("config") or {}).get("lifelong") or {}).get("dataset_strategy"))
    return [names[i] for i in range(len(names))
            if any(finished_result(stage_entry(manifest, stage)) is None for stage in repo_stages(i, names, merged))]


def stage_entry(manifest: dict[str, Any], stage: str) -> dict[str, Any] | None:
    key, _, name = stage.partition("/")
    return manifest.get("repos", {}).get(key, {}).get("stages", {}).get(name)


def stage_result(manifest: dict[str, Any], index: int, name: str, stage: str) -> dict | None:
    """A finished stage's result from a manifest read from disk; None if it has not finished."""
    return finished_result(stage_entry(manifest, stage_name(index, name, stage)))


def finished_result(entry: dict[str, Any] | None) -> dict | None:
    """What "finished" means, for the flow resuming a run and for a report read from disk alike."""
    return entry["result"] if entry and entry.get("status") == "done" else None


INDEX_DIR = "index"  # run_dir/index/00-name: the premise index of the stage trained through that repository


def stage_indexes(manifest: dict[str, Any]) -> list[tuple[int, str, str]]:
    """(position, repository, index folder) of every finished stage whose evaluation wrote a premise index, in
    the run's order: a stage is finished when its evaluations of every repository seen so far are done."""
    names = list(manifest.get("order") or [])
    out = []
    for i, name in enumerate(names):
        evaluations = [stage_result(manifest, i, name, eval_stage(j, names[j])) for j in range(i + 1)]
        if any(e is None for e in evaluations):
            continue
        jobs = [e.get("job") for e in evaluations if isinstance(e, dict)]
        folder = next((job["index"] for job in jobs if isinstance(job, dict) and isinstance(job.get("index"), str)),
                      None)
        if folder is not None:
            out.append((i, name, folder))
    return out
