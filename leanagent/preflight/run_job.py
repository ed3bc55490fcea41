"""One job = one rank program (train, fisher or evaluate) in one job folder: checked, then launched.

The command line and the Prefect tasks both come through `run_job`, so the checks done before any
accelerator time is spent (the job's shape, then `leanagent.preflight.checks`: inputs, model, devices, disk,
a finished job folder) are the same for both, and so is the launcher the config names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from leanagent.ground.config import PipelineConfig
from leanagent.ground.job import (
    PROGRAMS,
    IndexRequest,
    JobFinishedError,
    JobInputError,
    Program,
    as_datasets,
    program_argv,
    result_filename,
)
from leanagent.ground.results import read_result
from leanagent.ground.timings import WALL_SECONDS
from leanagent.launch.registry import launcher_for
from leanagent.preflight.checks import preflight_job


def check_job(cfg: PipelineConfig, program: Program, dataset: Path | Sequence[Path], checkpoint: Path | None = None,
              fisher: Path | None = None, validate: bool = True, out: Path | None = None) -> None:
    """The job's shape here; its inputs, model, devices and disk in `leanagent.preflight.checks` (PreflightError)."""
    datasets = as_datasets(dataset)
    spec = PROGRAMS[program]
    if not datasets:
        raise JobInputError(f"{program} needs a dataset")
    if not spec.several_datasets and len(datasets) != 1:
        raise JobInputError(f"{program} takes exactly one dataset, got {len(datasets)}")
    if spec.needs_checkpoint and checkpoint is None:
        raise JobInputError(f"{program} needs a checkpoint")
    if fisher is not None and not spec.takes_fisher:
        raise JobInputError(f"{program} takes no Fisher file")
    preflight_job(cfg, program, datasets, out, checkpoint, fisher, validate=validate)


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
    label: str | None = None,
    index: IndexRequest | None = None,
) -> dict:
    """Check, launch, return `result.json`, with the wall time the caller waited for it (`wall_seconds`).

    `config_path` must hold `cfg` as YAML: each rank reads it. A job folder with a result is
    returned as is when `reuse_finished`, refused otherwise. A folder with checkpoints but no
    result is an interrupted training job: the train program resumes it from its newest checkpoint. `label` is
    what progress lines call the job (the flow gives the repositories' configured names; default: the program
    and the dataset folders' names). `index`: an evaluation also writes a premise index (`IndexRequest`).
    """
    out = Path(out)
    result_file = out / result_filename(cfg.trainer.node_rank)
    if result_file.is_file():
        if reuse_finished:
            return read_result(result_file)
        raise JobFinishedError(f"{result_file} exists: this job is finished; choose a new output folder "
                               f"(nothing was overwritten)")
    started = time.monotonic()
    check_job(cfg, program, dataset, checkpoint, fisher, validate=validate, out=out)
    if index is not None and program != "evaluate":
        raise JobInputError(f"{program} writes no premise index; evaluate does")
    argv = program_argv(program, config_path, dataset, out, checkpoint, fisher, index)
    result = launcher_for(cfg).launch(argv, out, on_line=on_line, timeout_s=timeout_s,
                                      heartbeat_timeout_s=heartbeat_timeout_s, label=label)
    # The job as its caller waited for it: the checks, the launch (torchrun, a SLURM queue) and the ranks' own time.
    result[WALL_SECONDS] = round(time.monotonic() - started, 3)
    return result
