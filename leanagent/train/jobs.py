"""One job = one rank program (train, fisher or evaluate) in one job folder, checked then launched.

The command line and the Prefect tasks both come through here, so the checks done before any
accelerator time is spent (config, dataset, input files, finished job) are the same for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from leanagent.atomic import read_json
from leanagent.config import PipelineConfig
from leanagent.train.launch import launch, result_filename

Program = Literal["train", "fisher", "evaluate"]


class JobInputError(ValueError):
    """Bad input found before launch; nothing was started and nothing was written."""


class JobFinishedError(FileExistsError):
    """The job folder already holds a result; a finished job is never overwritten."""


def as_datasets(dataset: Path | Sequence[Path]) -> list[Path]:
    """One dataset or several (evaluate scores a model on several in one job)."""
    return [Path(dataset)] if isinstance(dataset, (str, Path)) else [Path(d) for d in dataset]


def check_job(cfg: PipelineConfig, program: Program, dataset: Path | Sequence[Path], checkpoint: Path | None = None,
              fisher: Path | None = None, validate: bool = True, out: Path | None = None) -> None:
    """The job's shape here; its inputs, model, devices and disk in `leanagent.preflight` (PreflightError)."""
    from leanagent.preflight import preflight_job  # it imports JobInputError from here

    datasets = as_datasets(dataset)
    if not datasets:
        raise JobInputError(f"{program} needs a dataset")
    if program != "evaluate" and len(datasets) != 1:
        raise JobInputError(f"{program} takes exactly one dataset, got {len(datasets)}")
    if program == "fisher" and checkpoint is None:
        raise JobInputError("fisher needs a checkpoint")
    preflight_job(cfg, program, datasets, out, checkpoint, fisher, validate=validate)


def program_argv(program: Program, config_path: Path, dataset: Path | Sequence[Path], out: Path,
                 checkpoint: Path | None = None, fisher: Path | None = None) -> list[str]:
    argv = [program, "--config", str(Path(config_path).resolve())]
    for d in as_datasets(dataset):
        argv += ["--dataset", str(d.resolve())]
    argv += ["--out", str(Path(out).resolve())]
    if checkpoint is not None:
        argv += ["--checkpoint", str(Path(checkpoint).resolve())]
    if fisher is not None:
        argv += ["--fisher", str(Path(fisher).resolve())]
    return argv


def run_job(
    cfg: PipelineConfig,
    config_path: Path,
    program: Program,
    dataset: Path | Sequence[Path],
    out: Path,
    checkpoint: Path | None = None,
    fisher: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
    reuse_finished: bool = False,
    validate: bool = True,
) -> dict:
    """Check, launch under torchrun, return `result.json`.

    `config_path` must hold `cfg` as YAML: each rank reads it. A job folder with a result is
    returned as is when `reuse_finished`, refused otherwise. A folder with checkpoints but no
    result is an interrupted training job: the train program resumes it from `last.ckpt`.
    """
    out = Path(out)
    result_file = out / result_filename(cfg.trainer.node_rank)
    if result_file.is_file():
        if reuse_finished:
            return read_json(result_file)
        raise JobFinishedError(f"{result_file} exists: this job is finished; choose a new output folder "
                               f"(nothing was overwritten)")
    check_job(cfg, program, dataset, checkpoint, fisher, validate=validate, out=out)
    argv = program_argv(program, config_path, dataset, out, checkpoint, fisher)
    return launch(cfg.trainer, argv, out, on_line=on_line, timeout_s=timeout_s,
                  heartbeat_timeout_s=heartbeat_timeout_s).result
