"""A stage of the lifelong flow: skipped when the manifest has it finished, otherwise run and recorded either way.

One context, `recording`, says how a stage's outcome reaches the manifest: `running` when it starts, then `done`
with its result, `failed` with the error, or `interrupted` when it was stopped from outside (it reruns). Every
stage goes through it: one training or Fisher job (`Stages.run`), or one evaluation job that scores a model on
several repositories, each its own stage (`Stages.evaluations`). Each is one `JobRequest`, launched by the task
`rank_job`; what a stage records is the result model its job returned. In a sweep's setup the launch is
cached by the job's identity (`leanagent.tasks.shared`): a job another setup of the sweep has run, or is running,
is not run again, and its files and result are made this setup's own (`Stages._launch`, the one place a shared
result becomes a stage's).
"""

# No `from __future__ import annotations`: see flows/lifelong.py (Prefect resolves the flow module's annotations).
import asyncio
import signal
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger
from prefect.exceptions import Abort, ExternalSignal

from leanagent.flows.artifacts import RunArtifacts
from leanagent.ground.job import JobRequest
from leanagent.ground.results import EvaluateResult, JobResult, StageResult
from leanagent.ground.supervision import HoldSignals
from leanagent.run.identity import job_identity
from leanagent.run.shared import SharedWork, finished_result
from leanagent.run.state import RunState, RunStateWriteError
from leanagent.tasks.jobs import rank_job
from leanagent.tasks.options import JobOptions
from leanagent.tasks.shared import shared_task

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


@contextmanager
def recording(state: RunState, names: list[str], artifacts: RunArtifacts | None) -> Iterator[None]:
    """Marks the stages `names` running for the duration of the block; an exception out of it records each as
    interrupted or failed, with signals held so that a second one cannot leave a stage "running", and goes on.
    The caller records the results (`state.record`) once the block has returned them."""
    for name in names:
        state.start(name)
    if artifacts is not None:
        artifacts.stages_running(names)
    try:
        yield
    except INTERRUPTS as exc:
        with HoldSignals():
            for name in names:
                state.interrupt(name, describe_interrupt(exc))
        raise
    except BaseException as exc:
        with HoldSignals():
            try:
                for name in names:
                    state.fail(name, f"{type(exc).__name__}: {exc}")
            except RunStateWriteError as unrecorded:  # a full disk fails the job and its record alike
                first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                raise RunStateWriteError(f"{', '.join(names)} failed ({first[:200]}), and the failure could not be "
                                         f"recorded: {unrecorded}") from None
        raise


class Stages:
    """The stages of one run, each a job of the task `rank_job` (retried as `options` say), skipped when the manifest
    has it finished, and recorded in the manifest and the artifacts either way. With `shared` (a sweep's setup), each
    job is shared with the sweep's other setups by its identity."""

    def __init__(self, state: RunState, options: JobOptions, artifacts: RunArtifacts | None = None,
                 shared: SharedWork | None = None) -> None:
        self.state, self.options, self.artifacts, self.shared = state, options, artifacts, shared

    def _finished(self, name: str) -> StageResult | None:
        done = self.state.stage_done(name)
        if done is not None:
            get_run_logger().info(f"{name}: finished in an earlier run; skipped")
            if self.artifacts is not None:
                self.artifacts.stages_done([name], publish=False)
        return done

    def _launch(self, run_name: str, job: JobRequest) -> JobResult:
        retries = {"task_run_name": run_name, "retries": self.options.retries,
                   "retry_delay_seconds": self.options.retry_delay_s}
        if self.shared is None:
            return rank_job.with_options(**retries)(job=job)
        # A sweep's setup: the job in its shared folder, run there once for every setup whose job has its identity.
        done = finished_result(job)  # made this setup's own before a crash, or run before the sweep
        if done is not None:
            return done
        identity = job_identity(job).digest()
        shared = self.shared.request(job, identity)
        get_run_logger().info(f"{run_name}: identity {identity[:12]}, shared by the sweep's setups in {shared.out}")
        ran = shared_task(self.shared, **retries)(job=shared)
        return self.shared.materialize(ran, job, log=get_run_logger().info)

    def run(self, name: str, job: JobRequest) -> StageResult:
        """Skip a stage the manifest has finished; otherwise run its job and record the outcome either way. The
        stage's result is its job's (a `TrainResult`, a `FisherResult`)."""
        done = self._finished(name)
        if done is not None:
            return done
        with recording(self.state, [name], self.artifacts):
            result = self._launch(name, job)
        self.state.record(name, result)
        if self.artifacts is not None:
            self.artifacts.stages_done([name])
        return result

    def evaluations(self, stages: list[tuple[str, str]], job: JobRequest) -> list[EvaluateResult]:
        """Evaluate one model on several repositories in ONE job, each recorded as its own stage.

        `stages`: (stage name, repository name) each, for the datasets of `job` in order. One torchrun start and
        one model load per repository stage, so a run of T repositories launches T + 1 evaluation jobs, not
        T(T+1)/2 + T. Finished stages are skipped; the job folder is named by the stages it runs, so a rerun after a
        partial record never mixes two sets. Each stage records the job's result for its repository alone
        (`EvaluateResult.one`: the job's folder, cost and premise index included, the index read by
        `stage_indexes`).
        """
        pending = [(k, name, repo, dataset) for k, ((name, repo), dataset) in enumerate(zip(stages, job.datasets,
                                                                                            strict=True))
                   if self._finished(name) is None]
        if pending:
            suffix = "-".join(f"{k:02d}" for k, _, _, _ in pending)
            names = [name for _, name, _, _ in pending]
            out = job.out.with_name(f"{job.out.name}-{suffix}")
            job = job.model_copy(update={"datasets": tuple(d for _, _, _, d in pending), "out": out,
                                         "label": f"evaluate {','.join(repo for _, _, repo, _ in pending)}"})
            with recording(self.state, names, self.artifacts):
                result = self._launch(f"{out.parent.name}/{out.name}", job)
            for name, k in zip(names, range(len(result.evaluations)), strict=True):
                self.state.record(name, result.one(k))
            if self.artifacts is not None:
                self.artifacts.stages_done(names)
        return [self.state.stage_done(name) for name, _ in stages]
