"""The cost of a sweep: the same setups run as one sweep (its shared jobs once) and each alone, in one sitting.

`bench_sweep` writes repositories and a tiny encoder, then runs four setups of LeanAgent's Table 4 (single and merge
all, EWC off and on, in curriculum order) twice through the real commands, each in its own process: once as
`leanagent sweep` (`max_parallel` at once), once as four `leanagent run`s, one after the other. From the sweep's shared
folder and the runs' manifests it reads how many jobs each launched and the seconds those jobs took (each job's wall
time, as `leanagent report` counts it), times each whole command, and checks that every setup's stages have the
same metrics in the sweep as alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from leanagent.bench.cpu import BF16_FLAGS, this_cpu
from leanagent.bench.options import SweepOptions
from leanagent.bench.results import Section
from leanagent.data.synthetic import write_demo_repos
from leanagent.ground.job import PROGRAMS, result_filename
from leanagent.ground.results import EvaluateResult, read_result
from leanagent.launch.progress_view import MODE_ENV
from leanagent.model.presets import write_random_encoder
from leanagent.report.timing import JobCost, job_costs
from leanagent.run.manifest import MANIFEST_NAME, read_manifest
from leanagent.run.shared import shared_program
from leanagent.run.sweep import SHARED_DIR

# Four of Table 4's setups whose first repository is one job for all (single and merge all, EWC off and on).
SETUPS = {"leanagent": ["lifelong.dataset_strategy=single", "lifelong.ewc_lambda=0"],
          "setup3": ["lifelong.dataset_strategy=single", "lifelong.ewc_lambda=0.1"],
          "setup5": ["lifelong.dataset_strategy=merge_all", "lifelong.ewc_lambda=0"],
          "setup7": ["lifelong.dataset_strategy=merge_all", "lifelong.ewc_lambda=0.1"]}


@dataclass
class SweepFigures(Section):
    cpu: str
    flags: list[str]
    repos: int
    setups: int
    max_parallel: int
    sweep_jobs: int = 0  # jobs the sweep launched (its shared folder's)
    alone_jobs: int = 0  # the setups alone, summed
    sweep_job_seconds: float = 0.0
    alone_job_seconds: float = 0.0
    sweep_wall_seconds: float = 0.0  # `leanagent sweep`, its Prefect server's start included
    alone_wall_seconds: float = 0.0  # the four `leanagent run`s one after the other, each with its server
    same_results: bool | None = None  # every setup's stage metrics, sweep vs alone
    per_setup_alone: dict[str, float] = field(default_factory=dict)  # each `leanagent run`'s wall seconds

    def flat(self) -> dict:
        return {k if k.startswith("sweep_") else f"sweep_{k}": v for k, v in super().flat().items()}


def _base(work: Path, data: list[Path], model: Path, options: SweepOptions) -> dict:
    """The demo's trainer (the CPU's own precision, 2 ranks by default), LeanAgent's one epoch per repository."""
    return {"model": {"name_or_path": str(model), "lr": 2e-3, "warmup_steps": 10, "max_seq_len": 256},
            "data": {"batch_size": 8, "eval_batch_size": 32, "max_seq_len": 256, "num_workers": 0},
            "trainer": {"accelerator": options.accelerator, "devices": options.devices, "precision": "auto",
                        "accumulate_grad_batches": 1},
            "lifelong": {"epochs_per_repo": options.epochs},
            "run_dir": str(work / "unused"), "repos": [{"path": str(p)} for p in data]}


def _command(args: list[str], log: Path) -> float:
    """`leanagent ARGS` in its own process (the real flow and its temporary Prefect server); its wall seconds."""
    env = {**os.environ, MODE_ENV: "off"}
    env.pop("PREFECT_API_URL", None)  # each command on its own server, as a user's would be
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "leanagent.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                              env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"`leanagent {' '.join(args)}` failed (exit {proc.returncode}); see {log}")
    return time.monotonic() - started


def _stage_metrics(run_dir: Path) -> dict:
    manifest = read_manifest(run_dir / MANIFEST_NAME)
    return {f"{key}/{stage}": entry.result.metrics if isinstance(entry.result, EvaluateResult) else None
            for key, repo in manifest.repos.items() for stage, entry in repo.stages.items()}


def bench_sweep(options: SweepOptions) -> SweepFigures:
    with tempfile.TemporaryDirectory(prefix="leanagent-sweep-") as tmp:
        work = Path(options.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = write_demo_repos(work / "data", options.repos, theorems_per_repo=options.theorems, scale=2)
        model = write_random_encoder(work / "model", options.preset)
        base = work / "base.yaml"
        base.write_text(yaml.safe_dump(_base(work, data, model, options), sort_keys=False))
        cpu = this_cpu()
        figures = SweepFigures(cpu.name, cpu.having(BF16_FLAGS), options.repos, len(SETUPS), options.max_parallel)
        sweep = work / "sweep.yaml"
        sweep.write_text(yaml.safe_dump({"base": "base.yaml", "sweep_dir": "sweep",
                                         "max_parallel": options.max_parallel, "setups": SETUPS}, sort_keys=False))
        figures.sweep_wall_seconds = _command(["sweep", "--config", str(sweep)], work / "sweep.log")
        shared = sorted(p for p in (work / "sweep" / SHARED_DIR / "jobs").iterdir() if p.is_dir())
        figures.sweep_jobs = len(shared)
        costs = [JobCost.of(p.name, read_result(p / result_filename(), PROGRAMS[shared_program(p)].result))
                 for p in shared]
        figures.sweep_job_seconds = sum(c.total for c in costs if c is not None)
        same = True
        for name, overrides in SETUPS.items():
            run_dir = work / "alone" / name
            args = ["run", "--config", str(base), "--set", f"run_dir={run_dir}"]
            for item in overrides:
                args += ["--set", item]
            figures.per_setup_alone[name] = _command(args, work / f"{name}.log")
            costs = job_costs(read_manifest(run_dir / MANIFEST_NAME))
            figures.alone_jobs += len(costs)
            figures.alone_job_seconds += sum(c.total for c in costs)
            same = same and _stage_metrics(run_dir) == _stage_metrics(work / "sweep" / name)
        figures.alone_wall_seconds = sum(figures.per_setup_alone.values())
        figures.same_results = same
    return figures


def sweep_table(f: SweepFigures) -> str:
    head = (f"sweep: {f.setups} setups ({', '.join(SETUPS)}) on {f.repos} repositories, {f.max_parallel} at once; "
            f"{f.cpu}, bf16 flags: {', '.join(f.flags) or 'none'}; every setup's metrics the same in the sweep as "
            f"alone: {'yes' if f.same_results else 'NO'}")
    lines = [head, f"  {'':<22} {'jobs':>5} {'job seconds':>12} {'wall seconds':>13}"]
    lines.append(f"  {'each setup alone':<22} {f.alone_jobs:>5} {f.alone_job_seconds:>12.1f} "
                 f"{f.alone_wall_seconds:>13.1f}")
    lines.append(f"  {'one sweep':<22} {f.sweep_jobs:>5} {f.sweep_job_seconds:>12.1f} {f.sweep_wall_seconds:>13.1f}")
    lines.append(f"  the sweep: {f.alone_jobs - f.sweep_jobs} fewer jobs, "
                 f"{f.alone_job_seconds / max(1e-9, f.sweep_job_seconds):.2f}x fewer job seconds, "
                 f"{f.alone_wall_seconds / max(1e-9, f.sweep_wall_seconds):.2f}x less wall time")
    return "\n".join(lines)
