"""The lifelong curriculum as LeanAgent describes it, one repository after another.

Read top to bottom: check everything (`leanagent.run.plan`), order the repositories the run does not have yet
and append them to those it has, then per repository train from the previous repository's checkpoint (the
newest, as LeanAgent, or the best; EWC-anchored by its Fisher when `ewc_lambda > 0`), compute the new Fisher,
and evaluate on every repository seen so far. Each stage is recorded in the run manifest as soon as it finishes
(`flows/stages.py`), so a rerun skips it without touching its files, and a config that lists more repositories
continues the run where it ended: repositories that arrive later are learned from the latest checkpoint.
"""

# No `from __future__ import annotations` here: Prefect builds a pydantic model of the flow's signature
# to validate parameters, and string annotations fail to resolve when a served runner loads the flow.
from pathlib import Path

from leanagent.flows.artifacts import RunArtifacts
from leanagent.flows.stages import run_evaluations, run_stage
from leanagent.tasks.data import order_curriculum
from leanagent.tasks.jobs import compute_fisher, train_retriever
from leanagent.tasks.options import JobOptions
from prefect import flow, get_run_logger
from prefect.states import Failed, State

from leanagent.checkpoints.files import prune_checkpoints
from leanagent.ground.config import ConfigError, PipelineConfig, RepoConfig, dump_config, resolve_paths
from leanagent.ground.job import IndexRequest
from leanagent.launch.registry import load_checked_config
from leanagent.report import RunReport, job_costs, report_from_manifest
from leanagent.run.manifest import (
    EVAL_UNTRAINED,
    FISHER,
    INDEX_DIR,
    TRAIN,
    eval_stage,
    repo_key,
    stage_indexes,
    stage_name,
)
from leanagent.run.plan import BAD_INPUT, UNRECORDED, RunPlan, plan_run, progress_line
from leanagent.run.state import RunLock, RunState
from leanagent.run.strategy import training_datasets

# The name of a refused run's final state (its type is FAILED): the UI tells it from a failure, and `leanagent
# run`, which prints the reason itself, keeps Prefect's console from repeating it.
REFUSED = "Refused"


def resolve_config(config: PipelineConfig | None, config_path: str | None) -> PipelineConfig:
    """Exactly one source; a config given inline (UI form, Python) resolves relative paths against the cwd."""
    if (config is None) == (config_path is None):
        raise ConfigError("give exactly one of `config` and `config_path`")
    if config_path is not None:
        return load_checked_config(config_path)
    return resolve_paths(config, Path.cwd())


@flow(name="lifelong-retrieval")
def lifelong_retrieval(config: PipelineConfig | None = None, config_path: str | None = None,
                       options: JobOptions | None = None) -> dict:
    """Train the premise retriever over the configured repositories, lifelong, and report what it learned and forgot.

    Every input is checked before anything is written or launched; a refused run ends Failed (state "Refused")
    with the reason as its message (no job, no file). Rerunning the same config resumes it: finished stages are
    skipped, an interrupted training job goes on from its last checkpoint. A config that lists more repositories
    (or a `repos_dir` with new folders) continues the run: only the new repositories' jobs run. With nothing new
    the run ends in seconds and says so.

    Args:
        config: The whole experiment (model, data, trainer, lifelong, run_dir, repos, repos_dir), as a form.
            Relative paths resolve against the worker's working directory. Give this or `config_path`, not both.
        config_path: A YAML config file (e.g. configs/demo.yaml), relative to the worker's working directory;
            relative paths inside it resolve against the file's folder.
        options: How jobs are supervised, not what they compute: retries, per-job deadlines and the
            heartbeat timeout. Default: 2 retries, no deadline, a 1-hour heartbeat timeout.
    """
    try:
        cfg = resolve_config(config, config_path)
        # Model, devices, disk, a run_dir of another experiment or a sequence the config does not extend, every
        # dataset not yet recorded: before anything is written.
        plan = plan_run(cfg)
        ordered = order_repositories(cfg, plan)
        lock = RunLock(cfg.run_dir).acquire()
    except BAD_INPUT as exc:
        return refused(exc)
    logger = get_run_logger()
    for item in plan.not_ready:
        logger.warning(item.line())
    not_ready = [item.line() for item in plan.not_ready]
    with lock:
        try:  # checked again under the lock: another run may have grown the sequence since `plan_run` read it
            state = RunState(cfg.run_dir, cfg)
            cfg = state.decided(cfg)  # `trainer.precision: auto`: the precision the run started in, if it has
            if ordered:
                state.extend([plan.entries[r.display_name] for r in ordered], plan.given)
        except BAD_INPUT as exc:
            return refused(exc)
        waiting = state.waiting()
        line = progress_line(len(ordered) - len(waiting), waiting, len(not_ready))
        if not waiting:
            logger.info(f"nothing new: {line}")
            report = report_from_manifest(state.data)
            RunArtifacts(report, state.path, not_ready).nothing_new(f"nothing new: {line}")
            return summary(report, state, cfg, not_ready, nothing_new=True)
        logger.info(line)
        # Not config.yaml: a user may keep their own config in run_dir, and it must not be overwritten.
        config_file = cfg.run_dir / "leanagent-run-config.yaml"
        dump_config(cfg, config_file)  # every rank reads the config from this file
        try:
            datasets = training_data(cfg, ordered, state)  # merge_all: the merged datasets, checked before any job
        except BAD_INPUT as exc:
            return refused(exc)
        try:
            report = _run_curriculum(cfg, config_file, ordered, datasets, state, options or JobOptions(), not_ready)
        except UNRECORDED as exc:  # one line, no traceback: the disk, not the code, went wrong
            return refused(exc)
    return summary(report, state, cfg, not_ready)


def order_repositories(cfg: PipelineConfig, plan: RunPlan) -> list[RepoConfig]:
    """The run's sequence: the repositories it has, in their places, then the new ones in curriculum order (the
    percentiles over all of them) or in the given order. Nothing new: no theorem is read."""
    by_name = {r.display_name: r for r in plan.repos}
    kept = [e.name for e in plan.recorded]
    if not plan.new:
        return [by_name[name] for name in kept]
    return order_curriculum(plan.repos, cfg.lifelong.curriculum, cfg.data.split, kept)


def summary(report: RunReport, state: RunState, cfg: PipelineConfig, not_ready: list[str],
            nothing_new: bool = False) -> dict:
    """What the flow returns: the report as plain data (what `leanagent run` prints) and where the run lives."""
    return {"rows": report.rows, "matrix": report.matrix, "baseline": report.baseline, "order": report.names,
            "lifelong": report.lifelong_metrics(), "manifest": str(state.path), "run_dir": str(cfg.run_dir),
            "not_ready": not_ready, "nothing_new": nothing_new}


def refused(exc: Exception) -> State:
    """The flow run's end for bad input: Failed (named REFUSED), with the reason as its message (what the UI shows),
    and no traceback logged, since nothing went wrong inside. Calling the flow raises `exc` itself."""
    return Failed(name=REFUSED, message=str(exc), data=exc)


def training_data(cfg: PipelineConfig, ordered: list[RepoConfig], state: RunState) -> list[Path]:
    """Stage i's training and Fisher dataset: repository i itself (`single`), or repositories 0..i merged
    (`merge_all`, written once under run_dir and recorded in the manifest). Evaluation always uses each
    repository's own test split."""
    return training_datasets(cfg, [r.display_name for r in ordered], [r.path for r in ordered], state,
                             log=get_run_logger().info)


def _run_curriculum(cfg: PipelineConfig, config_file: Path, ordered: list[RepoConfig], datasets: list[Path],
                    state: RunState, options: JobOptions, not_ready: list[str]) -> RunReport:
    names = [r.display_name for r in ordered]
    report = RunReport(names)
    artifacts = RunArtifacts(report, state.path, not_ready)
    jobs = cfg.run_dir / "jobs"
    ewc = cfg.lifelong.ewc_lambda > 0
    # Validated once above; the jobs need not re-read every dataset (evaluation would do it n^2 times).
    common = {"cfg": cfg, "config_path": config_file, "heartbeat_timeout_s": options.heartbeat_timeout_s,
              "validate": False}
    # The starting model (model.name_or_path, or lifelong.start_checkpoint) on every test split: the row that
    # training gains and transfers are measured from. A continued run scores it on its new repositories only.
    report.set_baseline(run_evaluations(
        state, [(stage_name(j, r.display_name, EVAL_UNTRAINED), r.display_name, r.path) for j, r in enumerate(ordered)],
        jobs / "untrained" / "evaluate", cfg.lifelong.start_checkpoint, options, artifacts,
        timeout_s=options.evaluate_timeout_s, **common))
    checkpoint: Path | None = cfg.lifelong.start_checkpoint  # None: start from model.name_or_path
    fisher: Path | None = None
    for i, repo in enumerate(ordered):
        # A repository of an earlier run is skipped here, and hands on its checkpoint and Fisher from the manifest.
        name = stage_name(i, repo.display_name, TRAIN)
        train = run_stage(state, name, train_retriever, options, artifacts, dataset=datasets[i], out=jobs / name,
                          checkpoint=checkpoint, fisher=fisher if ewc else None, timeout_s=options.train_timeout_s,
                          label=f"train {repo.display_name}", **common)
        checkpoint = Path(train["checkpoint"])  # the newest (LeanAgent) or the best: lifelong.checkpoint
        # Always, as LeanAgent does, so that EWC can be switched on for a later repository.
        name = stage_name(i, repo.display_name, FISHER)
        result = run_stage(state, name, compute_fisher, options, artifacts, dataset=datasets[i], out=jobs / name,
                           checkpoint=checkpoint, timeout_s=options.fisher_timeout_s,
                           label=f"fisher {repo.display_name}", **common)
        fisher = Path(result["fisher"])
        # The stage's premise index (what `leanagent serve RUN_DIR` serves), its lists extending the last stage's.
        earlier = [Path(folder) for position, _, folder in stage_indexes(state.data) if position < i]
        index = IndexRequest(cfg.run_dir / INDEX_DIR / repo_key(i, repo.display_name),
                             tuple(seen.path for seen in ordered[: i + 1]), earlier[-1] if earlier else None)
        evaluations = run_evaluations(
            state, [(stage_name(i, repo.display_name, eval_stage(j, seen.display_name)), seen.display_name, seen.path)
                    for j, seen in enumerate(ordered[: i + 1])],
            jobs / repo_key(i, repo.display_name) / "evaluate", checkpoint, options, artifacts, index=index,
            timeout_s=options.evaluate_timeout_s, **common)
        report.add_repository(i, train, evaluations)
        report.costs = job_costs(state.data)  # where each job's time went, this repository's included
        if cfg.lifelong.keep_checkpoints == "best_and_last":  # its stages are done: keep start, best, last
            get_run_logger().info(f"{repo.display_name}: deleted {len(prune_checkpoints(train))} other checkpoint(s)")
        artifacts.repository_done()
    return report
