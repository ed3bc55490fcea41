"""One job, as both sides see it: the rank programs inside torchrun, and whoever launched and watches them.

A job is one rank program (train, fisher or evaluate) writing into one job folder. The two sides never
share memory, only this folder, so its protocol lives here, on the ground floor, with nothing heavy:

- the job itself (`JobRequest`): what the flow, a Prefect task, the CLI and `run_job` hand on as one typed value,
  what the launcher starts (`to_argv`) and what the rank entry point reads back (`from_argv`);
- the programs (`PROGRAMS`): one `ProgramSpec` each, naming the function that runs it inside a rank;
- `result.json` (`result_filename`): written by rank 0 last, so its presence means the job is finished;
  `needs-resume.json` instead when the ranks were asked to stop (a time limit ahead) and saved a checkpoint;
- `heartbeat/rankN.json` (`beat`, `stale_ranks`, `read_progress`): each rank's liveness, and rank 0's
  progress snapshot, which the launcher's watchdog and progress display read;
- the errors a job's inputs or folder are refused with, before anything is launched.
"""

from __future__ import annotations

import argparse
import time
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from leanagent.ground.atomic import write_json_atomic
from leanagent.ground.json_files import MIB, JsonFileError, read_json_file
from leanagent.ground.ranks import global_rank


@dataclass(frozen=True)
class ProgramSpec:
    """One rank program, as every place that lists programs reads it: the CLI's command and flags, the checks before
    a launch, the rank's entry point (which runs `runner`) and the disk estimate.

    `runner` is `module:function`, imported inside the ranks only (torch lives there): the function takes the
    config, the `JobRequest` and the job's clock (`leanagent.ground.timings.JobClock`) and returns what rank 0
    writes to result.json. Adding a program is adding its entry to `PROGRAMS` and writing that function.
    """

    name: str
    summary: str  # the command's line in `leanagent --help`
    runner: str
    several_datasets: bool = False  # evaluate scores one model on several datasets, loaded once
    needs_checkpoint: bool = False
    checkpoint_help: str = "the checkpoint the job starts from (default: model.name_or_path)"
    takes_fisher: bool = False  # train: the previous repository's Fisher arms EWC
    takes_index: bool = False  # evaluate: also write the model's premise index
    writes: Literal["checkpoints", "fisher", "nothing large"] = "nothing large"


PROGRAMS_MODULE = "leanagent.train.programs"  # what runs inside each rank: `python -m leanagent.train.programs ...`
PROGRAMS: dict[str, ProgramSpec] = {spec.name: spec for spec in (
    ProgramSpec("train", "train the retriever on one repository (DDP under torchrun)",
                f"{PROGRAMS_MODULE}:train_job", takes_fisher=True, writes="checkpoints",
                checkpoint_help="the checkpoint training starts from (default: model.name_or_path)"),
    ProgramSpec("fisher", "compute the diagonal Fisher of a checkpoint on a repository",
                f"{PROGRAMS_MODULE}:fisher_job", needs_checkpoint=True, writes="fisher",
                checkpoint_help="the trained checkpoint whose Fisher is computed"),
    ProgramSpec("evaluate", "R@1, R@10, MRR of a checkpoint on a repository's test split",
                f"{PROGRAMS_MODULE}:evaluate_job", several_datasets=True, takes_index=True,
                checkpoint_help="the checkpoint scored (default: the base model, model.name_or_path)"),
)}
PROGRAMS_ENTRY = ("-m", PROGRAMS_MODULE)  # the rank program on a python command line (launchers may replace it)
# A launcher that can be told to stop ahead of a time limit (SLURM) names a file here; when it appears the ranks
# save a step checkpoint at their next step, and rank 0 writes NEEDS_RESUME_FILE instead of result.json.
STOP_FILE_ENV = "LEANAGENT_STOP_FILE"
NEEDS_RESUME_FILE = "needs-resume.json"


class JobInputError(ValueError):
    """Bad input found before launch; nothing was started and nothing was written."""


class JobFinishedError(FileExistsError):
    """The job folder already holds a result; a finished job is never overwritten."""


@dataclass(frozen=True)
class IndexRequest:
    """An evaluation job's premise index, written when its tests are done (`leanagent.index`): into `out`, of the
    union of `datasets`' corpora (in curriculum order: where two carry one file, the last one's version), its
    premise and module lists extending those of the index `after` (the previous stage's), when given."""

    out: Path
    datasets: tuple[Path, ...]
    after: Path | None = None


class JobRequest(BaseModel):
    """One job, declared once: the flow, a Prefect task, the CLI (its flags are these fields) and `run_job` pass it
    on whole; the launcher starts the rank program with `to_argv()`, and each rank reads it back with `from_argv`.

    The deadlines and the label are the launcher's (the ranks never see them); every other field travels to the
    ranks as an absolute path, since they may start in another folder, or on another node.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True)

    program: str = Field(description="the rank program: a name of leanagent.ground.job.PROGRAMS")
    config: Path = Field(description="the pipeline config YAML (model, data, trainer)")
    datasets: tuple[Path, ...] = Field(alias="dataset", min_length=1, description="a LeanDojo dataset folder")
    out: Path = Field(description="job folder; result.json is written here")
    checkpoint: Path | None = Field(None, description="the checkpoint the job starts from")
    fisher: Path | None = Field(None, description="Fisher .safetensors of the previous repository: enables EWC")
    index: Path | None = Field(
        None, description="also write the model's premise index over the datasets' corpora (a file two carry: the "
                          "last one's version) into this new or empty folder, for `leanagent serve` and `retrieve`; "
                          "the premises the tests embedded are not embedded again")
    index_datasets: tuple[Path, ...] = Field(
        (), alias="index_dataset", description="the index's datasets, in curriculum order (default: the evaluated "
                                               "ones)")
    index_after: Path | None = Field(None, description="the index whose premise and module lists the new one extends")
    timeout: float | None = Field(None, gt=0, description="end the job after this many seconds")
    heartbeat_timeout: float | None = Field(None, gt=0, description="end the job when a rank is silent this long "
                                                                    "(seconds)")
    label: str | None = Field(None, description="what the job's progress lines call it, e.g. `train PFR` (default: "
                                                "the program and the dataset folders' names)")

    # Fields only some programs take, with the ProgramSpec flag that says which.
    TAKEN_IF: ClassVar[dict[str, str]] = {"fisher": "takes_fisher", "index": "takes_index",
                                          "index_datasets": "takes_index", "index_after": "takes_index"}
    LAUNCHER_FIELDS: ClassVar[tuple[str, ...]] = ("timeout", "heartbeat_timeout", "label")

    @field_validator("program")
    @classmethod
    def _known_program(cls, program: str) -> str:
        if program not in PROGRAMS:
            raise ValueError(f"unknown program {program!r}; known: {', '.join(PROGRAMS)}")
        return program

    @property
    def spec(self) -> ProgramSpec:
        return PROGRAMS[self.program]

    @property
    def title(self) -> str:
        """What the job is called: its label, or `train repo_1`, `evaluate repo_0,repo_1` (the dataset folders)."""
        return self.label or f"{self.program} {','.join(Path(d).name for d in self.datasets)}"

    def refusal(self) -> str | None:
        """What makes this job one its program cannot run (its shape), or None: checked before any launch."""
        spec = self.spec
        if not spec.several_datasets and len(self.datasets) != 1:
            return f"{self.program} takes exactly one dataset, got {len(self.datasets)}"
        if spec.needs_checkpoint and self.checkpoint is None:
            return f"{self.program} needs a checkpoint"
        for name, flag in self.TAKEN_IF.items():
            if getattr(self, name) not in (None, ()) and not getattr(spec, flag):
                return f"{self.program} takes no --{_flag(self, name)}"
        return None

    def index_request(self) -> IndexRequest | None:
        """The premise index this evaluation also writes, if any."""
        if self.index is None:
            return None
        return IndexRequest(self.index, self.index_datasets or self.datasets, self.index_after)

    @classmethod
    def rank_fields(cls) -> list[str]:
        """The fields the ranks receive, in their command line's order (the program is its first word)."""
        return [name for name in cls.model_fields if name != "program" and name not in cls.LAUNCHER_FIELDS]

    def to_argv(self) -> list[str]:
        """The rank program's command line: `train --config C --dataset D --out O ...`, every path absolute."""
        argv = [self.program]
        for name in self.rank_fields():
            value = getattr(self, name)
            for item in value if isinstance(value, tuple) else () if value is None else (value,):
                argv += [f"--{_flag(self, name)}", str(Path(item).resolve())]
        return argv

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None) -> JobRequest:
        """The request `to_argv` wrote (a bad command line exits 2 with argparse's usage line, as any command)."""
        parser = argparse.ArgumentParser(prog=f"python -m {PROGRAMS_MODULE}")
        parser.add_argument("program", choices=list(PROGRAMS))
        for name in cls.rank_fields():
            field = cls.model_fields[name]
            several = typing.get_origin(field.annotation) is tuple
            parser.add_argument(f"--{_flag(cls, name)}", dest=name, type=_absolute, required=field.is_required(),
                                action="append" if several else "store", help=field.description)
        args = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in args.items()})


def _absolute(text: str) -> Path:
    return Path(text).resolve()


def _flag(model: JobRequest | type[JobRequest], name: str) -> str:
    """A field's flag on a command line (the rank's, the CLI's): its alias, or its name, with dashes."""
    field = type(model).model_fields[name] if isinstance(model, JobRequest) else model.model_fields[name]
    return (field.alias or name).replace("_", "-")


def result_filename(node_rank: int = 0) -> str:
    """Global rank 0 writes result.json; local rank 0 of every other node its own file (job folders may be shared)."""
    return "result.json" if node_rank == 0 else f"result.node{node_rank}.json"


# ---- heartbeats -----------------------------------------------------------------------------------

def heartbeat_dir(job_dir: Path) -> Path:
    return Path(job_dir) / "heartbeat"


def beat(job_dir: Path, stage: str, step: int | None = None, progress: dict[str, Any] | None = None) -> None:
    """This rank is alive, in `stage`; rank 0 adds where the job is (`progress`), for the launcher to show.

    With the seed's one-year collective timeout a stuck all-reduce is never noticed by torch; a file
    that stops changing is, by the launcher's watchdog.
    """
    rank = global_rank()
    record: dict[str, Any] = {"rank": rank, "time": time.time(), "stage": stage, "step": step}
    if progress is not None:
        record["progress"] = progress
    write_json_atomic(heartbeat_dir(job_dir) / f"rank{rank}.json", record)


def read_progress(job_dir: Path) -> dict[str, Any] | None:
    """Rank 0's latest progress snapshot, or None (no beat yet, or one without progress)."""
    try:
        progress = read_json_file(heartbeat_dir(job_dir) / "rank0.json", MIB).get("progress")
    except (JsonFileError, AttributeError):
        return None
    return progress if isinstance(progress, dict) else None


def stale_ranks(job_dir: Path, timeout_s: float, now: float | None = None) -> list[str]:
    """Ranks whose heartbeat file exists and has not changed for `timeout_s` seconds."""
    now = time.time() if now is None else now
    folder = heartbeat_dir(job_dir)
    if not folder.is_dir():
        return []
    stale = []
    for f in sorted(folder.glob("rank*.json")):
        try:
            age = now - f.stat().st_mtime
        except FileNotFoundError:
            continue
        if age > timeout_s:
            stale.append(f"{f.stem} ({age:.0f} s)")
    return stale
