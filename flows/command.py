"""`leanagent run`: the lifelong flow in this process, as a command. The one seam between the CLI and the flows.

The library (`leanagent/`) knows nothing of Prefect; `leanagent/cli.py` reaches the app layer only here,
for the one command that runs a flow. It adds what a terminal needs around the flow: Prefect's temporary
server when no server is configured (`temporary_server.py`), one message per refused input, an exit code.
"""

import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.exceptions import ExternalSignal

from flows.lifelong import BAD_INPUT, REFUSALS, describe_interrupt, lifelong_retrieval
from flows.temporary_server import TemporaryServerError, send_queued, temporary_server
from leanagent.config import load_config
from leanagent.launch.base import LaunchError
from leanagent.report import RunReport


def run_from_cli(config_path: str) -> int:
    """`leanagent run --config FILE`: the flow in this process, then a plain-text summary.

    1 on bad input (one message, as `leanagent train` prints it), 2 when a job failed after its retries,
    128 + signal (130 Ctrl-C, 143 SIGTERM) when interrupted: every job has been ended by then and the
    running stage is recorded `interrupted`.
    """
    try:
        load_config(config_path)  # fail in milliseconds, before Prefect starts a temporary server
        with temporary_server(), _NotTwice.on_the_console():
            try:
                summary = lifelong_retrieval(config_path=config_path)
            finally:
                send_queued()
    except (*BAD_INPUT, TemporaryServerError) as exc:
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


class _NotTwice(logging.Filter):
    """Keeps Prefect's console from repeating a refusal that `leanagent run` prints itself: the flow run's
    "Finished in state Failed('<the reason>')" line. Prefect's API logs (the UI) keep it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Finished in state Failed(") and any(r in message or repr(r)[1:-1] in message
                                                                           for r in REFUSALS))

    @classmethod
    @contextmanager
    def on_the_console(cls) -> Iterator[None]:
        handlers = [h for h in logging.getLogger().handlers if type(h).__name__ == "PrefectConsoleHandler"]
        quiet = cls()
        for handler in handlers:
            handler.addFilter(quiet)
        try:
            yield
        finally:
            for handler in handlers:
                handler.removeFilter(quiet)
