"""`leanagent run` and `leanagent sweep`: the flows in this process, as commands. The one seam between the CLI and
the flows.

The library (`leanagent/`) knows nothing of Prefect; `leanagent/cli/` reaches the app layer only here,
for the one command that runs a flow. It adds what a terminal needs around the flow:

- a fast first answer: the run's checks (`leanagent.run.plan.plan_run`: config, repositories, model, disk, the
  run_dir's manifest and lock) run before Prefect is imported or its temporary server started, so a bad input
  is one line within a second or two, and a run with nothing new says so and prints its report, without Prefect;
  the flow is then handed that plan (`plan=`), and checks nothing twice;
- Prefect's temporary server when no server is configured (`temporary_server.py`), one message per refused
  input, an exit code.
"""

import logging
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from leanagent.launch.registry import load_checked_config
from leanagent.report import report_from_manifest
from leanagent.report.sweep import load_sweep, sweep_text
from leanagent.run.manifest import MANIFEST_NAME, read_manifest
from leanagent.run.plan import BAD_INPUT, UNRECORDED, RunPlan, plan_run
from leanagent.run.state import RunLock
from leanagent.run.sweep import SWEEP_RECORD, SweepPlan, plan_sweep_file

T = TypeVar("T")


def run_from_cli(config_path: str, overrides: Sequence[str] = ()) -> int:
    """`leanagent run --config FILE`: the checks, then the flow in this process, then a plain-text summary.

    The run is planned here, once (config, repositories, model, disk, the run_dir's manifest and lock), and the flow
    is handed the plan. 1 on bad input (one message, as `leanagent train` prints it) or when a job failed after its
    retries (the CLI's one rule, leanagent/cli/common.py), 128 + signal (130 Ctrl-C, 143 SIGTERM) when interrupted:
    every job has been ended by then and the running stage is recorded `interrupted`.
    """
    try:
        plan = plan_run(load_checked_config(config_path, overrides), source=config_path)
        RunLock(plan.cfg.run_dir).probe()
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    nothing_new = plan.nothing_new()
    if nothing_new is not None:
        for item in plan.not_ready:  # a run that goes on logs them itself
            print(f"warning: {item.line()}", file=sys.stderr)
        print(nothing_new)
        manifest = plan.cfg.run_dir / MANIFEST_NAME
        if manifest.is_file():
            print(report_from_manifest(read_manifest(manifest)).text(time_table=False))
            print(f"\nmanifest: {manifest} (each job's time: leanagent report {plan.cfg.run_dir})")
        return 0
    return _run_flow(plan)


def _run_flow(plan: RunPlan) -> int:
    from leanagent.flows.lifelong import lifelong_retrieval

    code, summary = _in_prefect(lambda: lifelong_retrieval(plan=plan))
    if summary is None:
        return code
    # The manifest holds all the report shows, each job's time included: here in one line, by job in the report.
    print(report_from_manifest(read_manifest(Path(summary["manifest"]))).text(time_table=False))
    print(f"\nmanifest: {summary['manifest']} (each job's time: leanagent report {summary['run_dir']})")
    return 0


def _in_prefect(flow_call: Callable[[], T]) -> tuple[int, T | None]:
    """Call a flow under Prefect's temporary server (when no server is configured): (0, what it returned), or (the
    exit code, None) with one line on stderr when an input was refused, a job failed after its retries, or it was
    interrupted (every job ended by then)."""
    # Imported here, once the checks have passed: Prefect and the flow's modules take seconds to import, which a
    # refused input or a run with nothing new must not wait for.
    from prefect.exceptions import ExternalSignal

    from leanagent.flows.lifelong import REFUSED
    from leanagent.flows.stages import describe_interrupt
    from leanagent.flows.temporary_server import TemporaryServerError, send_queued, temporary_server
    from leanagent.launch.base import LaunchError

    try:
        with temporary_server(), _NotTwice.on_the_console(REFUSED):
            try:
                return 0, flow_call()
            finally:
                send_queued()
    except (*BAD_INPUT, *UNRECORDED, TemporaryServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1, None
    except LaunchError as exc:
        print(f"error: a job failed after its retries: {exc}", file=sys.stderr)
        return 1, None
    except (KeyboardInterrupt, ExternalSignal) as exc:
        code = getattr(exc, "exit_code", None) or 128 + int(getattr(exc, "signal", signal.SIGINT))
        print(f"interrupted by {describe_interrupt(exc)}: every job was ended; rerun the same command to resume",
              file=sys.stderr)
        return code, None


def sweep_from_cli(sweep_path: str, overrides: Sequence[str] = (), base: str | None = None,
                   sweep_dir: str | None = None, max_parallel: int | None = None) -> int:
    """`leanagent sweep --config FILE`: every setup checked (as `leanagent run` checks its config), then the sweep
    flow in this process, then its table. `base`, `sweep_dir`, `max_parallel`: the sweep file's keys, replaced
    (paths given here are relative to the working directory); `overrides`: settings for every setup.

    0 when every setup finished, 1 on bad input (one line) or when a setup failed (the table says which), 128 +
    signal when interrupted (every job ended; rerun to resume). A sweep with nothing to do prints its table without
    starting Prefect."""
    try:
        plan = plan_sweep_file(sweep_path, list(overrides), base, sweep_dir, max_parallel)
        RunLock(plan.sweep_dir).probe()
        for setup in plan.setups:
            RunLock(setup.run_dir).probe()
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    rows = load_sweep(plan.sweep_dir) if (plan.sweep_dir / SWEEP_RECORD).is_file() else []
    done = {row.name for row in rows if row.run is not None}
    if all(setup.plan.nothing_new() is not None and setup.name in done for setup in plan.setups):
        print(f"nothing new: every setup of {plan.sweep_dir} has finished")
        _sweep_table(plan.sweep_dir)
        return 0
    return _sweep_flow(plan)


def _sweep_flow(plan: SweepPlan) -> int:
    from leanagent.flows.lifelong import REFUSED
    from leanagent.flows.sweep import lifelong_sweep

    code, state = _in_prefect(lambda: lifelong_sweep(plan=plan, return_state=True))
    if state is None:
        return code
    if state.name == REFUSED:
        print(f"error: {state.message}", file=sys.stderr)
        return 1
    _sweep_table(plan.sweep_dir)
    if not state.is_completed():
        print(f"error: {state.message}", file=sys.stderr)
        return 1
    return 0


def _sweep_table(sweep_dir: Path) -> None:
    """The sweep's table, as `leanagent report SWEEP_DIR` prints it, and where to look further."""
    print(sweep_text(load_sweep(sweep_dir), source=str(sweep_dir)))
    print(f"\neach setup's recall matrix: leanagent report {sweep_dir}/NAME; shared jobs: {sweep_dir}/shared/jobs")


class _NotTwice(logging.Filter):
    """Keeps Prefect's console from repeating a refusal that `leanagent run` prints itself: the flow run's
    "Finished in state Refused('<the reason>', type=FAILED)" line. Prefect's API logs (the UI) keep it."""

    def __init__(self, state_name: str) -> None:
        super().__init__()
        self.line = f"Finished in state {state_name}("

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.line)

    @classmethod
    @contextmanager
    def on_the_console(cls, state_name: str) -> Iterator[None]:
        handlers = [h for h in logging.getLogger().handlers if type(h).__name__ == "PrefectConsoleHandler"]
        quiet = cls(state_name)
        for handler in handlers:
            handler.addFilter(quiet)
        try:
            yield
        finally:
            for handler in handlers:
                handler.removeFilter(quiet)
