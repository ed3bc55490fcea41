"""One job, as both sides see it: the rank programs inside torchrun, and whoever launched and watches them.

A job is one rank program (train, fisher or evaluate) writing into one job folder. The two sides never
share memory, only this folder, so its protocol lives here, on the ground floor, with nothing heavy:

- the program's command line (`program_argv`): what the launcher starts, what `programs.main` parses;
- `result.json` (`result_filename`): written by rank 0 last, so its presence means the job is finished;
  `needs-resume.json` instead when the ranks were asked to stop (a time limit ahead) and saved a checkpoint;
- `heartbeat/rankN.json` (`beat`, `stale_ranks`, `read_progress`): each rank's liveness, and rank 0's
  progress snapshot, which the launcher's watchdog and progress display read;
- the errors a job's inputs or folder are refused with, before anything is launched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from leanagent.ground.atomic import read_json, write_json_atomic
from leanagent.ground.ranks import global_rank

Program = Literal["train", "fisher", "evaluate"]


@dataclass(frozen=True)
class ProgramSpec:
    """One rank program as every place that lists programs reads it: the CLI's command and flags, the checks before
    a launch, the rank's argument parser and the disk estimate."""

    name: str
    summary: str  # the command's line in `leanagent --help`
    several_datasets: bool  # evaluate scores one model on several datasets, loaded once
    needs_checkpoint: bool
    checkpoint_help: str
    takes_fisher: bool = False  # train: the previous repository's Fisher arms EWC
    takes_index: bool = False  # evaluate: also write the model's premise index
    writes: Literal["checkpoints", "fisher", "nothing large"] = "nothing large"


PROGRAMS: dict[str, ProgramSpec] = {spec.name: spec for spec in (
    ProgramSpec("train", "train the retriever on one repository (DDP under torchrun)", False, False,
                "the checkpoint training starts from (default: model.name_or_path)", takes_fisher=True,
                writes="checkpoints"),
    ProgramSpec("fisher", "compute the diagonal Fisher of a checkpoint on a repository", False, True,
                "the trained checkpoint whose Fisher is computed", writes="fisher"),
    ProgramSpec("evaluate", "R@1, R@10, MRR of a checkpoint on a repository's test split", True, False,
                "the checkpoint scored (default: the base model, model.name_or_path)", takes_index=True),
)}
PROGRAMS_MODULE = "leanagent.train.programs"  # what runs inside each rank: `python -m leanagent.train.programs ...`
PROGRAMS_ENTRY = ("-m", PROGRAMS_MODULE)  # the rank program on a python command line (launchers may replace it)
# A launcher that can be told to stop ahead of a time limit (SLURM) names a file here; when it appears the ranks
# save a step checkpoint at their next step, and rank 0 writes NEEDS_RESUME_FILE instead of result.json.
STOP_FILE_ENV = "LEANAGENT_STOP_FILE"
NEEDS_RESUME_FILE = "needs-resume.json"


class JobInputError(ValueError):
    """Bad input found before launch; nothing was started and nothing was written."""


class JobFinishedError(FileExistsError):
    """The job folder already holds a result; a finished job is never overwritten."""


def as_datasets(dataset: Path | Sequence[Path]) -> list[Path]:
    """One dataset or several (evaluate scores a model on several in one job)."""
    return [Path(dataset)] if isinstance(dataset, (str, Path)) else [Path(d) for d in dataset]


@dataclass(frozen=True)
class IndexRequest:
    """An evaluation job's premise index, written when its tests are done (`leanagent.index`): into `out`, of the
    union of `datasets`' corpora (in curriculum order: where two carry one file, the last one's version), its
    premise and module lists extending those of the index `after` (the previous stage's), when given."""

    out: Path
    datasets: tuple[Path, ...]
    after: Path | None = None

    def argv(self) -> list[str]:
        argv = ["--index", str(Path(self.out).resolve())]
        for d in self.datasets:
            argv += ["--index-dataset", str(Path(d).resolve())]
        if self.after is not None:
            argv += ["--index-after", str(Path(self.after).resolve())]
        return argv


def program_argv(program: Program, config_path: Path, dataset: Path | Sequence[Path], out: Path,
                 checkpoint: Path | None = None, fisher: Path | None = None,
                 index: IndexRequest | None = None) -> list[str]:
    """The rank program's arguments, every path absolute (the ranks may start in another folder, or node)."""
    argv = [program, "--config", str(Path(config_path).resolve())]
    for d in as_datasets(dataset):
        argv += ["--dataset", str(d.resolve())]
    argv += ["--out", str(Path(out).resolve())]
    if checkpoint is not None:
        argv += ["--checkpoint", str(Path(checkpoint).resolve())]
    if fisher is not None:
        argv += ["--fisher", str(Path(fisher).resolve())]
    if index is not None:
        argv += index.argv()
    return argv


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
        progress = read_json(heartbeat_dir(job_dir) / "rank0.json").get("progress")
    except (OSError, ValueError, AttributeError):
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
