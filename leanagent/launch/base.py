"""The launcher seam: what every way of starting a job's ranks shares, and what each must provide.

A launcher starts one rank program (`leanagent.ground.job.PROGRAMS_MODULE`, under torchrun) on the machines it
knows and hands back a `RunningJob`; `Launcher.launch` then watches it to the end, the same way for
every launcher:

- every output line goes to `on_line`, rank lines as `[rank N] ...` (torchrun prefixes them), less
  known third-party noise unless LEANAGENT_VERBOSE is set (`quiet.py`; the rank logs under JOB/logs/
  keep everything), plus rank 0's progress as a bar or `[progress] ...` lines (`output.py`, `progress_view.py`);
- a deadline (`timeout_s`) and a heartbeat watchdog (`heartbeat_timeout_s`: with the seed's one-year
  collective timeout only a file that stops changing reveals a hung rank) end the job;
- an interrupt of the launching thread (Ctrl-C, SIGTERM, a Prefect cancel) ends the job before it
  propagates: nothing of a job outlives whoever launched it;
- a failure names the failing rank with its last lines (`LaunchError`); success returns `result.json`, read as the
  job's program's result model.

A launcher is one module: `leanagent/launch/NAME.py` (or an installed package's `leanagent.launchers` entry
point) whose module-level `PLUGIN`, a `LauncherPlugin`, holds everything launcher-specific: its config section,
its checks, its `Launcher`, and what `leanagent status` and `cancel` ask of it. The config's `launcher: NAME`
picks it (`leanagent.launch.registry`). This module imports nothing heavy (no torch): the launcher side runs on
a login node or a Prefect worker as well as beside the ranks.
"""

from __future__ import annotations

import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from leanagent.ground.config import PipelineConfig, dump_config
from leanagent.ground.job import JobRequest, heartbeat_dir, result_filename, stale_ranks
from leanagent.ground.results import JobResult, ResultUnreadableError, read_result
from leanagent.ground.supervision import SUPERVISION_ENV, pids_dir
from leanagent.launch.output import JobOutput

SCRUBBED_ENV = (
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS", *SUPERVISION_ENV,
)
GRACE_SECONDS = 30.0
# Ending a job because the launcher was interrupted: Prefect's runner SIGKILLs a cancelled flow-run process 30 s
# after its SIGTERM, and the job must be over (and the stage recorded) before that. Under Lightning 2.6 the grace
# buys little anyway: its SIGTERM handler broadcasts from inside the handler, which can deadlock the ranks.
INTERRUPT_GRACE_SECONDS = 10.0
POLL_SECONDS = 0.5  # how long one wait for output lasts: the deadline and heartbeat checks run this often
OUTPUT_AFTER_EXIT_SECONDS = 5.0  # keep reading this long after the job ended, for output still on its way
CONFIG_FILE = "config.yaml"  # the job's config as its ranks read it, in the attempt's log folder


class LaunchError(RuntimeError):
    """A rank program failed, or the job was ended by a deadline, a stale heartbeat or an interrupt."""

    def __init__(self, message: str, failing_rank: int | None = None, tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.failing_rank = failing_rank
        self.tail = list(tail)


class RunningJob(ABC):
    """A started job, as its launcher sees it: its output, its end, and how to end it."""

    @abstractmethod
    def read(self, timeout_s: float) -> bytes | None:
        """Output that arrived within `timeout_s` (b"" if none); None once the output has ended."""

    @abstractmethod
    def exit_code(self) -> int | None:
        """The job's exit code once it has ended, None while it runs (cheap: called every poll)."""

    @abstractmethod
    def refresh(self) -> None:
        """Bookkeeping between polls (a local job looks for new processes; a SLURM job asks the queue)."""

    @abstractmethod
    def wait(self) -> int:
        """Block until the job has ended; its exit code."""

    @abstractmethod
    def end(self, grace_s: float, emit: Callable[[str], None], interrupted: bool = False) -> None:
        """Stop every process of the job: ask, wait up to `grace_s`, then force. Returns when none is left."""


class Launcher(ABC):
    """Starts a rank program's processes and watches them to the end (`launch`)."""

    node_rank: int = 0  # the node whose result file this launcher reads (a static multi-node job)
    devices: int = 1  # ranks per node, for the environment of the ranks

    @abstractmethod
    def start(self, program_args: Sequence[str], job_dir: Path, log_dir: Path, label: str) -> RunningJob:
        """Start the job's processes; their output must reach `RunningJob.read`, each rank's also `log_dir`.

        `label` is what the job is called (`train PFR`: the program and the repositories' configured names), for
        whatever the launcher names after it (a SLURM job's name).
        """

    def launch(self, job: JobRequest, on_line: Callable[[str], None] | None = None, grace_s: float = GRACE_SECONDS,
               progress_interval_s: float | None = None) -> JobResult:
        """Run `job` to completion, within its deadlines, and return its result as its program's model.

        Its ranks read its config from the copy written for this attempt (`JOB/logs/attempt-.../config.yaml`): a
        file the launcher owns, so nothing of the user's is overwritten, and a SLURM job requeued later still
        finds the config it was started with."""
        log_dir = attempt_dir(job.out)
        log_dir.mkdir(parents=True, exist_ok=True)
        dump_config(job.config, log_dir / CONFIG_FILE)
        path = self.supervise(job.to_argv(log_dir / CONFIG_FILE), job.out, on_line, job.timeout,
                              job.heartbeat_timeout, grace_s, progress_interval_s, job.title, log_dir)
        try:
            return read_result(path, job.spec.result)
        except ResultUnreadableError as exc:
            raise LaunchError(str(exc)) from None

    def supervise(self, program_args: Sequence[str], job_dir: Path, on_line: Callable[[str], None] | None = None,
                  timeout_s: float | None = None, heartbeat_timeout_s: float | None = None,
                  grace_s: float = GRACE_SECONDS, progress_interval_s: float | None = None,
                  label: str = "job", log_dir: Path | None = None) -> Path:
        """Start the rank program `program_args` (`start`) and watch it to its end (see the module docstring); the
        result file it wrote.

        `label` names the job in its progress lines (`train repo_new`: `JobRequest.title`); each rank's log goes
        into `log_dir` (default: a new `attempt-...` folder of `JOB/logs`).
        """
        job_dir = Path(job_dir)
        job_dir.mkdir(parents=True, exist_ok=True)
        # A retry reuses the job folder: the failed attempt's heartbeats are stale by now and must not count.
        shutil.rmtree(heartbeat_dir(job_dir), ignore_errors=True)
        shutil.rmtree(pids_dir(job_dir), ignore_errors=True)
        output = JobOutput(label, on_line, progress_interval_s)
        log_dir = log_dir or attempt_dir(job_dir)
        program = program_args[0] if program_args else "torchrun"
        started = time.monotonic()
        job = self.start(program_args, job_dir, log_dir, label)
        reason: str | None = None
        exited_at: float | None = None
        try:
            while True:
                chunk = job.read(POLL_SECONDS)
                if chunk is None:
                    break
                output.feed(chunk)
                output.show_progress(job_dir)
                job.refresh()
                now = time.monotonic()
                if job.exit_code() is not None:
                    # Stop reading soon after the job ends, even if an orphan still holds its output open.
                    exited_at = exited_at or now
                    if now - exited_at > OUTPUT_AFTER_EXIT_SECONDS:
                        break
                if timeout_s is not None and now - started > timeout_s:
                    reason = f"deadline of {timeout_s:.0f} s reached"
                    break
                if heartbeat_timeout_s is not None:
                    stale = stale_ranks(job_dir, heartbeat_timeout_s)
                    if stale:
                        reason = f"no heartbeat for {heartbeat_timeout_s:.0f} s from {', '.join(stale)}"
                        break
        except BaseException:
            output.emit("[launcher] interrupted: ending every process of the job")
            job.end(min(grace_s, INTERRUPT_GRACE_SECONDS), output.emit, interrupted=True)
            raise
        finally:
            output.close(job_dir)
        if reason is not None:
            output.emit(f"[launcher] {reason}: ending every process of the job")
            job.end(grace_s, output.emit)
            raise LaunchError(f"{program} job in {job_dir}: {reason}", None, output.launcher_tail)
        returncode = job.wait()
        # The job has exited: a rank it could not end (stopped, hung) or a forked child may still run.
        job.end(1.0, output.emit)
        if returncode != 0:
            raise LaunchError(*output.failure(program, job_dir, returncode))
        result_path = job_dir / result_filename(self.node_rank)
        if not result_path.is_file():
            raise LaunchError(f"{job_dir}: the job exited 0 but wrote no {result_path.name}", None,
                              output.launcher_tail)
        return result_path


def attempt_dir(job_dir: Path) -> Path:
    """The log folder of an attempt starting now."""
    return Path(job_dir) / "logs" / f"attempt-{time.strftime('%Y%m%d-%H%M%S')}"


def child_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for key in SCRUBBED_ENV:
        env.pop(key, None)
    # torchrun prefixes every worker line with its global rank, so the supervisor can attribute it.
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank ${rank}] "
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---- what a launcher module provides ------------------------------------------------------------------

Section = TypeVar("Section", bound=BaseModel)


def section_settings(cfg: PipelineConfig, name: str, model: type[Section]) -> Section:
    """The config's top-level section `name`, validated with `model` (absent or empty: its defaults)."""
    raw: Any = cfg.section(name)
    return raw if isinstance(raw, model) else model.model_validate(raw or {})


@dataclass(frozen=True)
class JobStatus:
    """One job of a run as its launcher's queue knows it, for `leanagent status` and `cancel`."""

    job_dir: Path  # the stage's job folder
    job_id: str  # the queue's id for it
    state: str  # as the queue says it, e.g. `PENDING (Resources)`, `RUNNING`, `COMPLETED`
    queued: bool  # still waiting or running: what a cancel would end


class LauncherPlugin(ABC):
    """Everything one launcher adds, found by its `name` (`leanagent.launch.registry`): `launcher: NAME`.

    A launcher module defines one as its module-level `PLUGIN`. `section` is the pydantic model of its settings,
    the config's top-level section `NAME:` (None: it takes none): config.py keeps that section as written, and
    the registry validates it with this model (an unknown key refused with the nearest known one) wherever a
    config is loaded for a run or a job. Only `launcher` must be written; the checks, `status` and `cancel` of a
    launcher without a queue of its own have nothing to say.
    """

    name: str = ""
    section: type[BaseModel] | None = None

    def settings(self, cfg: PipelineConfig) -> Any:
        """This launcher's section of `cfg`, validated (None for a launcher without one)."""
        return None if self.section is None else section_settings(cfg, self.name, self.section)

    @abstractmethod
    def launcher(self, cfg: PipelineConfig) -> Launcher:
        """The `Launcher` that starts `cfg`'s jobs."""

    def check_config(self, cfg: PipelineConfig) -> list[str]:
        """What this launcher needs of the rest of the config (`trainer.*`), read only: one line per problem."""
        return []

    def preflight(self, cfg: PipelineConfig, visible_gpus: Callable[[], int]) -> list[str]:
        """Where the ranks will run, asked before anything is launched: one line per problem.

        `visible_gpus()` counts the CUDA devices torch sees on this machine (the preflight asks torch: this
        layer imports none), for a launcher whose ranks run here.
        """
        return []

    def status(self, run_dir: Path) -> list[JobStatus]:
        """The jobs of the run in `run_dir` that this launcher has on record with a queue (latest per stage)."""
        return []

    def cancel(self, run_dir: Path) -> list[JobStatus]:
        """End every job of the run still in this launcher's queue; those it ended."""
        return []
