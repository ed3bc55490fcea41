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
import signal
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
from prefect.states import Failed, State

from leanagent.checkpoints import prune_checkpoints
from leanagent.config import ConfigError, PipelineConfig, RepoConfig, dump_config, load_config, resolve_paths
from leanagent.dataset_strategy import training_datasets
from leanagent.job import JobInputError
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
from leanagent.supervision import HoldSignals
from tasks.data import order_curriculum
from tasks.jobs import compute_fisher, evaluate_retriever, train_retriever
from tasks.options import JobOptions

TABLE_KEY = "lifelong-retrieval-results"
PROGRESS_KEY = "lifelong-retrieval-progress"
SUMMARY_KEY = "lifelong-retrieval-summary"
BAD_INPUT = (ConfigError, ManifestMismatchError, RunLockedError, JobInputError)
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
    """Train the premise retriever over the configured repositories, lifelong, and report what it learned and forgot.

    Every input is checked before anything is written or launched; a refused run ends Failed with the
    reason as its message (no job, no file). Rerunning the same config resumes it: finished stages are
    skipped, an interrupted training job goes on from its last checkpoint.

    Args:
        config: The whole experiment (model, data, trainer, lifelong, run_dir, repos), as a form. Relative
            paths resolve against the worker's working directory. Give this or `config_path`, not both.
        config_path: A YAML config file (e.g. configs/demo.yaml), relative to the worker's working directory;
            relative paths inside it resolve against the file's folder.
        options: How jobs are supervised, not what they compute: retries, per-job deadlines and the
            heartbeat timeout. Default: 2 retries, no deadline, a 1-hour heartbeat timeout.
    """
    try:
        cfg = resolve_config(config, config_path)
        preflight_run(cfg)  # model, devices, rendezvous, disk, every dataset: before anything is written
        ordered = order_curriculum(cfg.repos, cfg.lifelong.curriculum, cfg.data.split)
        RunState.check(cfg.run_dir, cfg, [r.display_name for r in ordered])  # a run_dir of another experiment
        lock = RunLock(cfg.run_dir).acquire()
    except BAD_INPUT as exc:
        return refused(exc)
    with lock:
        state = RunState(cfg.run_dir, cfg)
        # Not config.yaml: a user may keep their own config in run_dir, and it must not be overwritten.
        config_file = cfg.run_dir / "leanagent-run-config.yaml"
        dump_config(cfg, config_file)  # every rank reads the config from this file
        state.set_order([r.display_name for r in ordered], [r.path for r in ordered])
        try:
            datasets = training_data(cfg, ordered, state)  # merge_all: the merged datasets, checked before any job
        except BAD_INPUT as exc:
            return refused(exc)
        report = _run_curriculum(cfg, config_file, ordered, datasets, state, options or JobOptions())
    return {"rows": report.rows, "matrix": report.matrix, "baseline": report.baseline, "order": report.names,
            "lifelong": report.lifelong_metrics(), "manifest": str(state.path), "run_dir": str(cfg.run_dir)}


# The messages of this process's refused runs: `leanagent run` prints each once itself (see `_NotTwice`).
REFUSALS: list[str] = []


def refused(exc: Exception) -> State:
    """The flow run's end for bad input: Failed, with the reason as its message (what the UI shows), and no
    traceback logged, since nothing went wrong inside. Calling the flow raises `exc` itself."""
    REFUSALS.append(str(exc))
    return Failed(message=str(exc), data=exc)


def training_data(cfg: PipelineConfig, ordered: list[RepoConfig], state: RunState) -> list[Path]:
    """Stage i's training and Fisher dataset: repository i itself (`single`), or repositories 0..i merged
    (`merge_all`, written once under run_dir and recorded in the manifest). Evaluation always uses each
    repository's own test split."""
    return training_datasets(cfg, [r.display_name for r in ordered], [r.path for r in ordered], state,
                             log=get_run_logger().info)


def _run_curriculum(cfg: PipelineConfig, config_file: Path, ordered: list[RepoConfig], datasets: list[Path],
                    state: RunState, options: JobOptions) -> RunReport:
    names = [r.display_name for r in ordered]
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
