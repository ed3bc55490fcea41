"""The lifelong curriculum as LeanAgent describes it, one repository after another.

Read top to bottom: check everything, order the repositories, then per repository train from the
previous repository's checkpoint (the newest, as LeanAgent, or the best; EWC-anchored by its
Fisher when `ewc_lambda > 0`), compute the new Fisher, and evaluate on every repository seen so far.
Each stage is recorded in the run manifest as soon as it finishes, so a rerun of the same config
skips it without touching its files.
"""

# No `from __future__ import annotations` here: Prefect builds a pydantic model of the flow's signature
# to validate parameters, and string annotations fail to resolve when a served runner loads the flow.
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import Task, flow, get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.exceptions import Abort, ExternalSignal

from leanagent.checkpoints import prune_checkpoints
from leanagent.config import ConfigError, PipelineConfig, RepoConfig, dump_config, load_config, resolve_paths
from leanagent.dataset_strategy import training_datasets
from leanagent.preflight import preflight_run
from leanagent.report import RunReport
from leanagent.run_state import (
    EVAL_UNTRAINED,
    FISHER,
    TRAIN,
    ManifestMismatchError,
    RunLock,
    RunLockedError,
    RunState,
    eval_stage,
    repo_key,
    stage_name,
)
from leanagent.train.jobs import JobInputError
from leanagent.train.launch import LaunchError
from leanagent.train.supervision import HoldSignals
from tasks.data import DatasetValidationError, order_curriculum, validate_datasets
from tasks.jobs import compute_fisher, evaluate_retriever, train_retriever
from tasks.options import JobOptions

TABLE_KEY = "lifelong-retrieval-results"
PROGRESS_KEY = "lifelong-retrieval-progress"
SUMMARY_KEY = "lifelong-retrieval-summary"
# The temporary server's defaults, under any value the user set (environment, profile, prefect.toml: Prefect
# passes those to the server's environment after these). Its telemetry service writes a session row into the
# fresh SQLite database while the server's other services and the flow's first calls write too, and the
# "database is locked" it can hit is logged as a long traceback; a throwaway local server has nothing to report.
TEMPORARY_SERVER_DEFAULTS = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
BAD_INPUT = (ConfigError, DatasetValidationError, ManifestMismatchError, RunLockedError, JobInputError)
# A stage stopped from outside, not failed: Ctrl-C or SIGTERM (the CLI's handlers raise KeyboardInterrupt
# subclasses), Prefect's TerminationSignal (a runner's cancel or any SIGTERM to a flow-run process), an
# orchestrator's Abort, a cancelled coroutine, sys.exit. The launcher has ended the job by then.
INTERRUPTS = (KeyboardInterrupt, SystemExit, ExternalSignal, Abort, asyncio.CancelledError)


def describe_interrupt(exc: BaseException) -> str:
    """`SIGTERM (TerminationSignal)`, `SIGINT (Interrupted)`, `KeyboardInterrupt`, `Abort: ...`."""
    signum = getattr(exc, "signum", None) or getattr(exc, "signal", None)
    if isinstance(signum, int):
        try:
            return f"{signal.Signals(signum).name} ({type(exc).__name__})"
        except ValueError:
            pass
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def resolve_config(config: PipelineConfig | None, config_path: str | None) -> PipelineConfig:
    """Exactly one source; a config given inline (UI form, Python) resolves relative paths against the cwd."""
    if (config is None) == (config_path is None):
        raise ConfigError("give exactly one of `config` and `config_path`")
    if config_path is not None:
        return load_config(config_path)
    return resolve_paths(config, Path.cwd())


def run_stage(state: RunState, name: str, task: Task[..., dict], options: JobOptions,
              artifacts: "_Artifacts | None" = None, **kwargs: Any) -> dict:
    """Skip a stage the manifest has finished; otherwise run its task and record the outcome either way."""
    done = state.stage_done(name)
    if done is not None:
        get_run_logger().info(f"{name}: finished in an earlier run; skipped")
        if artifacts is not None:
            artifacts.stages_done([name], publish=False)
        return done
    state.start(name)
    if artifacts is not None:
        artifacts.stages_running([name])
    try:
        result = task.with_options(task_run_name=name, retries=options.retries,
                                   retry_delay_seconds=options.retry_delay_s)(**kwargs)
    except INTERRUPTS as exc:
        with HoldSignals():  # a second signal must not cut the record short and leave the stage "running"
            state.interrupt(name, describe_interrupt(exc))
        raise
    except BaseException as exc:
        with HoldSignals():
            state.fail(name, f"{type(exc).__name__}: {exc}")
        raise
    state.record(name, result)
    if artifacts is not None:
        artifacts.stages_done([name])
    return result


def run_evaluations(state: RunState, stages: list[tuple[str, Path]], out: Path, checkpoint: Path | None,
                    options: JobOptions, artifacts: "_Artifacts | None" = None, **kwargs: Any) -> list[dict]:
    """Evaluate one model on several repositories in ONE job, each recorded as its own stage.

    One torchrun start and one model load per repository stage, so a run of T repositories
    launches T + 1 evaluation jobs, not T(T+1)/2 + T. Finished stages are skipped; the job folder
    is named by the stages it runs, so a rerun after a partial record never mixes two sets.
    """
    logger = get_run_logger()
    pending, numbers = [], []
    for k, (name, dataset) in enumerate(stages):
        if state.stage_done(name) is not None:
            logger.info(f"{name}: finished in an earlier run; skipped")
            if artifacts is not None:
                artifacts.stages_done([name], publish=False)
        else:
            pending.append((name, dataset))
            numbers.append(f"{k:02d}")
    if pending:
        suffix = "-".join(numbers)
        for name, _ in pending:
            state.start(name)
        if artifacts is not None:
            artifacts.stages_running([name for name, _ in pending])
        try:
            result = evaluate_retriever.with_options(
                task_run_name=f"{out.parent.name}/{out.name}-{suffix}", retries=options.retries,
                retry_delay_seconds=options.retry_delay_s,
            )(datasets=[d for _, d in pending], out=out.with_name(f"{out.name}-{suffix}"), checkpoint=checkpoint,
              **kwargs)
        except INTERRUPTS as exc:
            with HoldSignals():
                for name, _ in pending:
                    state.interrupt(name, describe_interrupt(exc))
            raise
        except BaseException as exc:
            with HoldSignals():
                for name, _ in pending:
                    state.fail(name, f"{type(exc).__name__}: {exc}")
            raise
        for (name, _), evaluation in zip(pending, result["evaluations"], strict=True):
            state.record(name, {**evaluation, "checkpoint": result["checkpoint"],
                                "world_size": result["world_size"]})
        if artifacts is not None:
            artifacts.stages_done([name for name, _ in pending])
    return [state.stage_done(name) for name, _ in stages]


def stage_count(repositories: int) -> int:
    """Untrained evaluations (one per repository), then per repository i: train, Fisher, i + 1 evaluations."""
    return repositories + 2 * repositories + repositories * (repositories + 1) // 2


class _Artifacts:
    """The table and summary artifacts, refreshed after each repository: a run of days shows its recall matrix
    and lifelong metrics as they grow, not only at the end. The progress artifact moves with every stage and
    names the one running, so the UI tells which job a long run is in."""

    def __init__(self, report: RunReport, manifest: Path) -> None:
        self.report = report
        self.manifest = manifest
        self.total = stage_count(len(report.names))
        self.done: set[str] = set()
        self.progress_id: UUID = create_progress_artifact(
            progress=0.0, key=PROGRESS_KEY, description=f"0 of {self.total} stages done")

    def _publish(self, description: str) -> None:
        update_progress_artifact(self.progress_id, progress=100.0 * len(self.done) / self.total,
                                 description=description)

    def stages_running(self, names: list[str]) -> None:
        self._publish(f"running {', '.join(names)} ({len(self.done)} of {self.total} stages done)")

    def stages_done(self, names: list[str], publish: bool = True) -> None:
        """`publish=False` for stages skipped as finished: the next running stage's update counts them."""
        self.done.update(names)
        if publish:
            self._publish(f"{len(self.done)} of {self.total} stages done" if len(self.done) < self.total
                          else f"all {self.total} stages done")

    def repository_done(self) -> None:
        done, total = len(self.report.rows), len(self.report.names)
        create_table_artifact(table=self.report.rows, key=TABLE_KEY,
                              description=f"Recall per repository after training on it ({done} of {total} done)")
        publish_summary(self.report, self.manifest)
        if len(self.done) >= self.total:  # a rerun that skipped every stage still ends at 100 %
            self.stages_done([])


def publish_summary(report: RunReport, manifest: Path) -> None:
    create_markdown_artifact(markdown=report.markdown(str(manifest)), key=SUMMARY_KEY,
                             description="Lifelong retrieval: recall per repository, recall matrix, lifelong metrics")


@flow(name="lifelong-retrieval")
def lifelong_retrieval(config: PipelineConfig | None = None, config_path: str | None = None,
                       options: JobOptions | None = None) -> dict:
    """Train the premise retriever over the configured repositories, lifelong, and report recall."""
    cfg = resolve_config(config, config_path)
    options = options or JobOptions()
    preflight_run(cfg)  # model, devices, rendezvous, disk: before anything is written (datasets: below)
    start = cfg.lifelong.start_checkpoint
    if start is not None and not start.exists():
        raise ConfigError(f"lifelong.start_checkpoint: {start}: no such checkpoint file or folder")
    with RunLock(cfg.run_dir):
        # Open the manifest before writing anything: a mismatched run_dir must stay untouched.
        state = RunState(cfg.run_dir, cfg)
        # Not config.yaml: a user may keep their own config in run_dir, and it must not be overwritten.
        config_file = cfg.run_dir / "leanagent-run-config.yaml"
        dump_config(cfg, config_file)  # every rank reads the config from this file
        validate_datasets(cfg.repos, cfg.data.split)
        ordered = order_curriculum(cfg.repos, cfg.lifelong.curriculum, cfg.data.split)
        state.set_order([r.display_name for r in ordered], [r.path for r in ordered])
        report = _run_curriculum(cfg, config_file, ordered, state, options)
    return {"rows": report.rows, "matrix": report.matrix, "baseline": report.baseline, "order": report.names,
            "lifelong": report.lifelong_metrics(), "manifest": str(state.path), "run_dir": str(cfg.run_dir)}


def training_data(cfg: PipelineConfig, ordered: list[RepoConfig], state: RunState) -> list[Path]:
    """Stage i's training and Fisher dataset: repository i itself (`single`), or repositories 0..i merged
    (`merge_all`, written once under run_dir and recorded in the manifest). Evaluation always uses each
    repository's own test split."""
    return training_datasets(cfg, [r.display_name for r in ordered], [r.path for r in ordered], state,
                             log=get_run_logger().info)


def _run_curriculum(cfg: PipelineConfig, config_file: Path, ordered: list[RepoConfig], state: RunState,
                    options: JobOptions) -> RunReport:
    names = [r.display_name for r in ordered]
    datasets = training_data(cfg, ordered, state)
    report = RunReport(names)
    artifacts = _Artifacts(report, state.path)
    jobs = cfg.run_dir / "jobs"
    ewc = cfg.lifelong.ewc_lambda > 0
    # Validated once above; the jobs need not re-read every dataset (evaluation would do it n^2 times).
    common = {"cfg": cfg, "config_path": config_file, "heartbeat_timeout_s": options.heartbeat_timeout_s,
              "validate": False}
    # The starting model (model.name_or_path, or lifelong.start_checkpoint) on every test split: the row that
    # training gains and transfers are measured from.
    report.set_baseline(run_evaluations(
        state, [(stage_name(j, r.display_name, EVAL_UNTRAINED), r.path) for j, r in enumerate(ordered)],
        jobs / "untrained" / "evaluate", cfg.lifelong.start_checkpoint, options, artifacts,
        timeout_s=options.evaluate_timeout_s, **common))
    checkpoint: Path | None = cfg.lifelong.start_checkpoint  # None: start from model.name_or_path
    fisher: Path | None = None
    for i, repo in enumerate(ordered):
        name = stage_name(i, repo.display_name, TRAIN)
        train = run_stage(state, name, train_retriever, options, artifacts, dataset=datasets[i], out=jobs / name,
                          checkpoint=checkpoint, fisher=fisher if ewc else None, timeout_s=options.train_timeout_s,
                          **common)
        checkpoint = Path(train["checkpoint"])  # the newest (LeanAgent) or the best: lifelong.checkpoint
        # Always, as LeanAgent does, so that EWC can be switched on for a later repository.
        name = stage_name(i, repo.display_name, FISHER)
        result = run_stage(state, name, compute_fisher, options, artifacts, dataset=datasets[i], out=jobs / name,
                           checkpoint=checkpoint, timeout_s=options.fisher_timeout_s, **common)
        fisher = Path(result["fisher"])
        evaluations = run_evaluations(
            state, [(stage_name(i, repo.display_name, eval_stage(j, seen.display_name)), seen.path)
                    for j, seen in enumerate(ordered[: i + 1])],
            jobs / repo_key(i, repo.display_name) / "evaluate", checkpoint, options, artifacts,
            timeout_s=options.evaluate_timeout_s, **common)
        report.add_repository(i, train, evaluations)
        if cfg.lifelong.keep_checkpoints == "best_and_last":  # its stages are done: keep start, best, last
            get_run_logger().info(f"{repo.display_name}: deleted {len(prune_checkpoints(train))} other checkpoint(s)")
        artifacts.repository_done()
    return report


def run_from_cli(config_path: str) -> int:
    """`leanagent run --config FILE`: the flow in this process, then a plain-text summary.

    1 on bad input, 2 when a job failed after its retries, 128 + signal (130 Ctrl-C, 143 SIGTERM) when
    interrupted: every job has been ended by then and the running stage is recorded `interrupted`.
    """
    try:
        load_config(config_path)  # fail in milliseconds, before Prefect starts a temporary server
        start_temporary_server_bound_to_this_process()
        summary = lifelong_retrieval(config_path=config_path)
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except LaunchError as exc:
        print(f"error: a job failed after its retries: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, ExternalSignal) as exc:
        code = getattr(exc, "exit_code", None) or 128 + int(getattr(exc, "signal", signal.SIGINT))
        print(f"interrupted by {describe_interrupt(exc)}: every job was ended; rerun the same command to resume",
              file=sys.stderr)
        return code
    report = RunReport(summary["order"], summary["rows"], summary["matrix"], summary["baseline"])
    print(report.text())
    print(f"\nmanifest: {summary['manifest']}")
    return 0


def start_temporary_server_bound_to_this_process() -> None:
    """Start Prefect's temporary local server ourselves, so that it dies with this process.

    With no PREFECT_API_URL, Prefect's first client starts a server as a plain child process
    (`prefect.server.api.server.SubprocessASGIServer`, uvicorn) and stops it from an atexit hook: a
    SIGKILL of this process (the OOM killer) orphans it. We create that same singleton first, from
    this (main) thread, with the parent-death signal set in the uvicorn child (`prctl(PR_SET_PDEATHSIG,
    SIGTERM)`, leanagent/train/supervision.py), so the kernel ends it when we die, however we die.
    Prefect's own code then finds it running (`SubprocessASGIServer()` returns the one instance) and
    uses it. A no-op with a configured server, or if Prefect's internals are not the ones expected.
    """
    import types

    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    import prefect.server.api.server as server_module

    from leanagent.train.supervision import parent_death_signal

    base = getattr(server_module, "SubprocessASGIServer", None)
    preexec = parent_death_signal(signal.SIGTERM)
    if (base is None or preexec is None or not hasattr(base, "_run_uvicorn_command")
            or not isinstance(getattr(base, "_instances", None), dict) or None in base._instances
            or not isinstance(getattr(server_module, "subprocess", None), types.ModuleType)):
        return

    class ServerBoundToThisProcess(base):  # type: ignore[misc, valid-type]
        def _run_uvicorn_command(self):  # type: ignore[no-untyped-def]
            real = server_module.subprocess
            bound = types.ModuleType(real.__name__)
            bound.__dict__.update(real.__dict__)
            bound.Popen = lambda *args, **kwargs: real.Popen(*args, **{
                "preexec_fn": preexec, **kwargs,
                "env": {**TEMPORARY_SERVER_DEFAULTS, **(kwargs.get("env") or os.environ)}})
            server_module.subprocess = bound  # only `_run_uvicorn_command` reads it, and only here
            try:
                return super()._run_uvicorn_command()
            finally:
                server_module.subprocess = real

    ServerBoundToThisProcess().start()
