"""A sweep as one Prefect flow run: every setup a child flow run of `lifelong_retrieval`, `max_parallel` at once.

Read top to bottom: check every setup (`leanagent.run.sweep.plan_sweep`: each setup's config and its run_dir, as
`leanagent run` checks a config), take the sweep's lock, then run each setup that has something to do as a child
flow run in sweep_dir/NAME, sharing the jobs whose identity another setup's job has (sweep_dir/shared; the flow's
`shared_dir`). The table of setups (`leanagent.report.sweep`) is refreshed as an artifact of the sweep's flow run
as each setup finishes, and `sweep.json` records what became of each.

Why threads: a Prefect 3 subflow runs in the process and thread that calls it, and `lifelong_retrieval` is a
synchronous flow whose jobs are waited for in its thread (torchrun locally, `squeue` on SLURM). Calling it from
`max_parallel` worker threads, each with a copy of the sweep's context, keeps every setup a real child flow run of
the sweep's flow run (Prefect finds the parent in the context: the UI nests each setup under the sweep), runs the
same way under `leanagent sweep`, a deployment, and any launcher (on SLURM the concurrent setups' jobs are queued
together, each setup submitting its own), and needs no worker or deployment per setup, which `run_deployment`
would. An interrupt (Ctrl-C, SIGTERM, a cancelled flow run) reaches the main thread only: it is raised in every
setup's thread (`raise_in_thread`), whose launcher then ends its job as it would in the main thread.
"""

# No `from __future__ import annotations`: see flows/lifelong.py (Prefect resolves the flow module's annotations).
import contextvars
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.states import Failed, State

from leanagent.flows.lifelong import REFUSED, lifelong_retrieval, refused
from leanagent.flows.stages import describe_interrupt
from leanagent.ground.config import ConfigError
from leanagent.ground.supervision import HoldSignals, raise_in_thread
from leanagent.report.sweep import artifact_rows, load_sweep, sweep_json, sweep_text
from leanagent.run.plan import BAD_INPUT, INLINE, UNRECORDED
from leanagent.run.state import RunLock
from leanagent.run.sweep import SetupPlan, SweepFile, SweepPlan, SweepRecord, plan_sweep, plan_sweep_file
from leanagent.tasks.options import JobOptions

TABLE_KEY = "lifelong-sweep-table"
SUMMARY_KEY = "lifelong-sweep-summary"
# After an interrupt, how long the sweep waits for its setups' launchers to end their jobs (each takes at most
# INTERRUPT_GRACE_SECONDS and a kill) before it lets the interrupt go on.
INTERRUPT_WAIT_S = 25.0


class SetupInterrupted(KeyboardInterrupt):
    """Raised in a setup's thread when the sweep is interrupted: its launcher ends its job, its stage is recorded
    interrupted (it reruns)."""


def planned_sweep(sweep_path: str | None, sweep: SweepFile | None, overrides: list[str], base_path: str | None,
                  plan: SweepPlan | None) -> SweepPlan:
    """The plan `leanagent sweep` made, or the one made here from exactly one source: a sweep file (its relative
    paths resolve against its folder), or a sweep given inline (the UI form: against the working directory)."""
    if sum(given is not None for given in (sweep_path, sweep, plan)) != 1:
        raise ConfigError("give exactly one of `sweep_path` and `sweep` (or the `plan` `leanagent sweep` made)")
    if plan is not None:
        return plan
    if sweep_path is not None:
        return plan_sweep_file(sweep_path, overrides, base_path)
    if base_path is not None:
        sweep = sweep.model_copy(update={"base": Path(base_path).resolve()})
    return plan_sweep(sweep, INLINE, Path.cwd(), overrides)


@flow(name="lifelong-sweep")
def lifelong_sweep(sweep_path: str | None = None, sweep: SweepFile | None = None, base_path: str | None = None,
                   overrides: list[str] | None = None, options: JobOptions | None = None,
                   plan: SweepPlan | None = None) -> dict:
    """Run several setups of one lifelong experiment (LeanAgent's Table 4, replay, your own) as one: each setup an
    ordinary run in sweep_dir/NAME and a child flow run of this one, the jobs they share run once, and their
    lifelong metrics side by side.

    Every setup is checked before anything is written; a refused sweep ends Failed (state "Refused") with the
    reason. Rerunning the same sweep resumes it: finished stages are skipped, a finished setup is not started, and a
    setup added to the sweep file is the only one that runs. A setup whose overrides changed is refused, naming the
    keys that changed. A setup that fails does not stop the others; the sweep then ends Failed, naming it.

    Args:
        sweep_path: A sweep file (e.g. configs/leanagent-table4.yaml), relative to the worker's working directory:
            base, sweep_dir, max_parallel and setups (each a name and its overrides, KEY=VALUE).
        sweep: The same, as a form; relative paths resolve against the worker's working directory.
        base_path: A config file to use as every setup's base instead of the sweep's own (e.g. one listing your
            repositories), relative to the worker's working directory.
        overrides: KEY=VALUE settings applied to every setup, before its own (e.g. trainer.accelerator=cpu).
        options: How jobs are supervised: retries, per-job deadlines and the heartbeat timeout (every setup's).
        plan: The checked sweep `leanagent sweep` hands over; leave it empty in a form.
    """
    try:
        plan = planned_sweep(sweep_path, sweep, list(overrides or []), base_path, plan)
        lock = RunLock(plan.sweep_dir).acquire()
    except BAD_INPUT as exc:
        return refused(exc)
    with lock:
        try:
            return _run_sweep(plan, options or JobOptions())
        except UNRECORDED as exc:
            return refused(exc)


def _run_sweep(plan: SweepPlan, options: JobOptions) -> dict | State:
    logger = get_run_logger()
    record = SweepRecord(plan)
    todo = []
    for setup in plan.setups:
        line = setup.plan.nothing_new()
        if line is None:
            todo.append(setup)
        else:
            logger.info(f"setup {setup.name}: {line}")
            record.set(setup.name, "done")
    logger.info(f"{len(todo)} of {len(plan.setups)} setups to run, at most {plan.max_parallel} at once; shared jobs "
                f"in {plan.shared_dir}")
    _publish(plan, f"{len(todo)} setups to run")
    failed = _run_setups(plan, todo, options, record)
    rows = load_sweep(plan.sweep_dir)
    _publish(plan, "sweep finished" if not failed else f"{len(failed)} setup(s) failed", rows)
    summary = {"sweep_dir": str(plan.sweep_dir), "shared_dir": str(plan.shared_dir), "ran": [s.name for s in todo],
               "failed": failed, **sweep_json(rows)}
    if failed:
        names = "; ".join(f"{name}: {message}" for name, message in failed.items())
        return Failed(message=f"{len(failed)} of {len(plan.setups)} setups failed ({names})", data=summary)
    return summary


def _run_setups(plan: SweepPlan, todo: list[SetupPlan], options: JobOptions, record: SweepRecord) -> dict[str, str]:
    """Each setup of `todo` a child flow run in a thread of its own, `max_parallel` at once; returns the failed
    setups' reasons. An interrupt is raised in every setup's thread, and goes on once their jobs have ended."""
    running: dict[str, int] = {}  # setup name -> the ident of the thread running it
    mutex = threading.Lock()
    failed: dict[str, str] = {}

    def run(setup: SetupPlan) -> State:
        with mutex:
            running[setup.name] = threading.get_ident()
        try:
            record.set(setup.name, "running")
            child = lifelong_retrieval.with_options(flow_run_name=setup.name)
            return child(plan=setup.plan, options=options, shared_dir=str(plan.shared_dir), return_state=True)
        finally:
            with mutex:
                running.pop(setup.name, None)

    pool = ThreadPoolExecutor(max_workers=plan.max_parallel, thread_name_prefix="leanagent-setup")
    futures: dict[Future, SetupPlan] = {pool.submit(contextvars.copy_context().run, run, setup): setup
                                        for setup in todo}
    pending = set(futures)
    try:
        while pending:
            finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in finished:
                name = futures[future].name
                status, message = _outcome(future)
                record.set(name, status, message)
                if status != "done":
                    failed[name] = message or status
                get_run_logger().info(f"setup {name}: {status}" + (f" ({message})" if message else ""))
                _publish(plan, f"setup {name}: {status}")
    except BaseException as exc:
        with HoldSignals():  # a second Ctrl-C must not cut short the ending of the setups' jobs
            for future in pending:
                future.cancel()
            with mutex:
                threads = list(running.values())
            for ident in threads:
                raise_in_thread(ident, SetupInterrupted)
            wait(pending, timeout=INTERRUPT_WAIT_S)
            for future, setup in futures.items():
                if future.cancelled():
                    record.set(setup.name, "waiting")
                elif not future.done():  # its job could not be ended in time: the rerun finds it running or not
                    record.set(setup.name, "interrupted", describe_interrupt(exc))
                elif future in pending:
                    record.set(setup.name, *_outcome(future))
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return failed


def _outcome(future: Future) -> tuple[str, str | None]:
    """(status, reason) of a setup's child flow run."""
    exc = future.exception()
    if exc is not None:
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            return "interrupted", describe_interrupt(exc)
        return "failed", f"{type(exc).__name__}: {exc}"
    state: State = future.result()
    if state.is_completed():
        return "done", None
    reason = (state.message or state.name or "failed").strip().splitlines()[-1][:300]
    return "failed", f"refused: {reason}" if state.name == REFUSED else reason


def _publish(plan: SweepPlan, note: str, rows: list | None = None) -> None:
    """The sweep's table and summary artifacts, refreshed (the UI shows the latest version of each key)."""
    rows = rows if rows is not None else load_sweep(plan.sweep_dir)
    create_table_artifact(table=artifact_rows(rows), key=TABLE_KEY,
                          description=f"Lifelong metrics per setup ({note})")
    create_markdown_artifact(markdown=sweep_text(rows, markdown=True, source=str(plan.sweep_dir)), key=SUMMARY_KEY,
                             description="The sweep's setups side by side, as LeanAgent's Table 4")
