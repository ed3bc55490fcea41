"""How long `leanagent run` waits for Prefect's temporary server: long enough for a busy machine, unless told."""

from __future__ import annotations

import pytest
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

from flows.temporary_server import STARTUP_FLOOR_S, startup_timeout


def test_prefects_20_s_default_is_raised_to_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)
    assert PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() < STARTUP_FLOOR_S
    assert startup_timeout() == STARTUP_FLOOR_S


def test_a_timeout_the_user_set_is_taken_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "7")
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 7}):
        assert startup_timeout() == 7
