"""The suite's one way to wait: poll a condition until it holds, or fail naming what was awaited.

A test waits for an event (a file, a log line, a queue state) by polling for it, with a generous deadline (a busy
2-core machine); `proc`, when given, is the process that should bring the event about: its end fails the wait at
once, with `output()` (what it printed), instead of after the deadline.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import pytest

POLL_S = 0.2


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen | None = None,
             output: Callable[[], str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            shown = f":\n{output()}" if output is not None else ""
            pytest.fail(f"the process exited ({proc.returncode}) before {what}{shown}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(POLL_S)
