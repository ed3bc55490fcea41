"""How long `leanagent run` waits for Prefect's temporary server: long enough for a busy machine, unless told."""

from __future__ import annotations

import subprocess
import sys

import pytest
from leanagent.flows.temporary_server import STARTUP_FLOOR_S, ServerOutput, startup_timeout
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

from tests.waiting import wait_for


def test_prefects_20_s_default_is_raised_to_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)
    assert PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() < STARTUP_FLOOR_S
    assert startup_timeout() == STARTUP_FLOOR_S


def test_a_timeout_the_user_set_is_taken_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "7")
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 7}):
        assert startup_timeout() == 7


def test_the_servers_output_is_shown_until_the_stop_begins_then_dropped(tmp_path) -> None:
    """What the server prints while the command runs reaches the terminal; its shutdown noise (SQLAlchemy's
    cancelled-rollback tracebacks) does not. A real child process, synchronised by its stdin, not by a clock."""
    shown = tmp_path / "stderr"
    with shown.open("wb") as sink:
        output = ServerOutput(sink_fd=sink.fileno())
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys\nprint('while running', flush=True)\nsys.stdin.readline()\n"
             "print('Exception during reset or similar', file=sys.stderr, flush=True)"],
            stdin=subprocess.PIPE, stdout=output.writer, stderr=output.writer)
        output.started()
        wait_for(lambda: b"while running" in shown.read_bytes(), 120, "the line printed while running", child,
                 shown.read_text)
        output.cut()
        child.communicate(b"stop\n", timeout=120)
        output.close(timeout=120)
    assert shown.read_text() == "while running\n"
    assert not output._pump.is_alive()  # read to the end: the child was never left blocked on the pipe
