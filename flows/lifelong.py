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
import logging
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Failed, State

from leanagent.checkpoints.files import prune_checkpoints
from leanagent.flows.artifacts import RunArtifacts
from leanagent.flows.stages import Stages
from leanagent.ground.config import ConfigError, PipelineConfig, RepoConfig, resolve_paths
from leanagent.ground.job import JobRequest
from leanagent.launch.registry import load_checked_config
from leanagent.report import RunReport, job_costs, report_from_manifest
from leanagent.run.manifest import (
    EVAL_UNTRAINED,
    FISHER,
    INDEX_DIR,
    JOBS_DIR,
    TRAIN,
    eval_stage,
    repo_key,
    stage_indexes,
    stage_name,
)
from leanagent.run.plan import BAD_INPUT, INLINE, UNRECORDED, RunPlan, plan_run, progress_line
from leanagent.run.shared import SharedWork
from leanagent.run.state import RunLock, RunState
from leanagent.run.strategy import training_datasets
from leanagent.tasks.data import order_curriculum
from leanagent.tasks.options import JobOptions

# The name of a refused run's final state (its type is FAILED): the UI tells it from a failure, and `leanagent
# run`, which prints the reason itself, keeps Prefect's console from repeating it.
REFUSED = "Refused"


class _RefusedInOneLine(logging.Filter):
    """A deployment's run (`python -m prefect.engine`, what a worker or `deployments/serve.py` starts) raises the
    exception of a Failed state once the flow has returned it, and Prefect logs that with its traceback. For a
    refusal the line before it, "Finished in state Refused('<the reason>')", has said all there is: nothing went
    wrong inside, so the traceback is dropped, from the worker's console and the UI's logs alike."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], (*BAD_INPUT, *UNRECORDED)))


for _name in ("prefect.flow_runs", "prefect.engine"):  # where the engine logs a flow run's end, and its own
    if not any(isinstance(f, _RefusedInOneLine) for f in logging.getLogger(_name).filters):
        logging.getLogger(_name).addFilter(_RefusedInOneLine())


def planned(config: PipelineConfig | None, config_path: str | None, plan: RunPlan | None) -> RunPlan:
    """The plan `leanagent run` made, or the one made here from exactly one config source: a file (its relative
    paths resolve against its folder), or a config given inline (UI form, Python: against the working directory)."""
    if sum(given is not None for given in (config, config_path, plan)) != 1:
        raise ConfigError("give exactly one of `config` and `config_path` (or the `plan` `leanagent run` made)")
    if plan is not None:
        return plan
    if config_path is not None:
        return plan_run(load_checked_config(config_path), source=config_path)
    return plan_run(resolve_paths(config, Path.cwd()), source=INLINE)


@flow(name="lifelong-retrieval")
def lifelong_retrieval(config: PipelineConfig | None = None, config_path: str | None = None,
                       options: JobOptions | None = None, plan: RunPlan | None = None,
                       shared_dir: str | None = None) -> dict:
    """Train the premise retriever over the configured repositories, lifelong, and report what it learned and forgot.

    Every input is checked before anything is written or launched; a refused run ends Failed (state "Refused")
    with the reason as its message (no job, no file). Rerunning the same config resumes it: finished stages are
    skipped, an interrupted training job goes on from its last checkpoint. A config that lists more repositories
    (or a `repos_dir` with new folders) continues the run: only the new repositories' jobs run. With nothing new
    (or a config that lists only the run's first repositories: the run is ahead of it) the run ends in seconds and
    says so.

    Args:
        config: The whole experiment (model, data, trainer, lifelong, run_dir, repos, repos_dir), as a form.
            Relative paths resolve against the worker's working directory. Give this or `config_path`, not both.
        config_path: A YAML config file (e.g. configs/demo.yaml), relative to the worker's working directory;
            relative paths inside it resolve against the file's folder.
        options: How jobs are supervised, not what they compute: retries, per-job deadlines and the
            heartbeat timeout. Default: 2 retries, no deadline, a 1-hour heartbeat timeout.
        plan: The checked run `leanagent run` hands over (`leanagent.run.plan.RunPlan`), so that nothing is
            checked twice; leave it empty in a form: the flow checks `config` or `config_path` itself.
        shared_dir: A sweep's shared folder (`lifelong_sweep` gives it to each setup): a job whose inputs another
            setup's job has is run there once and linked into this run. Leave it empty for a run of its own.
    """
    try:
        # Model, devices, disk, a run_dir of another experiment or a sequence the config does not extend, every
        # dataset not yet recorded: before anything is written.
        plan = planned(config, config_path, plan)
        # The repositories the run has, in their places, then the new ones in curriculum order (the percentiles over
        # all of them) or in the given order. Nothing new: no theorem is read.
        ordered = order_curriculum(plan.repos, plan.cfg.lifelong.curriculum, plan.cfg.data.split,
                                   plan.kept) if plan.new else plan.kept_repos
        lock = RunLock(plan.cfg.run_dir).acquire()
    except BAD_INPUT as exc:
        return refused(exc)
    with lock:
        try:  # checked again under the lock: another run may have grown the sequence since the plan read it
            state = RunState(plan.cfg.run_dir, plan.cfg)
            # `trainer.precision: auto`: the precision the run started in, if it has one
            plan = plan.model_copy(update={"cfg": state.config})
            state.extend([plan.entries[r.display_name] for r in ordered], plan.given, plan.source)
            shared = SharedWork(root=Path(shared_dir)) if shared_dir else None
            return _run_curriculum(plan, ordered, state, options or JobOptions(), shared)
        except (*BAD_INPUT, *UNRECORDED) as exc:  # one line, no traceback (UNRECORDED: the disk went wrong)
            return refused(exc)


def refused(exc: Exception) -> State:
    """The flow run's end for bad input: Failed (named REFUSED), with the reason as its message (what the UI shows),
    and no traceback logged, since nothing went wrong inside. Calling the flow raises `exc` itself."""
    return Failed(name=REFUSED, message=str(exc), data=exc)


def _run_curriculum(plan: RunPlan, ordered: list[RepoConfig], state: RunState, options: JobOptions,
                    shared: SharedWork | None = None) -> dict:
    """Every stage of `ordered` the manifest does not have finished, each recorded as it ends. Returns what the flow
    returns: the report as plain data (what `leanagent run` prints) and where the run lives."""
    logger = get_run_logger()
    not_ready = [item.line() for item in plan.not_ready]
    for line in not_ready:
        logger.warning(line)
    names = [r.display_name for r in ordered]
    waiting = [name for name in names if name in plan.waiting or name not in plan.kept]
    if waiting:
        report = _train(plan.cfg, ordered, waiting, state, options, RunArtifacts(RunReport(names), state.path,
                                                                                 not_ready), shared)
    else:
        line = plan.nothing_new() or f"nothing new: {progress_line(len(names), 0, len(not_ready))}"
        logger.info(line)
        report = report_from_manifest(state.manifest)
        RunArtifacts(report, state.path, not_ready).nothing_new(line)
    return {"rows": report.rows, "matrix": report.matrix, "baseline": report.baseline, "order": report.names,
            "lifelong": report.lifelong_metrics(), "manifest": str(state.path), "run_dir": str(plan.cfg.run_dir),
            "not_ready": not_ready, "nothing_new": not waiting}


def _train(cfg: PipelineConfig, ordered: list[RepoConfig], waiting: list[str], state: RunState, options: JobOptions,
           artifacts: RunArtifacts, shared: SharedWork | None = None) -> RunReport:
    """Per repository: train, compute the Fisher, evaluate every repository seen so far. Stage i trains (and computes
    its Fisher) on what its dataset strategy's entry says (`leanagent.data.strategies`): repository i itself
    (`single`), repositories 0..i merged (`merge_all`), or that merge with a drawn share of each earlier
    repository's training theorems (`replay`); a merge is written once under run_dir and recorded in the manifest.
    Evaluation uses each repository's own test split."""
    report, logger = artifacts.report, get_run_logger()
    logger.info(progress_line(len(ordered) - len(waiting), waiting, len(artifacts.not_ready)))
    datasets = training_datasets(cfg, report.names, [r.path for r in ordered], state, log=logger.info)
    jobs = cfg.run_dir / JOBS_DIR
    ewc = cfg.lifelong.ewc_lambda > 0
    stages = Stages(state, options, artifacts, shared)

    def job(program: str, data: list[Path], out: Path, timeout: float | None, **fields: Any) -> JobRequest:
        # The flow has validated every dataset; the jobs need not read them again (evaluation would, n^2 times).
        return JobRequest(program=program, config=cfg, datasets=tuple(data), out=out, timeout=timeout,
                          heartbeat_timeout=options.heartbeat_timeout_s, datasets_checked=True, **fields)

    # The starting model (model.name_or_path, or lifelong.start_checkpoint) on every test split: the row that
    # training gains and transfers are measured from. A continued run scores it on its new repositories only.
    report.set_baseline(stages.evaluations(
        [(stage_name(j, r.display_name, EVAL_UNTRAINED), r.display_name) for j, r in enumerate(ordered)],
        job("evaluate", [r.path for r in ordered], jobs / "untrained" / "evaluate", options.evaluate_timeout_s,
            checkpoint=cfg.lifelong.start_checkpoint)))
    checkpoint: Path | None = cfg.lifelong.start_checkpoint  # None: start from model.name_or_path
    fisher: Path | None = None
    for i, repo in enumerate(ordered):
        # A repository of an earlier run is skipped here, and hands on its checkpoint and Fisher from the manifest.
        name = stage_name(i, repo.display_name, TRAIN)
        train = stages.run(name, job("train", [datasets[i]], jobs / name, options.train_timeout_s,
                                     checkpoint=checkpoint, fisher=fisher if ewc else None,
                                     label=f"train {repo.display_name}"))
        checkpoint = Path(train.checkpoint)  # the newest (LeanAgent) or the best: lifelong.checkpoint
        # Always, as LeanAgent does, so that EWC can be switched on for a later repository.
        name = stage_name(i, repo.display_name, FISHER)
        fisher = Path(stages.run(name, job("fisher", [datasets[i]], jobs / name, options.fisher_timeout_s,
                                           checkpoint=checkpoint, label=f"fisher {repo.display_name}")).fisher)
        # The stage's premise index (what `leanagent serve RUN_DIR` serves), its lists extending the last stage's.
        earlier = [Path(folder) for position, _, folder in stage_indexes(state.manifest) if position < i]
        seen = ordered[: i + 1]
        evaluations = stages.evaluations(
            [(stage_name(i, repo.display_name, eval_stage(j, r.display_name)), r.display_name)
             for j, r in enumerate(seen)],
            job("evaluate", [r.path for r in seen], jobs / repo_key(i, repo.display_name) / "evaluate",
                options.evaluate_timeout_s, checkpoint=checkpoint,
                index=cfg.run_dir / INDEX_DIR / repo_key(i, repo.display_name),
                index_datasets=tuple(r.path for r in seen), index_after=earlier[-1] if earlier else None))
        report.add_repository(i, train, evaluations)
        report.costs = job_costs(state.manifest)  # where each job's time went, this repository's included
        if cfg.lifelong.keep_checkpoints == "best_and_last":  # its stages are done: keep start, best, last
            get_run_logger().info(f"{repo.display_name}: deleted {len(prune_checkpoints(train))} other checkpoint(s)")
        artifacts.repository_done()
    return report
